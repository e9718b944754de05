package offsets

// SQLite's statements: those of the lease mode (SQLite has no advisory locks).
//
// SQLite has one writer at a time, and a message's offset (INTEGER PRIMARY KEY AUTOINCREMENT)
// is given when its row is written, inside the one write transaction running: offsets commit
// in order, so a group's position is just the last offset it handed out, and a message
// committed late can never sit behind it (PostgreSQL needs the xid horizon for that). Times
// are integer Unix milliseconds, read from SQLite's clock inside each statement (sqliteNow),
// so that consumers in several processes compare one clock's values.
//
// A claim is one short write transaction (BEGIN IMMEDIATE) that takes many messages; a
// settlement is one statement for many claims, fenced by each claim's key and token like on
// PostgreSQL. With one writer no row changes under a statement: a settlement returns exactly
// the claims it matched and applied. A delayed message (deliver_at) and a move to the
// dead-letter topic work as on PostgreSQL; where PostgreSQL does it in one statement,
// SQLite takes two in one write transaction (a DELETE cannot feed an INSERT there).

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
)

// sqliteNow is the time of the statement on SQLite's clock, in Unix milliseconds (SQLite keeps
// one 'now' for the whole statement). SQLite's clock counts whole milliseconds, and the
// julianday arithmetic lands a hair above or below them: it is rounded, not cut, or 'now' would
// often read a millisecond early, and a claim run just as a delayed message's time came would
// not find it due.
const sqliteNow = `CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)`

// sqlite is the database of SQLite; its sqliteTopic is set by prepare.
type sqlite struct{ *sqliteTopic }

func (sqlite) dialect() dbx.Dialect { return dbx.SQLite }

func (sqlite) quote(schema, name string) string { return ident.Qualified(schema, name) }

func (sqlite) appending(ctx context.Context, q dbx.Querier, fn func(dbx.Querier) error) error {
	return fn(q)
}

// tableName: SQLite compares table names without regard to case, even quoted, so the names of
// a topic with an upper-case letter carry a hash of the topic (see ident.SQLiteTableName):
// "Orders" and "orders" keep tables of their own. An all-lower-case topic's names are those of
// PostgreSQL.
func (sqlite) tableName(prefix, topic, suffix string) string {
	return ident.SQLiteTableName(prefix, topic, suffix)
}

// schemaSQL: the DDL of the topic's tables on SQLite. The schema version and the topic
// are written in comments inside the CREATE TABLE statements, which SQLite keeps in
// sqlite_schema: SQLite has no table comments.
func (sqlite) schemaSQL(t Tables) string {
	var b strings.Builder
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %s ( -- %s%d
	"offset"     INTEGER PRIMARY KEY AUTOINCREMENT,
	"uuid"       TEXT    NOT NULL,
	"payload"    BLOB    NOT NULL,
	"metadata"   TEXT    NOT NULL DEFAULT '{}',
	"created_at" INTEGER NOT NULL DEFAULT (%s),
	"deliver_at" INTEGER
);
`, t.Messages, schemaCommentPrefix, SQLiteSchemaVersion, sqliteNow)
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %s ( -- %s%s
	"group_id"       INTEGER PRIMARY KEY AUTOINCREMENT,
	"consumer_group" TEXT    NOT NULL UNIQUE,
	"last_offset"    INTEGER NOT NULL,
	"updated_at"     INTEGER NOT NULL
);
`, t.Groups, topicCommentPrefix, t.Topic)
	// order_key is the order key of a claim of a group ordered by key (the metadata's
	// MetaOrderKey, as text), NULL for a message without one and in a group that is not
	// ordered; its index serves the ordered claim (see claimOrderedIn).
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %s (
	"group_id"   INTEGER NOT NULL,
	"offset"     INTEGER NOT NULL,
	"token"      INTEGER NOT NULL,
	"visible_at" INTEGER NOT NULL,
	"attempts"   INTEGER NOT NULL,
	"order_key"  TEXT,
	PRIMARY KEY ("group_id", "offset")
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS %s ON %s ("group_id", "order_key", "visible_at") WHERE "order_key" IS NOT NULL;
`, t.Claims, sqliteKeyIndex(t), t.Claims)
	return b.String()
}

// sqliteKeyIndex names the index of the claims table by order key.
func sqliteKeyIndex(t Tables) string {
	return ident.Quote(ident.SQLiteTableName(t.prefix, t.Topic, "_c_key"))
}

// createIn runs the DDL in the caller's write transaction: BEGIN IMMEDIATE holds the
// database's write lock, which serialises concurrent creators as PostgreSQL's advisory lock
// does.
//
// Tables written before delayed messages came to SQLite carry the same version without the
// messages table's deliver_at column (sqliteNoDeliverAt), and those written before order by
// key came to SQLite without the claims table's order_key column (sqliteNoOrderKey): the
// columns are added here, before the DDL, whose index reads order_key. SQLite adds a nullable
// column without a default by changing only the table's DDL, whatever the number of rows, and
// every row reads NULL: not delayed, no order key (a claim of a group that was not ordered).
// SchemaSQL cannot do it, as SQLite has neither ADD COLUMN IF NOT EXISTS nor conditional DDL.
func (db sqlite) createIn(ctx context.Context, t Tables, tx dbx.Querier) error {
	if err := db.check(ctx, t, tx, true); err != nil {
		var v *VersionError
		if !errors.As(err, &v) || v.Found != sqliteNoDeliverAt && v.Found != sqliteNoOrderKey {
			return err
		}
		var noDeliverAt, noOrderKey int64
		if err := dbx.QueryRow(ctx, tx, `SELECT
	NOT EXISTS (SELECT 1 FROM pragma_table_info(?) WHERE name = 'deliver_at'),
	EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ? COLLATE NOCASE)
	  AND NOT EXISTS (SELECT 1 FROM pragma_table_info(?) WHERE name = 'order_key')`,
			[]any{t.MessagesName, t.ClaimsName, t.ClaimsName}, &noDeliverAt, &noOrderKey); err != nil {
			return err
		}
		if noDeliverAt != 0 {
			if _, err := tx.Exec(ctx, fmt.Sprintf(`ALTER TABLE %s ADD COLUMN "deliver_at" INTEGER`, t.Messages)); err != nil {
				return err
			}
		}
		if noOrderKey != 0 {
			if _, err := tx.Exec(ctx, fmt.Sprintf(`ALTER TABLE %s ADD COLUMN "order_key" TEXT`, t.Claims)); err != nil {
				return err
			}
		}
	}
	_, err := tx.Exec(ctx, db.schemaSQL(t))
	return err
}

// sqliteNoDeliverAt is the VersionError.Found of a SQLite messages table that carries this
// schema version without its deliver_at column, which InitializeSchema adds.
var sqliteNoDeliverAt = fmt.Sprintf("%s%d without deliver_at", schemaCommentPrefix, SQLiteSchemaVersion)

// sqliteNoOrderKey is the VersionError.Found of SQLite tables that carry this schema version
// without the claims table's order_key column, which InitializeSchema adds.
var sqliteNoOrderKey = fmt.Sprintf("%s%d without order_key", schemaCommentPrefix, SQLiteSchemaVersion)

// check reads the catalog as SQLite resolves a table name: without regard to (ASCII)
// case, so that it finds the table CREATE TABLE IF NOT EXISTS would find.
func (sqlite) check(ctx context.Context, t Tables, q dbx.Querier, missingOK bool) error {
	var m, g, c, deliverAt, orderKey int64
	var ddl string
	err := dbx.QueryRow(ctx, q, `SELECT
	EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ? COLLATE NOCASE),
	EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ? COLLATE NOCASE),
	EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ? COLLATE NOCASE),
	coalesce((SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ? COLLATE NOCASE), ''),
	EXISTS (SELECT 1 FROM pragma_table_info(?) WHERE name = 'deliver_at'),
	EXISTS (SELECT 1 FROM pragma_table_info(?) WHERE name = 'order_key')`,
		[]any{t.MessagesName, t.GroupsName, t.ClaimsName, t.MessagesName, t.MessagesName, t.ClaimsName}, &m, &g, &c, &ddl, &deliverAt, &orderKey)
	if err != nil {
		return err
	}
	if !missingOK {
		for _, x := range []struct {
			ok   int64
			name string
		}{{m, t.Messages}, {g, t.Groups}, {c, t.Claims}} {
			if x.ok == 0 {
				return &MissingTableError{Topic: t.Topic, Table: x.name, Database: dbx.SQLite.Name}
			}
		}
	}
	if m != 0 {
		found := ""
		if _, after, ok := strings.Cut(ddl, schemaCommentPrefix); ok {
			end := strings.IndexFunc(after, func(r rune) bool { return r < '0' || r > '9' })
			if end < 0 {
				end = len(after)
			}
			found = after[:end]
		}
		if n, err := strconv.Atoi(found); err != nil || n != SQLiteSchemaVersion {
			return &VersionError{Topic: t.Topic, Table: t.Messages, Found: schemaCommentPrefix + found, Want: SQLiteSchemaVersion}
		}
		if deliverAt == 0 {
			return &VersionError{Topic: t.Topic, Table: t.Messages, Found: sqliteNoDeliverAt, Want: SQLiteSchemaVersion}
		}
	}
	if c != 0 && orderKey == 0 {
		return &VersionError{Topic: t.Topic, Table: t.Claims, Found: sqliteNoOrderKey, Want: SQLiteSchemaVersion}
	}
	return nil
}

// sqliteTopic holds the SQL text of a topic's statements on SQLite.
type sqliteTopic struct {
	t Tables

	peekSQL      string // is anything waiting or due, without the write lock
	positionSQL  string
	readNewSQL   string
	insClaimsSQL string
	advanceSQL   string
	dueSQL       string
	readSQL      string // messages by offset: the prefix, then "?,?,...)"
	insertPrefix string
	insDelPrefix string // insertPrefix with the deliver_at column
	ensureGrpSQL string
	lookupGrpSQL string
	pruneSQL     string
	ackPrefix    string
	nackPrefix   string
	relPrefix    string
	extPrefix    string

	// The claim of a group ordered by key (claimOrdered).
	ordPeekSQL  string // is anything new, due or free to go, without the write lock
	ordPosSQL   string // positionSQL with the count of parked claims
	ordDueSQL   string // dueSQL without parked claims
	unparkSQL   string
	ordReadSQL  string // readNewSQL with each message's order key, and whether it has claims
	ordClaimSQL string // insClaimsSQL with the order key, and the parked messages given
}

// prepare: asyncCommit does not apply (a commit waits for what synchronous says).
func (sqlite) prepare(t Tables, _ bool) database {
	s := &sqliteTopic{t: t}
	s.peekSQL = fmt.Sprintf(`SELECT
	EXISTS (SELECT 1 FROM %[2]s m WHERE m."offset" > g."last_offset"),
	CASE WHEN ? THEN EXISTS (SELECT 1 FROM %[3]s c WHERE c."group_id" = g."group_id" AND c."visible_at" <= %[4]s) ELSE 0 END
FROM %[1]s g WHERE g."group_id" = ?`, t.Groups, t.Messages, t.Claims, sqliteNow)
	// The claim of new messages reads the clock once, with the group's position, and both of
	// its other statements decide with that one value which messages are delayed (deliver_at
	// still to come): the one that reads them and the one that writes their claim rows. A
	// delayed message gets a claim row due at its time with no holder (token 0, attempt 0),
	// which the claims due again take once it has come, as on PostgreSQL; the group's
	// position passes it.
	s.positionSQL = fmt.Sprintf(`SELECT "last_offset", %s FROM %s WHERE "group_id" = ?`, sqliteNow, t.Groups)
	s.readNewSQL = fmt.Sprintf(`SELECT "offset", "uuid", "payload", "metadata", coalesce(CASE WHEN "deliver_at" > ?1 THEN "deliver_at" END, 0)
FROM %s WHERE "offset" > ?2 ORDER BY "offset" LIMIT ?3`, t.Messages)
	s.insClaimsSQL = fmt.Sprintf(`INSERT INTO %[1]s ("group_id", "offset", "token", "visible_at", "attempts")
SELECT ?1, m."offset",
	CASE WHEN m."deliver_at" > ?4 THEN 0 ELSE ?2 END,
	CASE WHEN m."deliver_at" > ?4 THEN m."deliver_at" ELSE %[3]s + ?3 END,
	CASE WHEN m."deliver_at" > ?4 THEN 0 ELSE 1 END
FROM %[2]s m WHERE m."offset" > ?5 AND m."offset" <= ?6`, t.Claims, t.Messages, sqliteNow)
	s.advanceSQL = fmt.Sprintf(`UPDATE %s SET "last_offset" = ?, "updated_at" = %s WHERE "group_id" = ?`, t.Groups, sqliteNow)
	dueSQL := func(cond string) string {
		return fmt.Sprintf(`UPDATE %[1]s SET "token" = ?, "visible_at" = %[2]s + ?, "attempts" = "attempts" + 1
WHERE "group_id" = ? AND "offset" IN (
	SELECT "offset" FROM %[1]s WHERE "group_id" = ? AND "visible_at" <= %[2]s%[3]s ORDER BY "offset" LIMIT ?
)
RETURNING "offset", "attempts"`, t.Claims, sqliteNow, cond)
	}
	// A parked claim (sqliteParked) reads as due to this claim, which does not know order by
	// key: a group whose subscribers stop ordering by key delivers its parked messages.
	s.dueSQL = dueSQL("")
	s.readSQL = fmt.Sprintf(`SELECT "offset", "uuid", "payload", "metadata" FROM %s WHERE "offset" IN (`, t.Messages)
	s.insertPrefix = fmt.Sprintf(`INSERT INTO %s ("uuid", "payload", "metadata") VALUES `, t.Messages)
	s.insDelPrefix = fmt.Sprintf(`INSERT INTO %s ("uuid", "payload", "metadata", "deliver_at") VALUES `, t.Messages)
	s.ensureGrpSQL = fmt.Sprintf(`INSERT INTO %[1]s ("consumer_group", "last_offset", "updated_at")
VALUES (?, CASE WHEN ? THEN coalesce((SELECT max("offset") FROM %[2]s), 0) ELSE 0 END, %[3]s)
ON CONFLICT ("consumer_group") DO NOTHING
RETURNING "group_id"`, t.Groups, t.Messages, sqliteNow)
	s.lookupGrpSQL = fmt.Sprintf(`SELECT "group_id" FROM %s WHERE "consumer_group" = ?`, t.Groups)
	s.prepareOrdered(dueSQL(` AND "visible_at" >= 0`))
	s.pruneSQL = fmt.Sprintf(`DELETE FROM %[2]s WHERE "offset" IN (
	SELECT d."offset" FROM %[2]s d
	WHERE d."offset" <= (SELECT min("last_offset") FROM %[1]s)
	  AND d."created_at" < %[4]s - ?
	  AND NOT EXISTS (SELECT 1 FROM %[3]s c WHERE c."offset" = d."offset")
	ORDER BY d."offset"
	LIMIT ?
)`, t.Groups, t.Messages, t.Claims, sqliteNow)
	// Settlements: ? is the group, then the arguments of the statement's SET, then the
	// (offset, token) pairs. Each claim is found by its primary key (group_id, offset) and
	// applied only if its token still matches.
	fenced := func(set string) string {
		return fmt.Sprintf(`UPDATE %s SET %s WHERE "group_id" = ? AND ("offset", "token") IN (VALUES `, t.Claims, set)
	}
	s.ackPrefix = fmt.Sprintf(`DELETE FROM %s WHERE "group_id" = ? AND ("offset", "token") IN (VALUES `, t.Claims)
	s.nackPrefix = fenced(`"token" = 0, "visible_at" = ` + sqliteNow + ` + ?`)
	s.relPrefix = fenced(`"token" = 0, "visible_at" = ` + sqliteNow + `, "attempts" = max("attempts" - 1, 0)`)
	s.extPrefix = fenced(`"visible_at" = ` + sqliteNow + ` + ?`)
	return sqlite{s}
}

// msInt is d in whole milliseconds, rounded up so that a lease is never shorter than asked.
func msInt(d time.Duration) int64 {
	return int64((d + time.Millisecond - 1) / time.Millisecond)
}

func (s sqlite) ensureGroup(ctx context.Context, q dbx.Querier, group string, startAtNewest bool) (int32, error) {
	var id int64
	err := dbx.QueryRowWrite(ctx, q, s.ensureGrpSQL, []any{group, startAtNewest}, &id)
	if errors.Is(err, dbx.ErrNoRows) {
		err = dbx.QueryRow(ctx, q, s.lookupGrpSQL, []any{group}, &id)
	}
	return int32(id), err
}

// claim runs one claim. A look without the write lock comes first: an idle poll (nothing new,
// nothing due) writes nothing and waits for no writer. Otherwise one write transaction takes
// the due claims again under token (unless due is DueNone), then new messages after the
// group's position, which it advances. DueGivenBack takes lost leases back too, as DueAll
// does: no snapshot keeps the rows of settled claims alive here, so the look costs the same.
func (s sqlite) claim(ctx context.Context, q dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due Due, out []Claimed) ([]Claimed, error) {
	var waiting, dueAny int64
	if err := dbx.QueryRow(ctx, q, s.peekSQL, []any{due != DueNone, groupID}, &waiting, &dueAny); err != nil {
		if errors.Is(err, dbx.ErrNoRows) {
			return out, fmt.Errorf("offsets: consumer group %d has no row", groupID)
		}
		return out, err
	}
	if waiting == 0 && dueAny == 0 {
		return out, nil
	}
	start := len(out)
	err := dbx.InSQLiteTx(ctx, q, func(tx dbx.Querier) error {
		var err error
		out, err = s.claimIn(ctx, tx, groupID, token, ttl, limit, pass, due != DueNone && dueAny != 0, out)
		return err
	})
	if err != nil {
		return out[:start], err // rolled back: none of them was claimed
	}
	return out, nil
}

// claimIn runs the claim's statements in the write transaction tx. New messages are read in
// offset order until limit of them may be handed out; up to pass delayed messages are read
// besides, and passed (see ClaimPassing). Reading stops there: the position advances to the
// last message read.
func (s sqlite) claimIn(ctx context.Context, tx dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due bool, out []Claimed) ([]Claimed, error) {
	lease := msInt(ttl)
	if due {
		n := len(out)
		var err error
		if out, err = s.claimDue(ctx, tx, s.dueSQL, groupID, token, lease, limit, out); err != nil {
			return out, err
		}
		limit -= len(out) - n
	}
	if limit <= 0 {
		return out, nil
	}
	var pos, now int64
	if err := dbx.QueryRow(ctx, tx, s.positionSQL, []any{groupID}, &pos, &now); err != nil {
		return out, err
	}
	rows, err := tx.Query(ctx, s.readNewSQL, now, pos, limit+pass)
	if err != nil {
		return out, err
	}
	first := len(out)
	for taken := 0; taken < limit && rows.Next(); {
		c := Claimed{Attempts: 1}
		var later int64
		if err := rows.Scan(&c.Offset, &c.UUID, &c.Payload, &c.Metadata, &later); err != nil {
			rows.Close()
			return out, err
		}
		if later != 0 {
			c = Claimed{Offset: c.Offset, Delayed: time.UnixMilli(later)}
		} else {
			taken++
		}
		out = append(out, c)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return out, err
	}
	if len(out) == first {
		return out, nil
	}
	last := out[len(out)-1].Offset
	if _, err := tx.Exec(ctx, s.insClaimsSQL, groupID, token, lease, now, pos, last); err != nil {
		return out, err
	}
	if _, err := tx.Exec(ctx, s.advanceSQL, last, groupID); err != nil {
		return out, err
	}
	return out, nil
}

// claimDue takes the claims of the group that are due again under token (sql: dueSQL or
// ordDueSQL), up to limit, and appends them to out in offset order.
func (s sqlite) claimDue(ctx context.Context, tx dbx.Querier, sql string, groupID int32, token, lease int64, limit int, out []Claimed) ([]Claimed, error) {
	rows, err := dbx.QueryWrite(ctx, tx, sql, token, lease, groupID, groupID, limit)
	if err != nil {
		return out, err
	}
	attempts := map[int64]int{}
	var offs []int64
	for rows.Next() {
		var off, att int64
		if err := rows.Scan(&off, &att); err != nil {
			rows.Close()
			return out, err
		}
		attempts[off] = int(att)
		offs = append(offs, off)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return out, err
	}
	return s.readClaimed(ctx, tx, offs, attempts, true, out)
}

// readClaimed appends the messages of offs to out in offset order, with their attempt counts
// (attempts, by offset; 1 where it has none) and again.
func (s sqlite) readClaimed(ctx context.Context, tx dbx.Querier, offs []int64, attempts map[int64]int, again bool, out []Claimed) ([]Claimed, error) {
	if len(offs) == 0 {
		return out, nil
	}
	sort.Slice(offs, func(i, j int) bool { return offs[i] < offs[j] })
	args := make([]any, len(offs))
	for i, o := range offs {
		args[i] = o
	}
	rows, err := tx.Query(ctx, s.readSQL+placeholders(len(offs))+`) ORDER BY "offset"`, args...)
	if err != nil {
		return out, err
	}
	defer rows.Close()
	for rows.Next() {
		var c Claimed
		if err := rows.Scan(&c.Offset, &c.UUID, &c.Payload, &c.Metadata); err != nil {
			return out, err
		}
		c.Attempts, c.Again = 1, again
		if a, ok := attempts[c.Offset]; ok {
			c.Attempts = a
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// unixMilliCeil is t in Unix milliseconds, rounded up.
func unixMilliCeil(t time.Time) int64 {
	ms := t.UnixMilli()
	if time.UnixMilli(ms).Before(t) {
		ms++
	}
	return ms
}

func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?,", n), ",")
}

// sqliteSettleChunk bounds the claims of one settlement statement (two parameters each, under
// SQLite's 32766).
const sqliteSettleChunk = 1000

// settle: with one writer no row changes under a statement, so a settlement returns exactly
// the claims it matched and applied.
func (s sqlite) settle(ctx context.Context, q dbx.Querier, op settleOp, groupID int32, fs []Fenced, d time.Duration) (map[int64]bool, error) {
	switch op {
	case settleNack:
		return s.settlePrefix(ctx, q, s.nackPrefix, groupID, fs, msInt(d))
	case settleRelease:
		return s.settlePrefix(ctx, q, s.relPrefix, groupID, fs)
	case settleExtend:
		return s.settlePrefix(ctx, q, s.extPrefix, groupID, fs, msInt(d))
	}
	return s.settlePrefix(ctx, q, s.ackPrefix, groupID, fs)
}

// ackHandingOver is the plain ack: SQLite's ordered claims take the keys it frees. Its claims
// run in the process, under the file's single writer, so the claim an ack wakes costs no
// round trip to a server.
func (s sqlite) ackHandingOver(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, _ int64, _ time.Duration, out []Claimed) (map[int64]bool, []Claimed, error) {
	done, err := s.settle(ctx, q, settleAck, groupID, fs, 0)
	return done, out[:0], err
}

// settlePrefix runs the settlement prefix (with its SET arguments set) for fs and returns the
// offsets it applied.
func (s sqlite) settlePrefix(ctx context.Context, q dbx.Querier, prefix string, groupID int32, fs []Fenced, set ...any) (map[int64]bool, error) {
	done := make(map[int64]bool, len(fs))
	for len(fs) > 0 {
		n := min(len(fs), sqliteSettleChunk)
		var b strings.Builder
		b.Grow(len(prefix) + n*6 + 32)
		b.WriteString(prefix)
		args := make([]any, 0, len(set)+1+2*n)
		args = append(args, set...)
		args = append(args, groupID)
		for i, f := range fs[:n] {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString("(?,?)")
			args = append(args, f.Offset, f.Token)
		}
		b.WriteString(`) RETURNING "offset"`)
		offs, err := dbx.ScanInt64s(dbx.QueryWrite(ctx, q, b.String(), args...))
		if err != nil {
			return done, err
		}
		for _, o := range offs {
			done[o] = true
		}
		fs = fs[n:]
	}
	return done, nil
}

func (s sqlite) insertSQL(n int, _ string, delayed bool) string {
	if delayed {
		return repeatTuples(s.insDelPrefix, "(?,?,?,?)", n)
	}
	return repeatTuples(s.insertPrefix, "(?,?,?)", n)
}

// deliverAt is the time in Unix milliseconds, rounded up so that a delayed message is never
// handed out before it.
func (sqlite) deliverAt(at time.Time) any { return unixMilliCeil(at) }

// notify: SQLite has no NOTIFY.
func (sqlite) notify(context.Context, dbx.Querier, string, string) error { return nil }

// addPartitions: SQLite's messages table has no partitions.
func (sqlite) addPartitions(context.Context, dbx.Querier, int) error { return nil }

func (sqlite) noPartition(error) bool { return false }

// pruneBatch bounds the messages one of SQLite's retention statements deletes.
const pruneBatch = 10000

// maintain deletes the settled messages older than opts.OlderThan, pruneBatch at a time,
// until a statement deletes fewer. SQLite keeps one table: its single writer holds no
// snapshot that would keep deleted rows' versions alive.
func (s sqlite) maintain(ctx context.Context, _ *partState, c dbx.Querier, opts MaintainOptions) (MaintainResult, error) {
	var res MaintainResult
	if !opts.Drop {
		return res, nil
	}
	for {
		n, err := c.Exec(ctx, s.pruneSQL, msInt(opts.OlderThan), pruneBatch)
		res.Messages += n
		if err != nil || n < pruneBatch {
			return res, err
		}
	}
}

// heldBack: offsets commit in order on SQLite, so nothing is held back.
func (sqlite) heldBack(context.Context, dbx.Querier, int32) (int, error) { return 0, nil }

// errNoAdvisoryLocks refuses the advisory claim mode's statements on SQLite.
var errNoAdvisoryLocks = errors.New("offsets: the advisory claim mode needs advisory locks, which SQLite does not have")

// sqliteParked is the visible_at of a parked claim (see claimOrderedIn): below every time,
// so that it is never taken for a lease or a backoff.
const sqliteParked = -1

// prepareOrdered makes the statements of the ordered claim; due is dueSQL without the parked
// claims. Their text is the same at every claim, as SQLite parses each statement it runs.
func (s *sqliteTopic) prepareOrdered(due string) {
	t := s.t
	s.ordDueSQL = due
	// free: the first parked claim (lowest offset) of every key of group ?1 whose claims are all
	// parked, read from the index by key.
	free := fmt.Sprintf(`SELECT min(h."offset") FROM %[1]s h
	WHERE h."group_id" = ?1 AND h."order_key" IS NOT NULL
	GROUP BY h."order_key" HAVING max(h."visible_at") < 0`, t.Claims)
	s.ordPeekSQL = fmt.Sprintf(`SELECT
	EXISTS (SELECT 1 FROM %[2]s m WHERE m."offset" > g."last_offset"),
	EXISTS (SELECT 1 FROM %[3]s c WHERE c."group_id" = g."group_id" AND c."visible_at" BETWEEN 0 AND %[4]s),
	EXISTS (%[5]s)
FROM %[1]s g WHERE g."group_id" = ?1`, t.Groups, t.Messages, t.Claims, sqliteNow, free)
	s.ordPosSQL = fmt.Sprintf(`SELECT g."last_offset", %[3]s, (SELECT count(*) FROM (
	SELECT 1 FROM %[2]s c WHERE c."group_id" = ?1 AND c."order_key" IS NOT NULL AND c."visible_at" < 0 LIMIT ?2))
FROM %[1]s g WHERE g."group_id" = ?1`, t.Groups, t.Claims, sqliteNow)
	// ?1 group, ?2 the claim's clock, ?3 token, ?4 lease, ?5 how many. A parked message whose
	// time has not come (delayed) becomes a claim due at its time with no holder, as a new
	// delayed message does. The message's row is read by the FROM: RETURNING may not.
	s.unparkSQL = fmt.Sprintf(`UPDATE %[1]s AS c SET
	"token" = CASE WHEN m."deliver_at" > ?2 THEN 0 ELSE ?3 END,
	"visible_at" = CASE WHEN m."deliver_at" > ?2 THEN m."deliver_at" ELSE %[3]s + ?4 END,
	"attempts" = CASE WHEN m."deliver_at" > ?2 THEN 0 ELSE 1 END
FROM %[2]s AS m
WHERE c."group_id" = ?1 AND c."offset" IN (%[4]s ORDER BY 1 LIMIT ?5) AND m."offset" = c."offset"
RETURNING "offset", "token", "visible_at"`, t.Claims, t.Messages, sqliteNow, free)
	// A message's order key is its metadata's MetaOrderKey as text (NULL: none, or metadata
	// that is not JSON); ?k is the JSON path of MetaOrderKey.
	key := func(k string) string {
		return `CASE WHEN json_valid(m."metadata") THEN CAST(json_extract(m."metadata", ` + k + `) AS TEXT) END`
	}
	// ?1 the claim's clock, ?2 the group's position, ?3 how many, ?4 group, ?5 the key's path;
	// the last column says whether the group has claims of the message's key.
	s.ordReadSQL = fmt.Sprintf(`SELECT x."offset", x."uuid", x."payload", x."metadata", x.later, x.k IS NOT NULL, coalesce(x.k, ''),
	x.k IS NOT NULL AND EXISTS (SELECT 1 FROM %[2]s c WHERE c."group_id" = ?4 AND c."order_key" = x.k)
FROM (
	SELECT m."offset", m."uuid", m."payload", m."metadata",
		coalesce(CASE WHEN m."deliver_at" > ?1 THEN m."deliver_at" END, 0) AS later, %[3]s AS k
	FROM %[1]s m WHERE m."offset" > ?2 ORDER BY m."offset" LIMIT ?3
) x
ORDER BY x."offset"`, t.Messages, t.Claims, key("?5"))
	// The claim rows of the messages read, offsets ?5 to ?6, with their keys: those in ?8 (a
	// JSON array of offsets) parked, the delayed ones (as read with the clock ?4) due at their
	// time with no holder, the others claimed under token ?2 with the lease ?3.
	s.ordClaimSQL = fmt.Sprintf(`INSERT INTO %[1]s ("group_id", "offset", "token", "visible_at", "attempts", "order_key")
SELECT ?1, x."offset",
	CASE WHEN x.parked OR x."deliver_at" > ?4 THEN 0 ELSE ?2 END,
	CASE WHEN x.parked THEN %[3]d WHEN x."deliver_at" > ?4 THEN x."deliver_at" ELSE %[4]s + ?3 END,
	CASE WHEN x.parked OR x."deliver_at" > ?4 THEN 0 ELSE 1 END,
	x.k
FROM (
	SELECT m."offset", m."deliver_at", %[5]s AS k, m."offset" IN (SELECT value FROM json_each(?8)) AS parked
	FROM %[2]s m WHERE m."offset" > ?5 AND m."offset" <= ?6
) x`, t.Claims, t.Messages, sqliteParked, sqliteNow, key("?7"))
}

// claimOrdered is claim for a group ordered by key. A look without the write lock comes
// first, as in claim; then one write transaction (claimOrderedIn), which skips the steps the
// look found nothing for. SQLite's one writer runs the write transactions of every claim of
// the group, in every process, one after another: each sees every claim made before it, which
// PostgreSQL gets by locking the group's row.
func (s sqlite) claimOrdered(ctx context.Context, b dbx.Beginner, groupID int32, token int64, ttl time.Duration, limit, pass int, floor *int64, out []Claimed) ([]Claimed, time.Time, error) {
	*floor = NoParkFloor // one writer, no snapshot held: nothing to read past
	waiting, due, free := int64(1), int64(1), int64(1)
	var locked time.Time // zero while no claim was made
	if q, ok := b.(dbx.Querier); ok {
		if err := dbx.QueryRow(ctx, q, s.ordPeekSQL, []any{groupID}, &waiting, &due, &free); err != nil {
			if errors.Is(err, dbx.ErrNoRows) {
				return out, locked, fmt.Errorf("offsets: consumer group %d has no row", groupID)
			}
			return out, locked, err
		}
		if waiting == 0 && due == 0 && free == 0 {
			return out, locked, nil
		}
	}
	start := len(out)
	// The library's pool begins every transaction with BEGIN IMMEDIATE, so inside it the write
	// lock is held; the leases are written by statements sent after this time in any case.
	err := dbx.InTx(ctx, b, func(tx dbx.Tx) error {
		locked = time.Now()
		var err error
		out, err = s.claimOrderedIn(ctx, tx, groupID, token, ttl, limit, pass, due != 0, free != 0, out[:start])
		return err
	})
	if err != nil {
		return out[:start], locked, err // rolled back: none of them was claimed
	}
	return out, locked, nil
}

// claimOrderedIn runs the ordered claim in the write transaction tx, keeping one rule: at
// most one message of a key is unsettled and not parked (held, due again, or delayed); every
// other unsettled message of the key is parked, a claim row with its key in order_key, no
// holder and visible_at sqliteParked, which the group's position passes as it passes a
// delayed message. Settlements only delete or update claim rows; only claims decide which
// message of a key goes next. In this order:
//   - with due, the claims due again (not parked), each the one message of its key not parked;
//   - with free, for every key whose claims are all parked, the first of them (by offset), up
//     to the room the due ones left: claimed under token, or, if its time has not come, made
//     a delayed claim;
//   - new messages after the group's position, as in claimIn, up to the room left (plus pass):
//     a message with a key is parked when the group has a claim of its key or the key came
//     earlier in this claim. While MaxParked messages are parked, no new message is read, so
//     that the parked ones, which every claim reads, stay few.
//
// Order keys are compared as text: two keys never share an order.
func (s sqlite) claimOrderedIn(ctx context.Context, tx dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due, free bool, out []Claimed) ([]Claimed, error) {
	lease := msInt(ttl)
	var pos, now, parked int64
	if err := dbx.QueryRow(ctx, tx, s.ordPosSQL, []any{groupID, MaxParked}, &pos, &now, &parked); err != nil {
		return out, err
	}
	room := limit
	if due {
		n := len(out)
		var err error
		if out, err = s.claimDue(ctx, tx, s.ordDueSQL, groupID, token, lease, limit, out); err != nil {
			return out, err
		}
		room -= len(out) - n
	}
	if free && parked > 0 && room > 0 {
		rows, err := dbx.QueryWrite(ctx, tx, s.unparkSQL, groupID, now, token, lease, room)
		if err != nil {
			return out, err
		}
		var heads []int64
		var delayed []Claimed
		for rows.Next() {
			var off, tok, at int64
			if err := rows.Scan(&off, &tok, &at); err != nil {
				rows.Close()
				return out, err
			}
			if tok == 0 {
				delayed = append(delayed, Claimed{Offset: off, Delayed: time.UnixMilli(at)})
			} else {
				heads = append(heads, off)
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return out, err
		}
		if out, err = s.readClaimed(ctx, tx, heads, nil, false, out); err != nil {
			return out, err
		}
		out = append(out, delayed...)
		room -= len(heads)
	}
	if room <= 0 || parked >= MaxParked {
		return out, nil
	}
	return s.claimNewOrdered(ctx, tx, groupID, token, lease, now, pos, room, pass, out)
}

// claimNewOrdered is the last step of claimOrderedIn: new messages.
func (s sqlite) claimNewOrdered(ctx context.Context, tx dbx.Querier, groupID int32, token, lease, now, pos int64, room, pass int, out []Claimed) ([]Claimed, error) {
	path := jsonPath(MetaOrderKey)
	// The rows are read one by one and no more than the room needs: passing up to parkPass
	// costs only the messages parked.
	rows, err := tx.Query(ctx, s.ordReadSQL, now, pos, room+max(pass, parkPass), groupID, path)
	if err != nil {
		return out, err
	}
	var last int64
	parked := []byte{'['} // a JSON array of the offsets parked
	seen := map[string]bool{}
	for taken := 0; taken < room && rows.Next(); {
		c := Claimed{Attempts: 1}
		var later, keyed, has int64
		var key string
		if err := rows.Scan(&c.Offset, &c.UUID, &c.Payload, &c.Metadata, &later, &keyed, &key, &has); err != nil {
			rows.Close()
			return out, err
		}
		last = c.Offset
		switch {
		case keyed != 0 && (has != 0 || seen[key]):
			if len(parked) > 1 {
				parked = append(parked, ',')
			}
			parked = strconv.AppendInt(parked, c.Offset, 10)
		case later != 0:
			out = append(out, Claimed{Offset: c.Offset, Delayed: time.UnixMilli(later)})
		default:
			out = append(out, c)
			taken++
		}
		if keyed != 0 {
			seen[key] = true
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return out, err
	}
	if last == 0 {
		return out, nil
	}
	parked = append(parked, ']')
	if _, err := tx.Exec(ctx, s.ordClaimSQL, groupID, token, lease, now, pos, last, path, string(parked)); err != nil {
		return out, err
	}
	if _, err := tx.Exec(ctx, s.advanceSQL, last, groupID); err != nil {
		return out, err
	}
	return out, nil
}

func (sqlite) claimLocked(context.Context, dbx.Querier, int32, int64, int, int, int32, []int64, []int64, Due, []Claimed) ([]Claimed, []int64, error) {
	return nil, nil, errNoAdvisoryLocks
}

// backendAlive: SQLite runs in the process, with no server process to look up.
func (sqlite) backendAlive(context.Context, dbx.Querier, uint32) (bool, error) {
	return false, errors.New("offsets: SQLite has no server processes")
}

// deadLetterSQLite is deadLetterSQL on SQLite, where a DELETE cannot feed an INSERT in one
// statement: the fenced claims are deleted (returning their attempts), then the copies are
// inserted from VALUES rows (offset, attempts) of the claims deleted, in the one write
// transaction, so both or neither. %[1]s: the messages table, %[2]s: the dead-letter topic's;
// ?1 and ?2 are the JSON paths of the metadata keys dropped, ?3 the topic and ?4 the group.
const deadLetterSQLite = `INSERT INTO %[2]s ("uuid", "payload", "metadata")
SELECT m."uuid", m."payload", json_set(json_remove(m."metadata", ?1, ?2),
	'$.` + MetaDeadLetterTopic + `', ?3, '$.` + MetaDeadLetterGroup + `', ?4,
	'$.` + MetaDeadLetterAttempts + `', CAST(d."column2" AS TEXT), '$.` + MetaDeadLetterOffset + `', CAST(m."offset" AS TEXT))
FROM (VALUES %[3]s) d JOIN %[1]s m ON m."offset" = d."column1"
ORDER BY m."offset"`

// deadLetter moves the fenced claims fs to the messages table to, in one write transaction,
// and returns the offsets it moved (see Store.DeadLetter): the fenced claims are deleted
// (returning their attempts), then the copies inserted (deadLetterSQLite).
func (s sqlite) deadLetter(ctx context.Context, q dbx.Querier, groupID int32, group string, fs []Fenced, to Tables, dropKeys [2]string) (map[int64]bool, error) {
	done := map[int64]bool{}
	err := dbx.InSQLiteTx(ctx, q, func(tx dbx.Querier) error {
		for len(fs) > 0 {
			n := min(len(fs), sqliteSettleChunk)
			var b strings.Builder
			b.WriteString(s.ackPrefix)
			args := make([]any, 0, 1+2*n)
			args = append(args, groupID)
			for i, f := range fs[:n] {
				if i > 0 {
					b.WriteByte(',')
				}
				b.WriteString("(?,?)")
				args = append(args, f.Offset, f.Token)
			}
			b.WriteString(`) RETURNING "offset", "attempts"`)
			rows, err := dbx.QueryWrite(ctx, tx, b.String(), args...)
			if err != nil {
				return err
			}
			var moved []any // offset, attempts pairs
			for rows.Next() {
				var off, att int64
				if err := rows.Scan(&off, &att); err != nil {
					rows.Close()
					return err
				}
				moved = append(moved, off, att)
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return err
			}
			if len(moved) > 0 {
				// The four leading parameters are numbered (?1 to ?4): the VALUES rows follow
				// them as ?5 onwards.
				var vb strings.Builder
				for i := range len(moved) / 2 {
					if i > 0 {
						vb.WriteByte(',')
					}
					fmt.Fprintf(&vb, "(?%d,?%d)", 5+2*i, 6+2*i)
				}
				sql := fmt.Sprintf(deadLetterSQLite, s.t.Messages, to.Messages, vb.String())
				iargs := append([]any{jsonPath(dropKeys[0]), jsonPath(dropKeys[1]), s.t.Topic, group}, moved...)
				if _, err := tx.Exec(ctx, sql, iargs...); err != nil {
					return err
				}
				for i := 0; i < len(moved); i += 2 {
					done[moved[i].(int64)] = true
				}
			}
			fs = fs[n:]
		}
		return nil
	})
	if err != nil {
		return map[int64]bool{}, err // rolled back: nothing was moved
	}
	return done, nil
}

// jsonPath is SQLite's JSON path of the object key k, quoted so that a key with dots is one
// member (k holds no double quote: it is one of the library's metadata keys).
func jsonPath(k string) string { return `$."` + k + `"` }

// messagesSQL: the write transaction of TakeMessages holds the database.
func (sqlite) messagesSQL(t Tables, take bool) string {
	sql := fmt.Sprintf(`SELECT "offset", "uuid", "payload", "metadata", "created_at", coalesce("deliver_at", 0) FROM %s`, t.Messages)
	if take {
		return sql + ` WHERE "offset" > $1 ORDER BY "offset" LIMIT $2`
	}
	return sql + ` WHERE "offset" >= $1 ORDER BY "offset" LIMIT $2`
}

// deleteMessages deletes in statements of up to sqliteSettleChunk offsets.
func (sqlite) deleteMessages(ctx context.Context, t Tables, tx dbx.Querier, offs []int64) (int64, error) {
	return inChunks(offs, sqliteSettleChunk, func(in string, args []any) (int64, error) {
		if _, err := tx.Exec(ctx, fmt.Sprintf(`DELETE FROM %s WHERE "offset" IN (%s)`, t.Claims, in), args...); err != nil {
			return 0, err
		}
		return tx.Exec(ctx, fmt.Sprintf(`DELETE FROM %s WHERE "offset" IN (%s)`, t.Messages, in), args...)
	})
}

func (sqlite) keySchemaSQL(k KeyTable) string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %[1]s (
	"key"        BLOB    NOT NULL PRIMARY KEY,
	"expires_at" INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS %[2]s ON %[3]s ("expires_at");
`, k.Table, ident.Qualified(k.schema, k.Name+"_exp"), ident.Quote(k.Name))
}

// keyCreateIn: the write transaction (BEGIN IMMEDIATE) serialises creators.
func (db sqlite) keyCreateIn(ctx context.Context, k KeyTable, tx dbx.Querier) error {
	_, err := tx.Exec(ctx, db.keySchemaSQL(k))
	return err
}

func (sqlite) keyExists(ctx context.Context, k KeyTable, q dbx.Querier) (bool, error) {
	var n int64
	err := dbx.QueryRow(ctx, q, `SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?`, []any{k.Name}, &n)
	return n > 0, err
}

func (sqlite) keyClaim(ctx context.Context, k KeyTable, q dbx.Querier, key []byte, window time.Duration) (bool, error) {
	return wroteRow(dbx.QueryWrite(ctx, q, fmt.Sprintf(`INSERT INTO %[1]s ("key", "expires_at") VALUES (?1, %[2]s + ?2)
ON CONFLICT ("key") DO UPDATE SET "expires_at" = excluded."expires_at" WHERE %[1]s."expires_at" <= %[2]s
RETURNING 1`, k.Table, sqliteNow), key, window.Milliseconds()))
}

func (sqlite) keyPrune(ctx context.Context, k KeyTable, q dbx.Querier, limit int) (int64, error) {
	return q.Exec(ctx, fmt.Sprintf(`DELETE FROM %[1]s WHERE "key" IN (
	SELECT "key" FROM %[1]s WHERE "expires_at" <= %[2]s ORDER BY "expires_at" LIMIT ?1)`, k.Table, sqliteNow), limit)
}

// DataVersion reads SQLite's PRAGMA data_version on q, a connection of its own: the number
// changes when another connection to the file has committed.
func DataVersion(ctx context.Context, q dbx.Querier) (int64, error) {
	var v int64
	err := dbx.QueryRow(ctx, q, "PRAGMA data_version", nil, &v)
	return v, err
}
