package offsets

// MySQL's and MariaDB's statements: those of the lease mode (neither has advisory locks that
// a transaction can free at its end, nor NOTIFY).
//
// Offsets commit in order. A message's offset is its row's AUTO_INCREMENT value, and every
// statement that writes messages first locks the topic's head row (the groups table's row of
// the empty group name) for the rest of its transaction: the writers of one topic take turns,
// each committing before the next one is given its offsets. So a group's position is just the
// last offset it handed out, as on SQLite, and a message committed late never sits behind it.
// The price is that a transaction that publishes holds back the topic's other publishers until
// it ends: a caller's transaction that publishes should be short.
//
// Claims are one row per claim statement, as on PostgreSQL: a row holds the offsets one claim
// took, packed 8 bytes each in offset order ("offsets"), with the token, attempt count and
// lease deadline they share; its key is (group_id, token, attempts). A settlement locks the
// rows of its tokens, takes its offsets out in the client, and writes each row back once (or
// deletes it when it is left empty); a nack or a release moves its offsets into a row of their
// own with no holder (a negative token) and the time they come due again. So the row versions
// that a long transaction elsewhere keeps from being purged grow with the number of claim and
// settlement statements, not with the number of messages.
//
// Times are integer Unix milliseconds read from the server's clock in UTC (mysqlNow), so
// that consumers on several machines compare one clock's values, whatever the session's time
// zone. Every transaction runs at READ COMMITTED (see dbx.MySQLPool).

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
)

// MySQLSchemaVersion is the version of MySQL's tables, written into the messages table's
// comment and checked on start.
const MySQLSchemaVersion = 1

// mysqlNow is the time of the statement on the server's clock, in Unix milliseconds: UTC, so
// that no time zone's change of hour moves it.
const mysqlNow = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000)"

// mysqlHeadGroup is the consumer_group of the head row, which publishers lock: no group is
// named "" (a name is 1 to 255 characters).
const mysqlHeadGroup = ""

// mysql is the database of MySQL and MariaDB; its mysqlTopic is set by prepare.
type mysql struct{ *mysqlTopic }

func (mysql) dialect() dbx.Dialect { return dbx.MySQL }

// tableName: whether MySQL compares table names with regard to case depends on the server
// (lower_case_table_names), so the names are those of SQLite, which never does: a topic with
// an upper-case letter gets a hash of its own (see ident.SQLiteTableName).
func (mysql) tableName(prefix, topic, suffix string) string {
	return ident.SQLiteTableName(prefix, topic, suffix)
}

// quote quotes with backquotes, in which every character of a valid name stands for itself
// (a backquote, which would be doubled, is refused in names).
func (mysql) quote(schema, name string) string {
	q := func(s string) string { return "`" + strings.ReplaceAll(s, "`", "``") + "`" }
	if schema == "" {
		return q(name)
	}
	return q(schema) + "." + q(name)
}

func (mysql) schemaSQL(t Tables) string {
	return strings.Join(mysqlSchemaStatements(t), ";\n") + ";\n"
}

// mysqlSchemaStatements is the DDL of the topic's tables, a statement at a time (the driver
// runs one per call). The head row is written with the groups table.
func mysqlSchemaStatements(t Tables) []string {
	return []string{
		fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s (\n"+
			"\t`offset`     BIGINT   NOT NULL AUTO_INCREMENT,\n"+
			"\t`uuid`       TEXT     NOT NULL,\n"+
			"\t`payload`    LONGBLOB NOT NULL,\n"+
			"\t`metadata`   LONGTEXT NOT NULL,\n"+
			"\t`created_at` BIGINT   NOT NULL,\n"+
			"\t`deliver_at` BIGINT,\n"+
			"\tPRIMARY KEY (`offset`)\n"+
			") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin COMMENT=%s",
			t.Messages, quoteLiteral(schemaCommentPrefix+strconv.Itoa(MySQLSchemaVersion))),
		fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s (\n"+
			"\t`group_id`       INT          NOT NULL AUTO_INCREMENT,\n"+
			"\t`consumer_group` VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,\n"+
			"\t`last_offset`    BIGINT       NOT NULL,\n"+
			"\t`updated_at`     BIGINT       NOT NULL,\n"+
			"\tPRIMARY KEY (`group_id`),\n"+
			"\tUNIQUE KEY `consumer_group` (`consumer_group`)\n"+
			") ENGINE=InnoDB COMMENT=%s",
			t.Groups, quoteLiteral(topicCommentPrefix+t.Topic)),
		fmt.Sprintf("INSERT IGNORE INTO %s (`consumer_group`, `last_offset`, `updated_at`) VALUES ('', 0, 0)", t.Groups),
		fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s (\n"+
			"\t`group_id`     INT        NOT NULL,\n"+
			"\t`token`        BIGINT     NOT NULL,\n"+
			"\t`attempts`     INT        NOT NULL,\n"+
			"\t`visible_at`   BIGINT     NOT NULL,\n"+
			"\t`first_offset` BIGINT     NOT NULL,\n"+
			"\t`offsets`      MEDIUMBLOB NOT NULL,\n"+
			"\tPRIMARY KEY (`group_id`, `token`, `attempts`)\n"+
			") ENGINE=InnoDB", t.Claims),
	}
}

// mysqlSchemaLock names the user lock (GET_LOCK) under which the tables of t are created:
// DDL commits by itself on MySQL, so no transaction can serialise creators.
func mysqlSchemaLock(name string) string {
	h := fnv.New64a()
	h.Write([]byte(name))
	return fmt.Sprintf("sqlbroker_schema_%016x", h.Sum64())
}

// createIn runs the DDL a statement at a time under a user lock of the connection, which
// serialises concurrent creators; each statement commits by itself (MySQL's DDL does).
func (db mysql) createIn(ctx context.Context, t Tables, tx dbx.Querier) error {
	return mysqlUnderLock(ctx, tx, mysqlSchemaLock(t.Messages), func() error {
		if err := db.check(ctx, t, tx, true); err != nil {
			return err
		}
		for _, stmt := range mysqlSchemaStatements(t) {
			if _, err := tx.Exec(ctx, stmt); err != nil {
				return err
			}
		}
		return nil
	})
}

// mysqlUnderLock runs fn holding the user lock name on q's connection (waiting up to a
// minute for it), and frees it after.
func mysqlUnderLock(ctx context.Context, q dbx.Querier, name string, fn func() error) error {
	var got *int64
	if err := dbx.QueryRow(ctx, q, "SELECT GET_LOCK(?, 60)", []any{name}, &got); err != nil {
		return err
	}
	if got == nil || *got != 1 {
		return fmt.Errorf("offsets: the lock %s of schema creation was not had within a minute", name)
	}
	defer func() {
		rctx, cancel := dbx.CleanupContext(ctx)
		defer cancel()
		_, _ = q.Exec(rctx, "DO RELEASE_LOCK(?)", name)
	}()
	return fn()
}

// check reads the tables' comments from information_schema, in the connection's database.
func (mysql) check(ctx context.Context, t Tables, q dbx.Querier, missingOK bool) error {
	rows, err := q.Query(ctx, `SELECT TABLE_NAME, TABLE_COMMENT FROM information_schema.TABLES
WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME IN (?, ?, ?)`, t.MessagesName, t.GroupsName, t.ClaimsName)
	if err != nil {
		return err
	}
	defer rows.Close()
	comments := map[string]string{}
	for rows.Next() {
		var name, comment string
		if err := rows.Scan(&name, &comment); err != nil {
			return err
		}
		comments[strings.ToLower(name)] = comment
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if !missingOK {
		for _, x := range []struct{ raw, quoted string }{{t.MessagesName, t.Messages}, {t.GroupsName, t.Groups}, {t.ClaimsName, t.Claims}} {
			if _, ok := comments[strings.ToLower(x.raw)]; !ok {
				return &MissingTableError{Topic: t.Topic, Table: x.quoted, Database: dbx.MySQL.Name}
			}
		}
	}
	if c, ok := comments[strings.ToLower(t.MessagesName)]; ok && c != schemaCommentPrefix+strconv.Itoa(MySQLSchemaVersion) {
		return &VersionError{Topic: t.Topic, Table: t.Messages, Found: c, Want: MySQLSchemaVersion}
	}
	return nil
}

// mysqlTopic holds the SQL text of a topic's statements on MySQL.
type mysqlTopic struct {
	t Tables

	peekSQL       string // is anything new or due, without a transaction
	positionSQL   string // the group's row, locked, and the time
	dueSQL        [2]string
	readNewSQL    string
	readSQL       string // messages by offset: the prefix, then "?,?,...)"
	advanceSQL    string
	insertPrefix  string
	insDelPrefix  string
	ensureGrpSQL  string
	lookupGrpSQL  string
	lockRowsSQL   string // claim rows by token, locked: the prefix, then "?,?,...)"
	ackRowSQL     string // deletes the row of a token that holds exactly the offsets given
	pruneBoundSQL string
	pruneYoungSQL string
	pruneSQL      string
}

// prepare: asyncCommit does not apply (innodb_flush_log_at_trx_commit is the server's).
func (mysql) prepare(t Tables, _ bool) database {
	s := &mysqlTopic{t: t}
	// The look at what is due reads, for DueGivenBack (most claims), the rows no one holds
	// only: the range of negative tokens, whose entries come and go with nacks, releases and
	// delayed messages. The held rows' range keeps a deleted row per claim statement settled
	// while a long transaction holds purge back; only the periodic looks at lost leases read
	// it (the third parameter: 0 none, 1 given back, 2 all).
	s.peekSQL = fmt.Sprintf("SELECT\n"+
		"\tEXISTS (SELECT 1 FROM %[2]s m WHERE m.`offset` > g.`last_offset`),\n"+
		"\tCASE ?\n"+
		"\t\tWHEN 1 THEN EXISTS (SELECT 1 FROM %[3]s c WHERE c.`group_id` = g.`group_id` AND c.`token` < 0 AND c.`visible_at` <= %[4]s)\n"+
		"\t\tWHEN 2 THEN EXISTS (SELECT 1 FROM %[3]s c WHERE c.`group_id` = g.`group_id` AND c.`visible_at` <= %[4]s)\n"+
		"\t\tELSE 0 END\n"+
		"FROM %[1]s g WHERE g.`group_id` = ?", t.Groups, t.Messages, t.Claims, mysqlNow)
	s.positionSQL = fmt.Sprintf("SELECT `last_offset`, %s FROM %s WHERE `group_id` = ? FOR UPDATE", mysqlNow, t.Groups)
	// The claims due again: [0] the rows no one holds (nacked, released, delayed), [1] every
	// row whose time came, lost leases too. A row another claim or a settlement has locked is
	// left for the next claim.
	due := "SELECT `token`, `attempts`, `offsets` FROM %s WHERE `group_id` = ? AND `visible_at` <= ?%s ORDER BY `token`, `attempts` LIMIT ? FOR UPDATE SKIP LOCKED"
	s.dueSQL[0] = fmt.Sprintf(due, t.Claims, " AND `token` < 0")
	s.dueSQL[1] = fmt.Sprintf(due, t.Claims, "")
	s.readNewSQL = fmt.Sprintf("SELECT `offset`, `uuid`, `payload`, `metadata`, CASE WHEN `deliver_at` > ? THEN `deliver_at` ELSE 0 END\n"+
		"FROM %s WHERE `offset` > ? ORDER BY `offset` LIMIT ?", t.Messages)
	s.readSQL = fmt.Sprintf("SELECT `offset`, `uuid`, `payload`, `metadata` FROM %s WHERE `offset` IN (", t.Messages)
	s.advanceSQL = fmt.Sprintf("UPDATE %s SET `last_offset` = ?, `updated_at` = ? WHERE `group_id` = ?", t.Groups)
	s.insertPrefix = fmt.Sprintf("INSERT INTO %s (`uuid`, `payload`, `metadata`, `created_at`) VALUES ", t.Messages)
	s.insDelPrefix = fmt.Sprintf("INSERT INTO %s (`uuid`, `payload`, `metadata`, `created_at`, `deliver_at`) VALUES ", t.Messages)
	// A new group starting at the newest reads the head of the messages table: the statement
	// locks the head row first (publishers take turns on it), so no message commits below it.
	s.ensureGrpSQL = fmt.Sprintf("INSERT IGNORE INTO %[1]s (`consumer_group`, `last_offset`, `updated_at`)\n"+
		"SELECT ?, CASE WHEN ? THEN coalesce((SELECT max(`offset`) FROM %[2]s), 0) ELSE 0 END, %[3]s", t.Groups, t.Messages, mysqlNow)
	s.lookupGrpSQL = fmt.Sprintf("SELECT `group_id` FROM %s WHERE `consumer_group` = ?", t.Groups)
	s.ackRowSQL = fmt.Sprintf("DELETE FROM %s WHERE `group_id` = ? AND `token` = ? AND `offsets` = ?", t.Claims)
	s.lockRowsSQL = fmt.Sprintf("SELECT `token`, `attempts`, `offsets`, %s FROM %s WHERE `group_id` = ? AND `token` IN (", mysqlNow, t.Claims)
	// Retention (maintain): the highest offset it may delete, one every group has passed
	// (the head row aside) and below every claims row; the first message after the last pass
	// too young to go; the deletion of the range between.
	s.pruneBoundSQL = fmt.Sprintf("SELECT LEAST((SELECT min(`last_offset`) FROM %[1]s WHERE `consumer_group` <> ''),\n"+
		"\tcoalesce((SELECT min(`first_offset`) FROM %[2]s), 9223372036854775807) - 1), %[3]s", t.Groups, t.Claims, mysqlNow)
	s.pruneYoungSQL = fmt.Sprintf("SELECT `offset` FROM %s WHERE `offset` > ? AND `offset` <= ? AND `created_at` >= ? ORDER BY `offset` LIMIT 1", t.Messages)
	s.pruneSQL = fmt.Sprintf("DELETE FROM %s WHERE `offset` > ? AND `offset` <= ?", t.Messages)
	return mysql{s}
}

// inTx runs fn in a transaction: q's own when it is one (a caller's, or one the library
// began), or a transaction begun on q and committed after fn, run again, up to 5 times in
// all, when the server ended it as a deadlock's victim or for a lock wait that timed out.
func mysqlInTx(ctx context.Context, q dbx.Querier, fn func(tx dbx.Querier) error) error {
	if dbx.InTransaction(q) {
		return fn(q)
	}
	b := q.(dbx.Beginner)
	var err error
	for range 5 {
		err = dbx.InTx(ctx, b, func(tx dbx.Tx) error { return fn(tx) })
		if err == nil || !dbx.Retryable(err) || ctx.Err() != nil {
			return err
		}
	}
	return err
}

func (s mysql) ensureGroup(ctx context.Context, q dbx.Querier, group string, startAtNewest bool) (int32, error) {
	var id int64
	err := mysqlInTx(ctx, q, func(tx dbx.Querier) error {
		if startAtNewest {
			if err := lockHead(ctx, tx, s.t); err != nil {
				return err
			}
		}
		if _, err := tx.Exec(ctx, s.ensureGrpSQL, group, startAtNewest); err != nil {
			return err
		}
		return dbx.QueryRow(ctx, tx, s.lookupGrpSQL, []any{group}, &id)
	})
	return int32(id), err
}

// claimRow is a claims row as a claim or a settlement reads it.
type claimRow struct {
	token    int64
	attempts int
	offsets  []int64
}

func packOffsets(offs []int64) []byte {
	b := make([]byte, 8*len(offs))
	for i, o := range offs {
		binary.BigEndian.PutUint64(b[8*i:], uint64(o))
	}
	return b
}

func unpackOffsets(b []byte) []int64 {
	offs := make([]int64, len(b)/8)
	for i := range offs {
		offs[i] = int64(binary.BigEndian.Uint64(b[8*i:]))
	}
	return offs
}

// unheldToken is the token of a row no one holds: negative, so that it never matches a
// holder's, and random, so that rows made by concurrent statements get keys of their own.
func unheldToken() int64 { return -1 - rand.Int64N(1<<62) }

// claim runs one claim. A look outside any transaction comes first: an idle poll (nothing
// new, nothing due) locks nothing. Otherwise one transaction locks the group's row (the
// group's claims take turns), takes the due claims again under token (unless due is
// DueNone), then new messages after the group's position, which it advances.
func (s mysql) claim(ctx context.Context, q dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due Due, out []Claimed) ([]Claimed, error) {
	var waiting, dueAny int64
	look := 0
	switch due {
	case DueGivenBack:
		look = 1
	case DueRecent, DueAll:
		look = 2
	}
	if err := dbx.QueryRow(ctx, q, s.peekSQL, []any{look, groupID}, &waiting, &dueAny); err != nil {
		if errors.Is(err, dbx.ErrNoRows) {
			return out, fmt.Errorf("offsets: consumer group %d has no row", groupID)
		}
		return out, err
	}
	if waiting == 0 && dueAny == 0 {
		return out, nil
	}
	start := len(out)
	err := mysqlInTx(ctx, q, func(tx dbx.Querier) error {
		var err error
		out, err = s.claimIn(ctx, tx, groupID, token, ttl, limit, pass, due, dueAny != 0, out[:start])
		return err
	})
	if err != nil {
		return out[:start], err // rolled back: none of them was claimed
	}
	return out, nil
}

// claimIn runs the claim's statements in the transaction tx.
func (s mysql) claimIn(ctx context.Context, tx dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due Due, dueAny bool, out []Claimed) ([]Claimed, error) {
	var pos, now int64
	if err := dbx.QueryRow(ctx, tx, s.positionSQL, []any{groupID}, &pos, &now); err != nil {
		if errors.Is(err, dbx.ErrNoRows) {
			return out, fmt.Errorf("offsets: consumer group %d has no row", groupID)
		}
		return out, err
	}
	deadline := now + msInt(ttl)
	held := map[int][]int64{} // the offsets claimed, by attempt count
	var ins []claimInsert     // the rows to write: the held ones, and one per delayed message passed
	var taken []claimRow      // due rows taken from, with what is left of them
	if due != DueNone && dueAny {
		var err error
		if out, taken, err = s.takeDue(ctx, tx, groupID, now, due, limit, held, out); err != nil {
			return out, err
		}
	}
	room := limit
	for _, offs := range held {
		room -= len(offs)
	}
	last := pos
	if room > 0 {
		rows, err := tx.Query(ctx, s.readNewSQL, now, pos, room+pass)
		if err != nil {
			return out, err
		}
		for n := 0; n < room && rows.Next(); {
			c := Claimed{Attempts: 1}
			var later int64
			if err := rows.Scan(&c.Offset, &c.UUID, &c.Payload, &c.Metadata, &later); err != nil {
				rows.Close()
				return out, err
			}
			last = c.Offset
			if later != 0 {
				// Its row comes due at its time, with no holder, at attempt 0.
				out = append(out, Claimed{Offset: c.Offset, Delayed: time.UnixMilli(later)})
				ins = append(ins, claimInsert{token: unheldToken(), visibleAt: later, offsets: []int64{c.Offset}})
				continue
			}
			n++
			held[1] = append(held[1], c.Offset)
			out = append(out, c)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return out, err
		}
	}
	for _, r := range taken {
		if err := s.rewrite(ctx, tx, groupID, r, nil); err != nil {
			return out, err
		}
	}
	for att, offs := range held {
		slices.Sort(offs)
		ins = append(ins, claimInsert{token: token, attempts: att, visibleAt: deadline, offsets: offs})
	}
	if err := s.insertClaims(ctx, tx, groupID, ins); err != nil {
		return out, err
	}
	if last != pos {
		if _, err := tx.Exec(ctx, s.advanceSQL, last, now, groupID); err != nil {
			return out, err
		}
	}
	return out, nil
}

// takeDue takes up to limit offsets of the group's rows due again (due says which), adding
// them to held under their next attempt count and their messages to out, in offset order. It
// returns the rows it took from, each with what is left of it (nothing: the row goes).
func (s mysql) takeDue(ctx context.Context, tx dbx.Querier, groupID int32, now int64, due Due, limit int, held map[int][]int64, out []Claimed) ([]Claimed, []claimRow, error) {
	sql := s.dueSQL[0]
	if due != DueGivenBack {
		sql = s.dueSQL[1]
	}
	rows, err := tx.Query(ctx, sql, groupID, now, limit)
	if err != nil {
		return out, nil, err
	}
	var taken []claimRow
	attempts := map[int64]int{}
	var offs []int64
	for rows.Next() {
		var r claimRow
		var packed []byte
		if err := rows.Scan(&r.token, &r.attempts, &packed); err != nil {
			rows.Close()
			return out, nil, err
		}
		all := unpackOffsets(packed)
		n := min(len(all), limit-len(offs))
		if n <= 0 {
			continue
		}
		for _, o := range all[:n] {
			attempts[o] = r.attempts + 1
			held[r.attempts+1] = append(held[r.attempts+1], o)
		}
		offs = append(offs, all[:n]...)
		r.offsets = all[n:]
		taken = append(taken, r)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return out, nil, err
	}
	out, err = s.readClaimed(ctx, tx, offs, attempts, out)
	return out, taken, err
}

// readClaimed appends the messages of offs to out in offset order, with their attempt counts.
func (s mysql) readClaimed(ctx context.Context, tx dbx.Querier, offs []int64, attempts map[int64]int, out []Claimed) ([]Claimed, error) {
	if len(offs) == 0 {
		return out, nil
	}
	slices.Sort(offs)
	args := make([]any, len(offs))
	for i, o := range offs {
		args[i] = o
	}
	rows, err := tx.Query(ctx, s.readSQL+placeholders(len(offs))+") ORDER BY `offset`", args...)
	if err != nil {
		return out, err
	}
	defer rows.Close()
	for rows.Next() {
		c := Claimed{Again: true}
		if err := rows.Scan(&c.Offset, &c.UUID, &c.Payload, &c.Metadata); err != nil {
			return out, err
		}
		c.Attempts = attempts[c.Offset]
		out = append(out, c)
	}
	return out, rows.Err()
}

// claimInsert is a claims row to write.
type claimInsert struct {
	token     int64
	attempts  int
	visibleAt int64
	offsets   []int64 // in offset order
}

// insertClaims writes rows in one statement.
func (s mysql) insertClaims(ctx context.Context, tx dbx.Querier, groupID int32, rows []claimInsert) error {
	if len(rows) == 0 {
		return nil
	}
	var b strings.Builder
	b.WriteString("INSERT INTO " + s.t.Claims + " (`group_id`, `token`, `attempts`, `visible_at`, `first_offset`, `offsets`) VALUES ")
	args := make([]any, 0, 6*len(rows))
	for i, r := range rows {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString("(?,?,?,?,?,?)")
		args = append(args, groupID, r.token, r.attempts, r.visibleAt, r.offsets[0], packOffsets(r.offsets))
	}
	_, err := tx.Exec(ctx, b.String(), args...)
	return err
}

// rewrite writes r's offsets back into its row, or deletes the row when none is left; with
// visibleAt, it also moves the row's time.
func (s mysql) rewrite(ctx context.Context, tx dbx.Querier, groupID int32, r claimRow, visibleAt *int64) error {
	if len(r.offsets) == 0 {
		_, err := tx.Exec(ctx, "DELETE FROM "+s.t.Claims+" WHERE `group_id` = ? AND `token` = ? AND `attempts` = ?", groupID, r.token, r.attempts)
		return err
	}
	if visibleAt != nil {
		_, err := tx.Exec(ctx, "UPDATE "+s.t.Claims+" SET `offsets` = ?, `first_offset` = ?, `visible_at` = ? WHERE `group_id` = ? AND `token` = ? AND `attempts` = ?",
			packOffsets(r.offsets), r.offsets[0], *visibleAt, groupID, r.token, r.attempts)
		return err
	}
	_, err := tx.Exec(ctx, "UPDATE "+s.t.Claims+" SET `offsets` = ?, `first_offset` = ? WHERE `group_id` = ? AND `token` = ? AND `attempts` = ?",
		packOffsets(r.offsets), r.offsets[0], groupID, r.token, r.attempts)
	return err
}

// mysqlSettleChunk bounds the tokens of one settlement's lock statement.
const mysqlSettleChunk = 1000

// settle locks the rows of fs's tokens (in key order, so that concurrent settlements never
// wait for each other in a cycle), takes out the offsets of fs still in the row of their
// token, writes each row back once, and returns the offsets it settled: the others were
// stale (L3).
func (s mysql) settle(ctx context.Context, q dbx.Querier, op settleOp, groupID int32, fs []Fenced, d time.Duration) (map[int64]bool, error) {
	if op == settleAck {
		if done, ok, err := s.ackWholeRow(ctx, q, groupID, fs); ok || err != nil {
			return done, err
		}
	}
	var done map[int64]bool
	err := mysqlInTx(ctx, q, func(tx dbx.Querier) error {
		var err error
		done, _, err = s.settleIn(ctx, tx, op, groupID, fs, d)
		return err
	})
	if err != nil {
		return map[int64]bool{}, err
	}
	return done, nil
}

// ackWholeRow acks fs in one statement when they are of one token and are exactly the offsets
// of one of its rows, as the acks of a claim's messages settled together are (each claim of a
// subscription with MaxInFlight 1): the row is deleted if it holds those offsets and no other.
// It reports false, having changed nothing, when that does not match: the locking path then
// settles fs.
func (s mysql) ackWholeRow(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced) (map[int64]bool, bool, error) {
	if len(fs) == 0 {
		return nil, false, nil
	}
	offs := make([]int64, 0, len(fs))
	for _, f := range fs {
		if f.Token != fs[0].Token {
			return nil, false, nil
		}
		offs = append(offs, f.Offset)
	}
	slices.Sort(offs)
	offs = slices.Compact(offs)
	n, err := q.Exec(ctx, s.ackRowSQL, groupID, fs[0].Token, packOffsets(offs))
	if err != nil {
		return map[int64]bool{}, true, err
	}
	if n == 0 {
		return nil, false, nil
	}
	done := make(map[int64]bool, len(offs))
	for _, o := range offs {
		done[o] = true
	}
	return done, true, nil
}

// settleIn is settle in the transaction tx; it also returns the attempt count of each offset
// it settled.
func (s mysql) settleIn(ctx context.Context, tx dbx.Querier, op settleOp, groupID int32, fs []Fenced, d time.Duration) (map[int64]bool, map[int64]int, error) {
	done := make(map[int64]bool, len(fs))
	attempts := make(map[int64]int, len(fs))
	want := map[int64]map[int64]bool{} // offsets by token
	for _, f := range fs {
		if want[f.Token] == nil {
			want[f.Token] = map[int64]bool{}
		}
		want[f.Token][f.Offset] = true
	}
	tokens := make([]int64, 0, len(want))
	for t := range want {
		tokens = append(tokens, t)
	}
	slices.Sort(tokens)
	var now int64
	var moved []claimInsert
	for len(tokens) > 0 {
		n := min(len(tokens), mysqlSettleChunk)
		args := make([]any, 0, n+1)
		args = append(args, groupID)
		for _, t := range tokens[:n] {
			args = append(args, t)
		}
		rows, err := tx.Query(ctx, s.lockRowsSQL+placeholders(n)+") ORDER BY `token`, `attempts` FOR UPDATE", args...)
		if err != nil {
			return done, attempts, err
		}
		var locked []claimRow
		for rows.Next() {
			var r claimRow
			var packed []byte
			if err := rows.Scan(&r.token, &r.attempts, &packed, &now); err != nil {
				rows.Close()
				return done, attempts, err
			}
			r.offsets = unpackOffsets(packed)
			locked = append(locked, r)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return done, attempts, err
		}
		for _, r := range locked {
			keep := r.offsets[:0:0]
			var hit []int64
			for _, o := range r.offsets {
				if want[r.token][o] {
					hit = append(hit, o)
					done[o] = true
					attempts[o] = r.attempts
				} else {
					keep = append(keep, o)
				}
			}
			if len(hit) == 0 {
				continue
			}
			if op == settleExtend {
				at := now + msInt(d)
				if err := s.rewrite(ctx, tx, groupID, r, &at); err != nil {
					return done, attempts, err
				}
				continue
			}
			switch op {
			case settleNack:
				moved = append(moved, claimInsert{token: unheldToken(), attempts: r.attempts, visibleAt: now + msInt(d), offsets: hit})
			case settleRelease:
				moved = append(moved, claimInsert{token: unheldToken(), attempts: max(r.attempts-1, 0), visibleAt: now, offsets: hit})
			}
			r.offsets = keep
			if err := s.rewrite(ctx, tx, groupID, r, nil); err != nil {
				return done, attempts, err
			}
		}
		tokens = tokens[n:]
	}
	return done, attempts, s.insertClaims(ctx, tx, groupID, moved)
}

// ackHandingOver is the plain ack: MySQL has no claims ordered by key.
func (s mysql) ackHandingOver(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, _ int64, _ time.Duration, out []Claimed) (map[int64]bool, []Claimed, error) {
	done, err := s.settle(ctx, q, settleAck, groupID, fs, 0)
	return done, out[:0], err
}

// claimOrdered: MySQL has no claims ordered by key yet.
func (mysql) claimOrdered(context.Context, dbx.Beginner, int32, int64, time.Duration, int, int, *int64, []Claimed) ([]Claimed, time.Time, error) {
	return nil, time.Time{}, ErrOrderUnsupported
}

func (mysql) claimLocked(context.Context, dbx.Querier, int32, int64, int, int, int32, []int64, []int64, Due, []Claimed) ([]Claimed, []int64, error) {
	return nil, nil, errors.New("offsets: the advisory claim mode needs PostgreSQL's advisory locks")
}

// heldBack: offsets commit in order on MySQL, so nothing is held back.
func (mysql) heldBack(context.Context, dbx.Querier, int32) (int, error) { return 0, nil }

// deadLetter moves the fenced claims fs to the messages table to, in one transaction, and
// returns the offsets it moved: the claims are taken out of their rows as an ack takes them,
// then the copies are inserted, under the head row of to's topic.
func (s mysql) deadLetter(ctx context.Context, q dbx.Querier, groupID int32, group string, fs []Fenced, to Tables, dropKeys [2]string) (map[int64]bool, error) {
	var done map[int64]bool
	err := mysqlInTx(ctx, q, func(tx dbx.Querier) error {
		var attempts map[int64]int
		var err error
		if done, attempts, err = s.settleIn(ctx, tx, settleAck, groupID, fs, 0); err != nil || len(done) == 0 {
			return err
		}
		if err := lockHead(ctx, tx, to); err != nil {
			return err
		}
		offs := make([]int64, 0, len(done))
		for o := range done {
			offs = append(offs, o)
		}
		slices.Sort(offs)
		var cases strings.Builder
		args := []any{jsonPathMySQL(dropKeys[0]), jsonPathMySQL(dropKeys[1]), s.t.Topic, group}
		cases.WriteString("CASE m.`offset`")
		for _, o := range offs {
			cases.WriteString(" WHEN ? THEN ?")
			args = append(args, o, strconv.Itoa(attempts[o]))
		}
		cases.WriteString(" END")
		for _, o := range offs {
			args = append(args, o)
		}
		sql := fmt.Sprintf("INSERT INTO %[2]s (`uuid`, `payload`, `metadata`, `created_at`)\n"+
			"SELECT m.`uuid`, m.`payload`, JSON_SET(JSON_REMOVE(m.`metadata`, ?, ?),\n"+
			"\t'$.\"%[4]s\"', ?, '$.\"%[5]s\"', ?, '$.\"%[6]s\"', %[3]s, '$.\"%[7]s\"', CAST(m.`offset` AS CHAR)), %[8]s\n"+
			"FROM %[1]s m WHERE m.`offset` IN (%[9]s) ORDER BY m.`offset`",
			s.t.Messages, to.Messages, cases.String(), MetaDeadLetterTopic, MetaDeadLetterGroup, MetaDeadLetterAttempts, MetaDeadLetterOffset, mysqlNow, placeholders(len(offs)))
		_, err = tx.Exec(ctx, sql, args...)
		return err
	})
	if err != nil {
		return map[int64]bool{}, err // rolled back: nothing was moved
	}
	return done, nil
}

// jsonPathMySQL is the JSON path of the object key k, quoted so that a key with dots is one
// member (k holds no double quote: it is one of the library's metadata keys).
func jsonPathMySQL(k string) string { return `$."` + k + `"` }

// lockHead locks the head row of t's topic for the rest of the transaction tx: the writers of
// one topic take turns, so its offsets commit in order.
func lockHead(ctx context.Context, tx dbx.Querier, t Tables) error {
	rows, err := tx.Query(ctx, fmt.Sprintf("SELECT 1 FROM %s WHERE `consumer_group` = '' FOR UPDATE", t.Groups))
	if err != nil {
		return err
	}
	found := rows.Next()
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	if !found {
		return fmt.Errorf("offsets: the groups table %s has no head row: set InitializeSchema: true, or run the SQL of the topic's schema again", t.Groups)
	}
	return nil
}

// appending runs fn, which writes messages, in a transaction that holds the topic's head row.
func (s mysql) appending(ctx context.Context, q dbx.Querier, fn func(dbx.Querier) error) error {
	return mysqlInTx(ctx, q, func(tx dbx.Querier) error {
		if err := lockHead(ctx, tx, s.t); err != nil {
			return err
		}
		return fn(tx)
	})
}

// insertSQL: created_at is the statement's time on the server's clock.
func (s mysql) insertSQL(n int, _ string, delayed bool) string {
	if delayed {
		return repeatTuples(s.insDelPrefix, "(?,?,?,"+mysqlNow+",?)", n)
	}
	return repeatTuples(s.insertPrefix, "(?,?,?,"+mysqlNow+")", n)
}

// deliverAt is the time in Unix milliseconds, rounded up so that a delayed message is never
// handed out before it.
func (mysql) deliverAt(at time.Time) any { return unixMilliCeil(at) }

// notify: MySQL has no NOTIFY.
func (mysql) notify(context.Context, dbx.Querier, string, string) error { return nil }

// addPartitions: MySQL's messages table has no partitions.
func (mysql) addPartitions(context.Context, dbx.Querier, int) error { return nil }

func (mysql) noPartition(error) bool { return false }

// maintain deletes the settled messages older than opts.OlderThan, pruneBatch at a time, until
// a statement deletes fewer.
//
// A pass deletes from where the last one stopped (st.pruned): the rows it deleted stay in the
// table, marked, until purge removes them, which a long transaction elsewhere holds back, and
// a deletion that started from the table's first offset would step over all of them again.
// What a pass deletes is a range of offsets: the writers of a topic take turns, so a message's
// created_at grows with its offset, and the first message too young to go ends the range.
func (s mysql) maintain(ctx context.Context, st *partState, c dbx.Querier, opts MaintainOptions) (MaintainResult, error) {
	var res MaintainResult
	if !opts.Drop {
		return res, nil
	}
	var bound *int64
	var now int64
	if err := dbx.QueryRow(ctx, c, s.pruneBoundSQL, nil, &bound, &now); err != nil || bound == nil || *bound <= st.pruned {
		return res, err // no group yet, or nothing passed since the last pass
	}
	hi := *bound
	var young int64
	err := dbx.QueryRow(ctx, c, s.pruneYoungSQL, []any{st.pruned, hi, now - msInt(opts.OlderThan)}, &young)
	switch {
	case err == nil:
		hi = young - 1
	case !errors.Is(err, dbx.ErrNoRows):
		return res, err
	}
	// Windows of pruneBatch offsets (offsets leave gaps only where a publisher rolled back):
	// each deletion starts above the last one's rows.
	for st.pruned < hi {
		to := min(hi, st.pruned+pruneBatch)
		n, err := c.Exec(ctx, s.pruneSQL, st.pruned, to)
		res.Messages += n
		if err != nil {
			return res, err
		}
		st.pruned = to
	}
	return res, nil
}

// messagesSQL: TakeMessages locks the rows it reads until its transaction ends.
func (mysql) messagesSQL(t Tables, take bool) string {
	sql := fmt.Sprintf("SELECT `offset`, `uuid`, `payload`, `metadata`, `created_at`, coalesce(`deliver_at`, 0) FROM %s", t.Messages)
	if take {
		return sql + " WHERE `offset` > ? ORDER BY `offset` LIMIT ? FOR UPDATE"
	}
	return sql + " WHERE `offset` >= ? ORDER BY `offset` LIMIT ?"
}

// deleteMessages takes the offsets out of the claim rows that hold them (the claims table
// holds the work in flight: it is read whole, locked), then deletes the messages.
func (s mysql) deleteMessages(ctx context.Context, t Tables, tx dbx.Querier, offs []int64) (int64, error) {
	drop := make(map[int64]bool, len(offs))
	for _, o := range offs {
		drop[o] = true
	}
	rows, err := tx.Query(ctx, "SELECT `group_id`, `token`, `attempts`, `offsets` FROM "+t.Claims+" ORDER BY `group_id`, `token`, `attempts` FOR UPDATE")
	if err != nil {
		return 0, err
	}
	type keyed struct {
		group int32
		r     claimRow
	}
	var changed []keyed
	for rows.Next() {
		var k keyed
		var packed []byte
		if err := rows.Scan(&k.group, &k.r.token, &k.r.attempts, &packed); err != nil {
			rows.Close()
			return 0, err
		}
		all := unpackOffsets(packed)
		k.r.offsets = slices.DeleteFunc(slices.Clone(all), func(o int64) bool { return drop[o] })
		if len(k.r.offsets) != len(all) {
			changed = append(changed, k)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return 0, err
	}
	db := mysql{&mysqlTopic{t: t}}
	for _, k := range changed {
		if err := db.rewrite(ctx, tx, k.group, k.r, nil); err != nil {
			return 0, err
		}
	}
	return inChunks(offs, mysqlSettleChunk, func(in string, args []any) (int64, error) {
		return tx.Exec(ctx, fmt.Sprintf("DELETE FROM %s WHERE `offset` IN (%s)", t.Messages, in), args...)
	})
}

func (mysql) keySchemaSQL(k KeyTable) string {
	return fmt.Sprintf("CREATE TABLE IF NOT EXISTS %s (\n"+
		"\t`key`        VARBINARY(255) NOT NULL,\n"+
		"\t`expires_at` BIGINT         NOT NULL,\n"+
		"\tPRIMARY KEY (`key`),\n"+
		"\tKEY `expires_at` (`expires_at`)\n"+
		") ENGINE=InnoDB;\n", k.Table)
}

// keyCreateIn: MySQL's CREATE TABLE IF NOT EXISTS is atomic, so concurrent creators need no
// lock.
func (db mysql) keyCreateIn(ctx context.Context, k KeyTable, tx dbx.Querier) error {
	_, err := tx.Exec(ctx, strings.TrimSuffix(db.keySchemaSQL(k), ";\n"))
	return err
}

func (mysql) keyExists(ctx context.Context, k KeyTable, q dbx.Querier) (bool, error) {
	var n int64
	err := dbx.QueryRow(ctx, q, "SELECT count(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?", []any{k.Name}, &n)
	return n > 0, err
}

// keyClaim inserts the key; a key already there is taken over only if it expired. A key
// written by a transaction not yet committed makes the insert wait for it.
func (mysql) keyClaim(ctx context.Context, k KeyTable, q dbx.Querier, key []byte, window time.Duration) (bool, error) {
	ms := window.Milliseconds()
	_, err := q.Exec(ctx, fmt.Sprintf("INSERT INTO %s (`key`, `expires_at`) VALUES (?, %s + ?)", k.Table, mysqlNow), key, ms)
	if err == nil {
		return true, nil
	}
	if dbx.SQLState(err) != dbx.CodeUniqueViolation {
		return false, err
	}
	n, err := q.Exec(ctx, fmt.Sprintf("UPDATE %[1]s SET `expires_at` = %[2]s + ? WHERE `key` = ? AND `expires_at` <= %[2]s", k.Table, mysqlNow), ms, key)
	return n > 0, err
}

func (mysql) keyPrune(ctx context.Context, k KeyTable, q dbx.Querier, limit int) (int64, error) {
	return q.Exec(ctx, fmt.Sprintf("DELETE FROM %s WHERE `expires_at` <= %s ORDER BY `expires_at` LIMIT ?", k.Table, mysqlNow), limit)
}

// backendAlive looks the connection id up among the server's threads.
func (mysql) backendAlive(ctx context.Context, q dbx.Querier, pid uint32) (bool, error) {
	var n int64
	err := dbx.QueryRow(ctx, q, "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = ?", []any{int64(pid)}, &n)
	return n > 0, err
}
