package offsets

// PostgreSQL's statements.
//
// Messages are read in (xid, offset) order and only below the oldest transaction still running
// (pg_snapshot_xmin), so that a message committed late is never skipped (M2). Times are
// timestamptz; durations are passed in milliseconds (float8). Settlements are fenced by each
// claim's key and token, and take many claims in one statement over arrays.

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
)

// postgres is the database of PostgreSQL; its pgTopic is set by prepare.
type postgres struct{ *pgTopic }

// pgTopic holds the SQL text of a topic's statements on PostgreSQL.
type pgTopic struct {
	t Tables

	claimSQL            [4]string // by Due: the claims due again it takes first, then new messages
	claimLockedSQL      [4]string
	claimOrderedSQL     string
	lockGroupSQL        string
	ackSQL              string
	ackHandingOverSQL   string
	nackSQL             string
	releaseSQL          string
	extendSQL           string
	insertPrefix        string
	insertDelayedPrefix string
	ensureGrpSQL        string
	lookupGrpSQL        string
	horizonSQL          string

	with, cond string // the asynchronous-commit prefix and condition of the statements
}

func (postgres) dialect() dbx.Dialect { return dbx.Postgres }

func (postgres) quote(schema, name string) string { return ident.Qualified(schema, name) }

func (postgres) appending(ctx context.Context, q dbx.Querier, fn func(dbx.Querier) error) error {
	return fn(q)
}

func (postgres) tableName(prefix, topic, suffix string) string {
	return ident.TableName(prefix, topic, suffix)
}

// prepare makes the SQL text of t's statements. With asyncCommit, claims, extensions and
// settlements commit without waiting for their WAL record to reach disk
// (synchronous_commit = off for their own transaction only): a server crash can then forget
// the last fraction of a second of them, and the messages concerned are delivered again,
// which at-least-once delivery allows. Publishing is never asynchronous.
func (postgres) prepare(t Tables, asyncCommit bool) database {
	s := &pgTopic{t: t}
	// The setting is made inside the statement, so that it holds for the statement's own
	// implicit transaction and costs no round trip; the condition makes the planner run it.
	with, cond := "WITH ", ""
	if asyncCommit {
		with = "WITH sc AS (SELECT set_config('synchronous_commit', 'off', true) AS v), "
		cond = " AND (SELECT v FROM sc) IS NOT NULL"
	}
	s.with, s.cond = with, cond

	for _, due := range []Due{DueNone, DueGivenBack, DueRecent, DueAll} {
		s.claimSQL[due] = claimSQL(t, with, cond, due, false)
		s.claimLockedSQL[due] = claimSQL(t, with, cond, due, true)
	}
	s.claimOrderedSQL = orderedClaimSQL(t, with, cond)
	s.lockGroupSQL = fmt.Sprintf(lockGroupRowSQL, t.Groups)

	// Settlements always run under the asynchronous-commit prefix when it is asked for.
	s.ackSQL = settleSQL(t, with, cond, settleAck, "")
	s.ackHandingOverSQL = ackHandingOverSQL(t, with, cond)
	s.nackSQL = settleSQL(t, with, cond, settleNack, "")
	// Release gives back claims that never reached a handler: visible at once, and the attempt
	// they were counted as is taken back.
	s.releaseSQL = settleSQL(t, with, cond, settleRelease, "")
	// The lease deadlines of claims and extensions count from when the row is written
	// (clock_timestamp), not from the start of the statement (now): a statement that waited
	// on a lock longer than the lease (a migration's table lock) would otherwise write a lease
	// that has already run out, and the group's next claim would take the message again while
	// its handler works. The subscriber counts its own deadline from before the statement was
	// sent, so it never outlives the database's.
	s.extendSQL = settleSQL(t, with, cond, settleExtend, "")

	s.insertPrefix = fmt.Sprintf(`INSERT INTO %s ("uuid", "payload", "metadata") VALUES `, t.Messages)
	s.insertDelayedPrefix = fmt.Sprintf(`INSERT INTO %s ("uuid", "payload", "metadata", "deliver_at") VALUES `, t.Messages)

	s.ensureGrpSQL = fmt.Sprintf(`INSERT INTO %s ("consumer_group", "last_xid", "last_offset")
VALUES ($1, CASE WHEN $2::boolean THEN pg_snapshot_xmin(pg_current_snapshot()) ELSE '0'::xid8 END, 0)
ON CONFLICT ("consumer_group") DO NOTHING
RETURNING "group_id"`, t.Groups)
	s.lookupGrpSQL = fmt.Sprintf(`SELECT "group_id" FROM %s WHERE "consumer_group" = $1`, t.Groups)

	// Messages past the group's position that the xmin horizon still holds back (M2).
	s.horizonSQL = fmt.Sprintf(`SELECT count(*) FROM (
	SELECT 1 FROM %[2]s m, %[1]s g
	WHERE g."group_id" = $1 AND (m."xid", m."offset") > (g."last_xid", g."last_offset") AND m."offset" >= g."floor_offset"
	  AND m."xid" >= pg_snapshot_xmin(pg_current_snapshot())
	LIMIT 1000
) x`, t.Groups, t.Messages)
	return postgres{s}
}

// newMessagesSQL is the step m of the claim statements: the messages after the group's
// position (read from g) that were written by transactions older than every running one (M2),
// in (xid, offset) order, up to the room the due claims left ($4 minus their count) that may
// be handed out now, and the delayed ones among and before them (see delayedSQL), which the
// group's position passes. Up to pass (the parameter named) delayed messages are passed beyond
// that room, so that a run of delayed messages does not take the claim's room from the
// messages behind it; with pass 0 the delayed ones count against the room. The position is
// read through scalar subqueries so that it reaches the index scan of (xid, offset) as a
// bound, and the group's floor (see postgres_partitions.go) as the lowest offset, which
// leaves out, without opening them, the partitions below it. mat is "" or "MATERIALIZED ".
func newMessagesSQL(mat, pass string) string {
	return `m0 AS (
	SELECT m."offset", m."xid", m."uuid", m."payload", m."metadata", ` + delayedSQL + ` AS "later"
	FROM %[2]s m
	WHERE (m."xid", m."offset") > ((SELECT "last_xid" FROM g), (SELECT "last_offset" FROM g))
	  AND m."offset" >= (SELECT "floor_offset" FROM g)
	  AND m."xid" < pg_snapshot_xmin(pg_current_snapshot())
	ORDER BY m."xid", m."offset"
	LIMIT $4 - (SELECT count(*) FROM due) + ` + pass + `
), m AS ` + mat + `(
	SELECT w."offset", w."xid", w."uuid", w."payload", w."metadata", w."later" FROM (
		SELECT m0.*, count(*) FILTER (WHERE m0."later" IS NULL) OVER (ORDER BY m0."xid", m0."offset" ROWS UNBOUNDED PRECEDING) AS "nth"
		FROM m0
	) w
	WHERE w."nth" - (w."later" IS NULL)::int < (SELECT $4 - count(*) FROM due)
)`
}

// nextWaitingSQL finds the first message after the position of group row gr (of the claim
// statements) that may be delivered, if any. ORDER BY and LIMIT 1 keep it a plain index scan of
// (xid, offset) that stops at the first row: written as EXISTS, the planner prefers a bitmap
// scan, which reads the index entries of the group's whole backlog on every claim, a cost that
// grows with the backlog.
const nextWaitingSQL = `SELECT nx."offset" FROM %[2]s nx
		WHERE (nx."xid", nx."offset") > (gr."last_xid", gr."last_offset") AND nx."offset" >= gr."floor_offset"
		  AND nx."xid" < pg_snapshot_xmin(pg_current_snapshot())
		ORDER BY nx."xid", nx."offset" LIMIT 1`

// byOffsetSQL reads, as alias, the message of offset at (an expression of the row outside)
// from the messages table (%[2]s): one probe of the primary key of the one partition that
// holds it. A plain join lets the planner, which cannot count the partitions the executor
// leaves out, price a probe as one per partition and scan every partition instead; the
// subquery under LIMIT is never turned into a join.
func byOffsetSQL(alias, at string) string {
	return `LATERAL (SELECT b."offset", b."xid", b."uuid", b."payload", b."metadata", b."deliver_at" FROM %[2]s b WHERE b."offset" = ` + at + ` LIMIT 1) ` + alias
}

// claimTailSQL ends both claim statements: it advances the group's position past the new
// messages of m, and returns the due claims taken again (r) first, then the new messages read
// from newFrom, in (xid, offset) order, then one row (kind 2, with the time in epoch
// milliseconds) for each message of m that is delayed (see delayedSQL), then the lines of
// more, if any (another UNION ALL branch of the same columns). %[1]s and %[2]s are the groups
// and messages tables.
func claimTailSQL(newFrom, more string) string {
	return `, upd AS (
	UPDATE %[1]s SET "last_xid" = l."xid", "last_offset" = l."offset", "updated_at" = now()
	FROM (SELECT m."xid", m."offset" FROM m ORDER BY m."xid" DESC, m."offset" DESC LIMIT 1) l
	WHERE "group_id" = $1
)
SELECT x."offset", x."uuid", x."payload", x."metadata"::text, x."attempts", x.k, x.at FROM (
	SELECT msg."offset", msg."uuid", msg."payload", msg."metadata", r."attempts", 0 AS k, r."offset" AS o, 0::float8 AS at
	FROM r, ` + byOffsetSQL("msg", `r."offset"`) + `
	UNION ALL
	SELECT m."offset", m."uuid", m."payload", m."metadata", 1, 1, row_number() OVER (ORDER BY m."xid", m."offset"), 0::float8
	FROM ` + newFrom + `
	UNION ALL
	SELECT m."offset", '', ''::bytea, '{}'::jsonb, 0, 2, m."offset", extract(epoch FROM m."later")::float8 * 1000
	FROM m WHERE m."later" IS NOT NULL` + more + `
) x ORDER BY x.k, x.o`
}

// delayedSQL is, for a message m of the claim statements, the time it is delayed until, or
// NULL when it may be handed out now. Such a message gets a claim row due at that time with
// no holder (token 0, attempt 0), which the claims due again take once it has come; the
// group's position passes it, so the messages behind it are claimed at once.
const delayedSQL = `CASE WHEN m."deliver_at" > now() THEN m."deliver_at" END`

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// ensureGroup tries again when a concurrent insert of the group committed after the
// statement's snapshot was taken, which neither inserts nor sees the row.
func (s postgres) ensureGroup(ctx context.Context, q dbx.Querier, group string, startAtNewest bool) (int32, error) {
	for range 3 {
		var id int32
		err := dbx.QueryRowWrite(ctx, q, s.ensureGrpSQL, []any{group, startAtNewest}, &id)
		if err == nil {
			return id, nil
		}
		if !errors.Is(err, dbx.ErrNoRows) {
			return 0, err
		}
		err = dbx.QueryRow(ctx, q, s.lookupGrpSQL, []any{group}, &id)
		if err == nil {
			return id, nil
		}
		if !errors.Is(err, dbx.ErrNoRows) {
			return 0, err
		}
		// A concurrent insert committed after our snapshot was taken: look again.
	}
	return 0, fmt.Errorf("consumer group %q: its row could not be created or read", group)
}

func (s postgres) claim(ctx context.Context, q dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due Due, out []Claimed) ([]Claimed, error) {
	args := []any{groupID, token, ms(ttl), limit, pass}
	if looksBack(due) {
		args = append(args, due == DueRecent)
	}
	rows, err := dbx.QueryWrite(ctx, q, s.claimSQL[due], args...)
	if err != nil {
		return out, err
	}
	return scanClaimed(rows, out)
}

func (s postgres) claimOrdered(ctx context.Context, b dbx.Beginner, groupID int32, token int64, ttl time.Duration, limit, pass int, floor *int64, out []Claimed) ([]Claimed, time.Time, error) {
	n := len(out)
	began := time.Now() // before the transaction's start, which its statement counts from
	from, next := *floor, *floor
	err := dbx.LockedQuery(ctx, b, s.lockGroupSQL, []any{groupID},
		s.claimOrderedSQL, []any{groupID, token, ms(ttl), limit, pass, MaxParked, max(pass, parkPass), from}, func(rows dbx.Rows) error {
			var err error
			next = from
			out, err = scanClaimedLines(rows, out[:n], lineSinks{floor: &next})
			return err
		})
	if err != nil {
		return out[:n], time.Time{}, err
	}
	*floor = next
	var leased time.Time // zero while no claim was made
	for _, c := range out[n:] {
		if c.Delayed.IsZero() {
			leased = began.Add(c.leasedAfter)
			break
		}
	}
	return out, leased, nil
}

// claimLocked is ClaimLockedPassing (see claimLockedSQL).
func (s postgres) claimLocked(ctx context.Context, q dbx.Querier, groupID int32, token int64, limit, pass int, key1 int32, skip, unlock []int64, due Due, out []Claimed) ([]Claimed, []int64, error) {
	if skip == nil {
		skip = []int64{}
	}
	if unlock == nil {
		unlock = []int64{}
	}
	args := []any{groupID, token, key1, limit, skip, pass, unlock}
	if looksBack(due) {
		args = append(args, due == DueRecent)
	}
	rows, err := dbx.QueryWrite(ctx, q, s.claimLockedSQL[due], args...)
	if err != nil {
		return out, nil, err
	}
	var refused []int64
	out, err = scanClaimedLines(rows, out, lineSinks{refused: &refused})
	return out, refused, err
}

// looksBack says whether the claim statements of due are the one of DueGivenBack and
// DueRecent, which takes one parameter more: whether to look at the leases that ran out
// recently (see dueRecentStepSQL).
func looksBack(due Due) bool { return due == DueGivenBack || due == DueRecent }

func split(fs []Fenced) ([]int64, []int64) {
	offs := make([]int64, len(fs))
	toks := make([]int64, len(fs))
	for i, f := range fs {
		offs[i], toks[i] = f.Offset, f.Token
	}
	return offs, toks
}

// afterBounds is the After of each of fs, in order, for ackHandingOverSQL's $6: where unknown
// (0), the lowest bigint, below every token.
func afterBounds(fs []Fenced) []int64 {
	out := make([]int64, len(fs))
	for i, f := range fs {
		out[i] = f.After
		if f.After == 0 {
			out[i] = math.MinInt64
		}
	}
	return out
}

// ErrSettleRaced says that some claims of a settlement met concurrent changes of their rows
// on every try: neither applied nor refused, they may be settled again. It is returned only
// when the settlement cannot run in a transaction of its own (q is not a dbx.Beginner).
var ErrSettleRaced = errors.New("offsets: claims changed concurrently on every try; not settled")

// settleTries bounds the runs of one settlement statement for claims whose rows a concurrent
// statement changed after the statement's snapshot (see prepare). One more run settles them
// unless the row changed yet again in the few microseconds between the two.
const settleTries = 3

// settle runs a settlement statement (sql, with args after the group, offsets and tokens)
// for the fenced claims fs and returns the offsets it applied, on an error too (those its
// statements applied before it). Claims it does not return were refused: their token no
// longer matches. Claims whose fence held on their newest row version but that the statement
// could not change are run again, up to settleTries times, then in a transaction in which
// the statement's row locks keep them from changing until its second run has applied them.
func (s postgres) settleSQL(ctx context.Context, q dbx.Querier, sql string, groupID int32, fs []Fenced, args ...any) (map[int64]bool, error) {
	return s.settleHanding(ctx, q, sql, groupID, fs, nil, args...)
}

// settleHanding is settleSQL for a statement that may also hand over messages: with handed
// not nil, sql is ackHandingOverSQL, and the messages handed over by the runs that committed
// are appended to *handed, on an error too.
func (s postgres) settleHanding(ctx context.Context, q dbx.Querier, sql string, groupID int32, fs []Fenced, handed *[]Claimed, args ...any) (map[int64]bool, error) {
	done := make(map[int64]bool, len(fs))
	var err error
	for range settleTries {
		if fs, err = s.settleOnce(ctx, q, sql, groupID, fs, done, handed, args); err != nil || len(fs) == 0 {
			return done, err
		}
	}
	b, ok := q.(dbx.Beginner)
	if !ok {
		return done, ErrSettleRaced
	}
	// What the transaction applies counts only once it commits: on an error, done is what
	// the statements before it applied, and handed what they handed over.
	applied := maps.Clone(done)
	var before int
	if handed != nil {
		before = len(*handed)
	}
	err = dbx.InTx(ctx, b, func(tx dbx.Tx) error {
		for range 2 {
			var err error
			if fs, err = s.settleOnce(ctx, tx, sql, groupID, fs, done, handed, args); err != nil || len(fs) == 0 {
				return err
			}
		}
		return ErrSettleRaced // the locks of the first run make this impossible
	})
	if err != nil {
		if handed != nil {
			*handed = (*handed)[:before]
		}
		return applied, err
	}
	return done, nil
}

// settleOnce runs sql once for fs, adds the offsets it applied to done, and returns the claims
// whose fence held but that were not applied. With handed not nil, the statement's lines are
// ackHandingOverSQL's, and the messages it handed over are appended to *handed.
func (s postgres) settleOnce(ctx context.Context, q dbx.Querier, sql string, groupID int32, fs []Fenced, done map[int64]bool, handed *[]Claimed, args []any) ([]Fenced, error) {
	offs, toks := split(fs)
	params := append([]any{groupID, offs, toks}, args...)
	if handed != nil {
		params = append(params, afterBounds(fs))
	}
	rows, err := dbx.QueryWrite(ctx, q, sql, params...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var again map[int64]bool
	for rows.Next() {
		var off int64
		var ok bool
		if handed != nil {
			var kind int
			var c Claimed
			if err := rows.Scan(&kind, &off, &ok, &c.UUID, &c.Payload, &c.Metadata, &c.After); err != nil {
				return nil, err
			}
			if kind == 1 {
				c.Offset, c.Attempts = off, 1
				*handed = append(*handed, c)
				continue
			}
		} else if err := rows.Scan(&off, &ok); err != nil {
			return nil, err
		}
		if ok {
			done[off] = true
		} else {
			if again == nil {
				again = map[int64]bool{}
			}
			again[off] = true
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var next []Fenced
	for _, f := range fs {
		if again[f.Offset] {
			next = append(next, f)
		}
	}
	return next, nil
}

func (s postgres) settle(ctx context.Context, q dbx.Querier, op settleOp, groupID int32, fs []Fenced, d time.Duration) (map[int64]bool, error) {
	switch op {
	case settleNack:
		return s.settleSQL(ctx, q, s.nackSQL, groupID, fs, ms(d))
	case settleRelease:
		return s.settleSQL(ctx, q, s.releaseSQL, groupID, fs)
	case settleExtend:
		return s.settleSQL(ctx, q, s.extendSQL, groupID, fs, ms(d))
	}
	return s.settleSQL(ctx, q, s.ackSQL, groupID, fs)
}

// ackHandingOver acks and hands the keys it frees to token (see ackHandingOverSQL).
func (s postgres) ackHandingOver(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, token int64, ttl time.Duration, out []Claimed) (map[int64]bool, []Claimed, error) {
	handed := out[:0]
	done, err := s.settleHanding(ctx, q, s.ackHandingOverSQL, groupID, fs, &handed, token, ms(ttl))
	return done, handed, err
}

// deadLetter moves claims of the group to the messages table of another topic, in one
// statement: the claim is settled and a copy of its message, with the topic, the group, its
// attempts and its offset added to its metadata, is inserted there; both or neither (see
// settleSQL).
func (s postgres) deadLetter(ctx context.Context, q dbx.Querier, groupID int32, group string, fs []Fenced, to Tables, dropKeys [2]string) (map[int64]bool, error) {
	sql := settleSQL(s.t, s.with, s.cond, settleDeadLetter, to.Messages)
	return s.settleSQL(ctx, q, sql, groupID, fs, s.t.Topic, group, dropKeys[0], dropKeys[1])
}

// heldBack counts messages past the group's position that the xmin horizon holds back.
func (s postgres) heldBack(ctx context.Context, q dbx.Querier, groupID int32) (int, error) {
	var n int64
	err := dbx.QueryRow(ctx, q, s.horizonSQL, []any{groupID}, &n)
	return int(n), err
}

// insertSQL: with channel, the same statement also sends NOTIFY on channel with the messages
// table's name as payload (delivered when the transaction commits).
func (s postgres) insertSQL(n int, channel string, delayed bool) string {
	var b strings.Builder
	b.Grow(len(s.insertPrefix) + n*32 + 160)
	if channel != "" {
		b.WriteString("WITH ins AS (")
	}
	per := 3
	if delayed {
		per = 4
		b.WriteString(s.insertDelayedPrefix)
	} else {
		b.WriteString(s.insertPrefix)
	}
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		p := i * per
		b.WriteString("($")
		b.WriteString(strconv.Itoa(p + 1))
		b.WriteString(",$")
		b.WriteString(strconv.Itoa(p + 2))
		b.WriteString(",$")
		b.WriteString(strconv.Itoa(p + 3))
		b.WriteString("::jsonb")
		if delayed {
			b.WriteString(",$")
			b.WriteString(strconv.Itoa(p + 4))
			b.WriteString("::timestamptz")
		}
		b.WriteString(")")
	}
	if channel != "" {
		fmt.Fprintf(&b, ` RETURNING 1) SELECT pg_notify(%s, %s) FROM (SELECT 1 FROM ins LIMIT 1) x`,
			quoteLiteral(channel), quoteLiteral(s.t.Messages))
	}
	return b.String()
}

func (postgres) deliverAt(at time.Time) any { return at }

// notifySQL sends one NOTIFY on channel $1 with payload $2: a function call, so that both
// are parameters (a NOTIFY statement takes neither as one).
const notifySQL = `SELECT pg_notify($1, $2)`

func (postgres) notify(ctx context.Context, q dbx.Querier, channel, payload string) error {
	_, err := q.Exec(ctx, notifySQL, channel, payload)
	return err
}

func (postgres) backendAlive(ctx context.Context, q dbx.Querier, pid uint32) (bool, error) {
	var alive bool
	err := dbx.QueryRow(ctx, q, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", []any{int64(pid)}, &alive)
	return alive, err
}

// pgNoParkedTop is the VersionError.Found of PostgreSQL tables of this schema version whose
// groups table lacks parked_top (made before ordered claims kept a floor): SchemaSQL adds it.
var pgNoParkedTop = fmt.Sprintf("%s%d without parked_top", schemaCommentPrefix, SchemaVersion)

// schemaSQL: tables of schema versions 1 to 4 are upgraded in place (see upgradableVersions).
func (postgres) schemaSQL(t Tables) string {
	var b strings.Builder
	messagesSchemaSQL(&b, t)
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %s (
	"group_id"       integer     GENERATED ALWAYS AS IDENTITY (SEQUENCE NAME %s),
	"consumer_group" text        NOT NULL,
	"last_xid"       xid8        NOT NULL,
	"last_offset"    bigint      NOT NULL,
	"updated_at"     timestamptz NOT NULL DEFAULT now(),
	"floor_offset"   bigint      NOT NULL DEFAULT 0,
	"parked_top"     bigint,
	CONSTRAINT %s PRIMARY KEY ("group_id"),
	CONSTRAINT %s UNIQUE ("consumer_group")
);
`, t.Groups, t.seq("_g_seq"), t.obj("_g_pkey"), t.obj("_g_name"))
	// Groups tables of versions 1 to 3 lack floor_offset, and those of version 5 made before
	// order by key kept a floor lack parked_top: the catalog is read first, as for deliver_at
	// (a constant default, or none, changes only the catalog).
	body := fmt.Sprintf(` BEGIN
	IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = %[1]s::regclass AND attname = 'floor_offset' AND NOT attisdropped) THEN
		ALTER TABLE %[2]s ADD COLUMN IF NOT EXISTS "floor_offset" bigint NOT NULL DEFAULT 0;
	END IF;
	IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = %[1]s::regclass AND attname = 'parked_top' AND NOT attisdropped) THEN
		ALTER TABLE %[2]s ADD COLUMN IF NOT EXISTS "parked_top" bigint;
	END IF;
END `, quoteLiteral(t.Groups), t.Groups)
	tag := dollarTag(body)
	fmt.Fprintf(&b, "DO %s%s%s;\n", tag, body, tag)
	// The groups table names the topic, for tools that list topics from the catalog: a
	// shortened table name no longer spells it out.
	fmt.Fprintf(&b, "COMMENT ON TABLE %s IS %s;\n", t.Groups, quoteLiteral(topicCommentPrefix+t.Topic))
	// Claims: one row per claim statement (see postgres_claims.go). Tables of version 2 kept
	// one row per message: their rows are moved into the new table, a held claim keeping its
	// token, lease and attempts (the claims of one token and attempt count become one row), a
	// waiting one getting a row of its own. Their consumers must be stopped first: the
	// statements of version 2 do not read the new table.
	old := ident.TableName(t.prefix, t.Topic, "_claims_v2")
	body = fmt.Sprintf(` BEGIN
	IF EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = to_regclass(%[1]s) AND attname = 'offset' AND NOT attisdropped) THEN
		ALTER TABLE %[2]s RENAME TO %[3]s;
		ALTER TABLE %[4]s RENAME CONSTRAINT %[5]s TO %[6]s;
	END IF;
END `, quoteLiteral(t.Claims), t.Claims, ident.Quote(old), ident.Qualified(t.Schema, old), t.obj("_c_pkey"), ident.Quote(ident.TableName(t.prefix, t.Topic, "_claims_v2_pkey")))
	tag = dollarTag(body)
	fmt.Fprintf(&b, "DO %s%s%s;\n", tag, body, tag)
	fmt.Fprintf(&b, `CREATE TABLE IF NOT EXISTS %s (
	"group_id"   integer     NOT NULL,
	"token"      bigint      NOT NULL,
	"attempts"   integer     NOT NULL,
	"visible_at" timestamptz NOT NULL,
	"offsets"    bigint[]    NOT NULL,
	"order_key"  bigint,
	CONSTRAINT %s PRIMARY KEY ("group_id", "token", "attempts")
) WITH (fillfactor = 50);
`, t.Claims, t.obj("_c_pkey"))
	body = fmt.Sprintf(` BEGIN
	IF to_regclass(%[1]s) IS NOT NULL THEN
		INSERT INTO %[2]s ("group_id", "token", "attempts", "visible_at", "offsets")
		SELECT "group_id", "token", "attempts", max("visible_at"), array_agg("offset" ORDER BY "offset")
		FROM %[3]s WHERE "token" <> 0 GROUP BY "group_id", "token", "attempts"
		UNION ALL
		SELECT "group_id", %[4]s, "attempts", "visible_at", ARRAY["offset"] FROM %[3]s WHERE "token" = 0;
		DROP TABLE %[3]s;
	END IF;
END `, quoteLiteral(ident.Qualified(t.Schema, old)), t.Claims, ident.Qualified(t.Schema, old), unheldTokenSQL)
	tag = dollarTag(body)
	fmt.Fprintf(&b, "DO %s%s%s;\n", tag, body, tag)
	// Claims tables of versions 3 and 4 lack order_key: added as deliver_at is, the catalog
	// read first (a nullable column without a default changes only the catalog).
	body = fmt.Sprintf(` BEGIN
	IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = %[1]s::regclass AND attname = 'order_key' AND NOT attisdropped) THEN
		ALTER TABLE %[2]s ADD COLUMN IF NOT EXISTS "order_key" bigint;
	END IF;
END `, quoteLiteral(t.Claims), t.Claims)
	tag = dollarTag(body)
	fmt.Fprintf(&b, "DO %s%s%s;\n", tag, body, tag)
	fmt.Fprintf(&b, claimsLeaseIndexSQL+";\n", t.obj("_c_lease"), t.Claims)
	fmt.Fprintf(&b, claimsParkedIndexSQL+";\n", t.obj("_c_park"), t.Claims)
	// The partitions of the next offsets.
	fmt.Fprintf(&b, "SELECT %s(0, %d);\n", t.extendFn(), PartitionSize)
	// The version is written last: a table that carries it has every part of it.
	fmt.Fprintf(&b, "COMMENT ON TABLE %s IS '%s%d';\n", t.Messages, schemaCommentPrefix, SchemaVersion)
	return b.String()
}

// dollarTag returns a dollar-quote tag ($sqlbroker$, or a longer one) that body does not
// contain. The body holds the table names, and a topic may contain $: the server ends a
// dollar-quoted string at the first occurrence of its tag, wherever it stands, inside quotes
// or not, so a topic spelling the tag would end the body early.
func dollarTag(body string) string {
	tag := "$sqlbroker$"
	for strings.Contains(body, tag) {
		tag = tag[:len(tag)-1] + "_$"
	}
	return tag
}

// createIn takes the library's schema advisory lock for the transaction, so that concurrent
// creators of one topic do not race on the catalog.
func (db postgres) createIn(ctx context.Context, t Tables, tx dbx.Querier) error {
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1::int4, $2::int4)", SchemaLockKey1, t.lockKey2()); err != nil {
		return err
	}
	if err := db.check(ctx, t, tx, true); err != nil && !isUpgradable(err) {
		return err
	}
	_, err := tx.Exec(ctx, db.schemaSQL(t))
	return err
}

func (postgres) check(ctx context.Context, t Tables, q dbx.Querier, missingOK bool) error {
	var m, g, c, top bool
	var comment string
	// to_regclass resolves a name in the latest catalog, while obj_description reads through
	// the statement's snapshot: a table created by a transaction that committed in between
	// would show without its comment. Existence is therefore also read through the snapshot.
	err := dbx.QueryRow(ctx, q, `SELECT
	EXISTS (SELECT 1 FROM pg_catalog.pg_class WHERE oid = to_regclass($1)),
	EXISTS (SELECT 1 FROM pg_catalog.pg_class WHERE oid = to_regclass($2)),
	EXISTS (SELECT 1 FROM pg_catalog.pg_class WHERE oid = to_regclass($3)),
	coalesce(obj_description(to_regclass($1), 'pg_class'), ''),
	EXISTS (SELECT 1 FROM pg_catalog.pg_attribute WHERE attrelid = to_regclass($2) AND attname = 'parked_top' AND NOT attisdropped)`,
		[]any{t.Messages, t.Groups, t.Claims}, &m, &g, &c, &comment, &top)
	if err != nil {
		return err
	}
	if !missingOK {
		for _, x := range []struct {
			ok   bool
			name string
		}{{m, t.Messages}, {g, t.Groups}, {c, t.Claims}} {
			if !x.ok {
				return &MissingTableError{Topic: t.Topic, Table: x.name}
			}
		}
	}
	if m {
		v, ok := strings.CutPrefix(comment, schemaCommentPrefix)
		if n, err := strconv.Atoi(v); !ok || err != nil || n != SchemaVersion {
			return &VersionError{Topic: t.Topic, Table: t.Messages, Found: comment, Want: SchemaVersion}
		}
	}
	if m && g && !top {
		return &VersionError{Topic: t.Topic, Table: t.Groups, Found: pgNoParkedTop, Want: SchemaVersion}
	}
	return nil
}

// messagesSQL: TakeMessages locks the rows it reads until its transaction ends (a message
// another transaction deleted meanwhile is skipped).
func (postgres) messagesSQL(t Tables, take bool) string {
	sql := fmt.Sprintf(`SELECT "offset", "uuid", "payload", "metadata"::text,
	(extract(epoch FROM "created_at") * 1000)::bigint, coalesce((extract(epoch FROM "deliver_at") * 1000)::bigint, 0) FROM %s`, t.Messages)
	if take {
		return sql + ` WHERE "offset" > $1 ORDER BY "offset" LIMIT $2 FOR UPDATE`
	}
	return sql + ` WHERE "offset" >= $1 ORDER BY "offset" LIMIT $2`
}

// deleteMessages takes the offsets out of the claim rows that hold them, deletes the rows it
// left empty, then the messages.
func (postgres) deleteMessages(ctx context.Context, t Tables, tx dbx.Querier, offs []int64) (int64, error) {
	if _, err := tx.Exec(ctx, fmt.Sprintf(`UPDATE %s SET "offsets" = ARRAY(SELECT o FROM unnest("offsets") o WHERE o <> ALL ($1::bigint[]))
WHERE "offsets" && $1::bigint[]`, t.Claims), offs); err != nil {
		return 0, err
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf(`DELETE FROM %s WHERE "offsets" = '{}'`, t.Claims)); err != nil {
		return 0, err
	}
	return tx.Exec(ctx, fmt.Sprintf(`DELETE FROM %s WHERE "offset" = ANY ($1::bigint[])`, t.Messages), offs)
}

func (postgres) keySchemaSQL(k KeyTable) string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %[1]s (
	"key"        bytea       NOT NULL,
	"expires_at" timestamptz NOT NULL,
	CONSTRAINT %[2]s PRIMARY KEY ("key")
);
CREATE INDEX IF NOT EXISTS %[3]s ON %[1]s ("expires_at");
`, k.Table, ident.Quote(k.Name+"_pkey"), ident.Quote(k.Name+"_exp"))
}

// keyCreateIn takes the library's schema advisory lock, held until tx ends.
func (db postgres) keyCreateIn(ctx context.Context, k KeyTable, tx dbx.Querier) error {
	h := fnv.New32a()
	h.Write([]byte(k.Table))
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1::int4, $2::int4)", SchemaLockKey1, int32(h.Sum32())); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, db.keySchemaSQL(k))
	return err
}

func (postgres) keyExists(ctx context.Context, k KeyTable, q dbx.Querier) (bool, error) {
	var ok bool
	err := dbx.QueryRow(ctx, q, `SELECT to_regclass($1) IS NOT NULL`, []any{k.Table}, &ok)
	return ok, err
}

// keyClaim: a key written by a transaction not yet committed makes the statement wait for
// that transaction's end: the key is a duplicate if it committed, and is written here if it
// rolled back.
func (postgres) keyClaim(ctx context.Context, k KeyTable, q dbx.Querier, key []byte, window time.Duration) (bool, error) {
	return wroteRow(dbx.QueryWrite(ctx, q, fmt.Sprintf(`INSERT INTO %[1]s AS k ("key", "expires_at") VALUES ($1, clock_timestamp() + $2 * interval '1 microsecond')
ON CONFLICT ("key") DO UPDATE SET "expires_at" = excluded."expires_at" WHERE k."expires_at" <= clock_timestamp()
RETURNING 1`, k.Table), key, window.Microseconds()))
}

// keyPrune leaves a key that a running transaction is writing again to it (SKIP LOCKED).
func (postgres) keyPrune(ctx context.Context, k KeyTable, q dbx.Querier, limit int) (int64, error) {
	return q.Exec(ctx, fmt.Sprintf(`DELETE FROM %[1]s WHERE "key" = ANY (ARRAY(
	SELECT "key" FROM %[1]s WHERE "expires_at" <= clock_timestamp() ORDER BY "expires_at" LIMIT $1 FOR UPDATE SKIP LOCKED))
	AND "expires_at" <= clock_timestamp()`, k.Table), limit)
}

// IdleBranch is one subscription in the shared poll's look (IdleLookSQL); a zero IdleBranch
// (Tables nil) is a free slot.
type IdleBranch struct {
	Tables  *Tables
	GroupID int32
	Locks   bool // the advisory mode: claims held by locks are counted against $1
	Ordered bool // ordered by key: parked messages are work, one may be free to go
}

// IdleLookSQL is PostgreSQL's statement of the shared poll of idle subscriptions: one branch
// per slot, which returns the slot's index when the subscription's group has work: a claim
// due again (a lease ran out, a nack's backoff passed, a claim released), a message after the
// group's position that may be delivered (written by a transaction older than every running
// one), or, in the advisory mode, more claims held by a lock than the subscription holds
// itself ($1, by slot), one of which may have lost its holder. The table names are quoted and
// the group id is a number, so the text is built from trusted parts only; free slots read
// nothing. With held given, the counts are written into the text instead of being read from
// $1. It reports whether any branch reads $1's counts.
func IdleLookSQL(branches []IdleBranch, held []int64) (string, bool) {
	var b strings.Builder
	adv := false
	for i, br := range branches {
		if i > 0 {
			b.WriteString("\nUNION ALL\n")
		}
		if br.Tables == nil {
			fmt.Fprintf(&b, "SELECT %d::bigint WHERE false", i)
			continue
		}
		t, g := br.Tables, br.GroupID
		// The next message waiting is found by the claim's own step (nextWaitingSQL), from
		// the group's row; the names are put in by replacement, not as a format, since a
		// topic may hold a %.
		next := strings.ReplaceAll(nextWaitingSQL, "%[2]s", t.Messages)
		fmt.Fprintf(&b, `SELECT %d::bigint WHERE (SELECT 1 FROM %s c WHERE c."group_id" = %d AND c."visible_at" <= now() LIMIT 1) IS NOT NULL
	OR (SELECT (%s) FROM %s gr WHERE gr."group_id" = %d) IS NOT NULL`, i, t.Claims, g, next, t.Groups, g)
		if br.Ordered {
			fmt.Fprintf(&b, `
	OR (SELECT 1 FROM %[1]s c WHERE c."group_id" = %[2]d AND c."order_key" IS NOT NULL LIMIT 1) IS NOT NULL`, t.Claims, g)
		}
		if br.Locks {
			adv = true
			n := fmt.Sprintf("($1::bigint[])[%d]", i+1)
			if held != nil {
				n = fmt.Sprintf("%d::bigint", held[i])
			}
			fmt.Fprintf(&b, `
	OR (SELECT coalesce(sum(cardinality(c."offsets")), 0) FROM %[1]s c WHERE c."group_id" = %[2]d AND c."visible_at" = 'infinity' AND c."token" > 0) > %[3]s`, t.Claims, g, n)
		}
	}
	return b.String(), adv
}
