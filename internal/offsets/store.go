package offsets

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// SchemaLockKey1 is the first half of the two-int4 advisory lock key under which schema
// creation is serialised; the second half is derived from the messages table name. Message
// locks of the advisory claim mode use other first halves (see package advisory).
const SchemaLockKey1 int32 = 0x53427363 // "SBsc"

// Store runs the statements of one topic.
type Store struct {
	T Tables

	lite *sqliteStore // the statements on SQLite (T.IsSQLite); the fields below are PostgreSQL's

	claimSQL            string // due claims first, then new messages
	claimNewSQL         string // new messages only
	claimLockedSQL      string
	claimLockedNewSQL   string
	ackSQL              string
	nackSQL             string
	releaseSQL          string
	extendSQL           string
	insertPrefix        string
	insertDelayedPrefix string
	ensureGrpSQL        string
	lookupGrpSQL        string
	horizonSQL          string
	pruneSQL            string

	with, cond string // the asynchronous-commit prefix and condition of the statements
}

// NewStore prepares the SQL text for t. With asyncCommit, claims, extensions and
// settlements commit without waiting for their WAL record to reach disk
// (synchronous_commit = off for their own transaction only): a server crash can then forget
// the last fraction of a second of them, and the messages concerned are delivered again,
// which at-least-once delivery allows. Publishing is never asynchronous.
//
// For tables on SQLite (Tables.OnSQLite), the store runs SQLite's statements of the lease
// mode, with the same results; asyncCommit does not apply (see the package's SQLite notes).
// The advisory mode's statements are PostgreSQL's only.
func NewStore(t Tables, asyncCommit bool) *Store {
	s := &Store{T: t}
	if t.sqlite {
		s.lite = newSQLiteStore(t)
		return s
	}
	// The setting is made inside the statement, so that it holds for the statement's own
	// implicit transaction and costs no round trip; the condition makes the planner run it.
	with, cond := "WITH ", ""
	if asyncCommit {
		with = "WITH sc AS (SELECT set_config('synchronous_commit', 'off', true) AS v), "
		cond = " AND (SELECT v FROM sc) IS NOT NULL"
	}
	s.with, s.cond = with, cond

	// One round trip claims up to $4 messages for group $1 under token $2 with a lease of $3 ms:
	//  - due: claims of the group that are due again (their lease ran out, or they were nacked
	//    or released and their backoff passed), taken with a new token, so the old holder's
	//    token no longer matches (L3); SKIP LOCKED leaves those another claimer is taking;
	//  - if that left room and a message is waiting: lock the group row (serialises the
	//    group's claimers for a few milliseconds; an empty poll locks nothing, so it writes
	//    nothing and takes no transaction id), read the next messages after its position that were written by
	//    transactions older than every running one (M2), claim them and advance the position.
	//    The position is read through scalar subqueries so that it reaches the index scan of
	//    (xid, offset) as a bound: joined as a row, the planner would scan from the start of
	//    the index and filter, a cost that grows with every message the group consumed.
	// Redeliveries come first, then new messages in (xid, offset) order. claimNewSQL is the
	// same statement without the due step (see dueSQL).
	//
	// No parameter is used in an expression evaluated per row: the lease deadline is computed
	// once, in a subquery. The server keeps a generic plan of a prepared statement only if it
	// does not look dearer than the custom plans made with the parameters' values, and on a
	// large table the constant-folded deadline alone made the custom plans look cheaper: every
	// claim was then planned anew (TestClaimsKeepGenericPlans; BENCHMARKS.md has the figures).
	claim := func(due, r string) string {
		return fmt.Sprintf(`%[4]s`+due+`, `+r+`, g AS (
	SELECT gr."last_xid", gr."last_offset" FROM %[1]s gr
	WHERE gr."group_id" = $1 AND (SELECT count(*) FROM due) < $4%[5]s
	  AND (`+nextWaitingSQL+`) IS NOT NULL
	FOR UPDATE
), `+newMessagesSQL("", "$5")+`, ins AS (
	INSERT INTO %[3]s ("group_id", "offset", "token", "visible_at", "attempts")
	SELECT $1, m."offset",
		CASE WHEN m."later" IS NULL THEN $2::bigint ELSE 0 END,
		coalesce(m."later", (SELECT clock_timestamp() + $3::float8 * interval '1 millisecond')),
		CASE WHEN m."later" IS NULL THEN 1 ELSE 0 END
	FROM m
)`+claimTailSQL(`m WHERE m."later" IS NULL`), t.Groups, t.Messages, t.Claims, with, cond)
	}
	s.claimSQL = claim(dueSQL, leasedAgainSQL)
	s.claimNewSQL = claim(noDueSQL, noneAgainSQL)

	s.claimLockedSQL = claimLockedSQL(t, with, cond, dueSQL, lockedAgainSQL)
	s.claimLockedNewSQL = claimLockedSQL(t, with, cond, noDueSQL, noneAgainSQL)

	// Settlements are fenced by the claim's key and token and take many claims at once.
	//  - k finds each claim by its own probe of the primary key (the LATERAL subquery, which
	//    FOR UPDATE keeps from being flattened into a join), so that no plan, the server's
	//    generic one included, reads more of the index than the keys given. Joined to the
	//    arrays directly, the generic plan was a bitmap scan of the group's whole key range,
	//    which reads the entry of every claim deleted since the last vacuum, a cost that grew
	//    with the backlog drained (TestSettlePlansStayFlat; BENCHMARKS.md has the figures). FOR
	//    UPDATE locks the claim's newest version and checks the key and token on it (L3): k
	//    holds exactly the claims that are still this delivery's.
	//  - d changes those claims by row address. A claim that a concurrent statement (an
	//    extension of the same lease) changed after this statement's snapshot was taken is
	//    locked by k in its newer version, which d cannot see: it is returned as fenced but
	//    not applied, and settle runs the statement again for it (L3: a refusal means only
	//    that the claim is no longer the delivery's).
	settle := func(stmt string) string {
		head := with
		if !asyncCommit {
			head = "WITH "
		}
		return head + fmt.Sprintf(`k AS (
	SELECT x.t, a."offset" AS o FROM unnest($2::bigint[], $3::bigint[]) AS a("offset", "token"),
	LATERAL (SELECT c.ctid AS t FROM %[1]s c
		WHERE c."group_id" = $1 AND c."offset" = a."offset" AND c."token" = a."token"
		FOR UPDATE) x
), d AS (
`+stmt+`
WHERE c.ctid = ANY (ARRAY(SELECT t FROM k))`+cond+`
RETURNING c."offset"
)
SELECT k.o, EXISTS (SELECT 1 FROM d WHERE d."offset" = k.o) FROM k`, t.Claims)
	}
	s.ackSQL = settle(`DELETE FROM %[1]s c`)

	s.nackSQL = settle(`UPDATE %[1]s c SET "token" = 0, "visible_at" = now() + $4::float8 * interval '1 millisecond'`)

	// Release gives back claims that never reached a handler: visible at once, and the attempt
	// they were counted as is taken back.
	s.releaseSQL = settle(`UPDATE %[1]s c SET "token" = 0, "visible_at" = now(), "attempts" = greatest(c."attempts" - 1, 0)`)

	// The lease deadlines of claims and extensions count from when the row is written
	// (clock_timestamp), not from the start of the statement (now): a statement that waited
	// on a lock longer than the lease (a migration's table lock) would otherwise write a lease
	// that has already run out, and the group's next claim would take the message again while
	// its handler works. The subscriber counts its own deadline from before the statement was
	// sent, so it never outlives the database's.
	s.extendSQL = settle(`UPDATE %[1]s c SET "visible_at" = clock_timestamp() + $4::float8 * interval '1 millisecond'`)

	s.insertPrefix = fmt.Sprintf(`INSERT INTO %s ("uuid", "payload", "metadata") VALUES `, t.Messages)
	s.insertDelayedPrefix = fmt.Sprintf(`INSERT INTO %s ("uuid", "payload", "metadata", "deliver_at") VALUES `, t.Messages)

	s.ensureGrpSQL = fmt.Sprintf(`INSERT INTO %s ("consumer_group", "last_xid", "last_offset")
VALUES ($1, CASE WHEN $2::boolean THEN pg_snapshot_xmin(pg_current_snapshot()) ELSE '0'::xid8 END, 0)
ON CONFLICT ("consumer_group") DO NOTHING
RETURNING "group_id"`, t.Groups)
	s.lookupGrpSQL = fmt.Sprintf(`SELECT "group_id" FROM %s WHERE "consumer_group" = $1`, t.Groups)

	// Messages every group has passed and none still claims, older than $1 ms, at most $2.
	s.pruneSQL = fmt.Sprintf(`WITH low AS (
	SELECT "last_xid", "last_offset" FROM %[1]s ORDER BY "last_xid", "last_offset" LIMIT 1
)
DELETE FROM %[2]s m
WHERE m."offset" IN (
	SELECT d."offset" FROM %[2]s d
	WHERE (d."xid", d."offset") <= ((SELECT "last_xid" FROM low), (SELECT "last_offset" FROM low))
	  AND d."created_at" < now() - $1::float8 * interval '1 millisecond'
	  AND NOT EXISTS (SELECT 1 FROM %[3]s c WHERE c."offset" = d."offset")
	ORDER BY d."xid", d."offset"
	LIMIT $2
)`, t.Groups, t.Messages, t.Claims)

	// Messages past the group's position that the xmin horizon still holds back (M2).
	s.horizonSQL = fmt.Sprintf(`SELECT count(*) FROM (
	SELECT 1 FROM %[2]s m, %[1]s g
	WHERE g."group_id" = $1 AND (m."xid", m."offset") > (g."last_xid", g."last_offset")
	  AND m."xid" >= pg_snapshot_xmin(pg_current_snapshot())
	LIMIT 1000
) x`, t.Groups, t.Messages)
	return s
}

// newMessagesSQL is the step m of the claim statements: the messages after the group's
// position (read from g) that were written by transactions older than every running one (M2),
// in (xid, offset) order, up to the room the due claims left ($4 minus their count) that may
// be handed out now, and the delayed ones among and before them (see delayedSQL), which the
// group's position passes. Up to pass (the parameter named) delayed messages are passed beyond
// that room, so that a run of delayed messages does not take the claim's room from the
// messages behind it; with pass 0 the delayed ones count against the room. The position is
// read through scalar subqueries so that it reaches the index scan of (xid, offset) as a
// bound. mat is "" or "MATERIALIZED ".
func newMessagesSQL(mat, pass string) string {
	return `m0 AS (
	SELECT m."offset", m."xid", m."uuid", m."payload", m."metadata", ` + delayedSQL + ` AS "later"
	FROM %[2]s m
	WHERE (m."xid", m."offset") > ((SELECT "last_xid" FROM g), (SELECT "last_offset" FROM g))
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

// dueSQL is the due step of the claim statements: up to $4 claims of group $1 whose lease ran
// out or whose backoff passed, in offset order, locked for the statement.
//
// It walks the group's claims in the primary key from the lowest offset, and that walk also
// steps over the index entries of every claim deleted since the table was last vacuumed:
// acked claims leave their entries behind, and autovacuum comes about once a minute. While a
// large backlog drains that is hundreds of thousands of entries, read on every claim. So the
// subscriber runs the due step only when a claim may be due (see subscription.wantDue), and
// otherwise the statement with noDueSQL, which reads no claim at all.
const dueSQL = `due AS (
	SELECT "offset" FROM %[3]s
	WHERE "group_id" = $1 AND "visible_at" <= now()%[5]s
	ORDER BY "offset" LIMIT $4
	FOR UPDATE SKIP LOCKED
)`

// leasedAgainSQL is the step r of the lease mode's claim: the due claims, taken again under
// the new token and lease, one attempt more (lockedAgainSQL is the advisory mode's).
const leasedAgainSQL = `r AS (
	UPDATE %[3]s c SET "token" = $2, "visible_at" = (SELECT clock_timestamp() + $3::float8 * interval '1 millisecond'), "attempts" = c."attempts" + 1
	FROM due WHERE c."group_id" = $1 AND c."offset" = due."offset"
	RETURNING c."offset", c."attempts"
)`

// noDueSQL is the due step that takes nothing, and noneAgainSQL the step r (the due claims
// taken again) that changes nothing: written as an UPDATE joined to an empty due, the
// server's generic plan may still scan the group's claims.
const (
	noDueSQL     = `due AS (SELECT NULL::bigint AS "offset" WHERE false)`
	noneAgainSQL = `r AS (SELECT NULL::bigint AS "offset", NULL::integer AS "attempts" WHERE false)`
)

// nextWaitingSQL finds the first message after the position of group row gr (of the claim
// statements) that may be delivered, if any. ORDER BY and LIMIT 1 keep it a plain index scan of
// (xid, offset) that stops at the first row: written as EXISTS, the planner prefers a bitmap
// scan, which reads the index entries of the group's whole backlog on every claim, a cost that
// grows with the backlog.
const nextWaitingSQL = `SELECT nx."offset" FROM %[2]s nx
		WHERE (nx."xid", nx."offset") > (gr."last_xid", gr."last_offset")
		  AND nx."xid" < pg_snapshot_xmin(pg_current_snapshot())
		ORDER BY nx."xid", nx."offset" LIMIT 1`

// claimTailSQL ends both claim statements: it advances the group's position past the new
// messages of m, and returns the due claims taken again (r) first, then the new messages read
// from newFrom, in (xid, offset) order, then one row (kind 2, with the time in epoch
// milliseconds) for each message of m that is delayed (see delayedSQL). %[1]s and %[2]s are
// the groups and messages tables.
func claimTailSQL(newFrom string) string {
	return `, upd AS (
	UPDATE %[1]s SET "last_xid" = l."xid", "last_offset" = l."offset", "updated_at" = now()
	FROM (SELECT m."xid", m."offset" FROM m ORDER BY m."xid" DESC, m."offset" DESC LIMIT 1) l
	WHERE "group_id" = $1
)
SELECT x."offset", x."uuid", x."payload", x."metadata"::text, x."attempts", x.k, x.at FROM (
	SELECT msg."offset", msg."uuid", msg."payload", msg."metadata", r."attempts", 0 AS k, r."offset" AS o, 0::float8 AS at
	FROM r JOIN %[2]s msg ON msg."offset" = r."offset"
	UNION ALL
	SELECT m."offset", m."uuid", m."payload", m."metadata", 1, 1, row_number() OVER (ORDER BY m."xid", m."offset"), 0::float8
	FROM ` + newFrom + `
	UNION ALL
	SELECT m."offset", '', ''::bytea, '{}'::jsonb, 0, 2, m."offset", extract(epoch FROM m."later")::float8 * 1000
	FROM m WHERE m."later" IS NOT NULL
) x ORDER BY x.k, x.o`
}

// delayedSQL is, for a message m of the claim statements, the time it is delayed until, or
// NULL when it may be handed out now. Such a message gets a claim row due at that time with
// no holder (token 0, attempt 0), which the claims due again take once it has come; the
// group's position passes it, so the messages behind it are claimed at once.
const delayedSQL = `CASE WHEN m."deliver_at" > now() THEN m."deliver_at" END`

// Claimed is one message claimed for a group.
type Claimed struct {
	Offset   int64
	UUID     string
	Payload  []byte
	Metadata string // JSON object
	Attempts int
	Again    bool // claimed again (the due step, or taken over), not new

	// Delayed, when not zero, says that this is no claim but a message the statement passed
	// because it is delayed until then: its claim row comes due at that time, for the group's
	// claims due again to take. Nothing but Offset is set.
	Delayed time.Time
}

// Split moves the delayed entries (Claimed.Delayed) of cs out of it, keeping the order of the
// others, and returns their times, in the order of cs.
func Split(cs []Claimed) ([]Claimed, []time.Time) {
	var delayed []time.Time
	kept := cs[:0]
	for _, c := range cs {
		if c.Delayed.IsZero() {
			kept = append(kept, c)
			continue
		}
		delayed = append(delayed, c.Delayed)
	}
	return kept, delayed
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// EnsureGroup creates the group's row if it is missing and returns its id. A new group starts
// at the oldest message kept, or, with startAtNewest, after every message already committed.
func (s *Store) EnsureGroup(ctx context.Context, q dbx.Querier, group string, startAtNewest bool) (int32, error) {
	if s.lite != nil {
		return s.lite.ensureGroup(ctx, q, group, startAtNewest)
	}
	for range 3 {
		var id int32
		err := dbx.QueryRow(ctx, q, s.ensureGrpSQL, []any{group, startAtNewest}, &id)
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

func scanClaimed(rows dbx.Rows, out []Claimed) ([]Claimed, error) {
	defer rows.Close()
	for rows.Next() {
		var c Claimed
		var attempts, kind int64
		var at float64
		if err := rows.Scan(&c.Offset, &c.UUID, &c.Payload, &c.Metadata, &attempts, &kind, &at); err != nil {
			return out, err
		}
		c.Attempts, c.Again = int(attempts), kind == 0
		if kind == 2 {
			c.Delayed = time.UnixMicro(int64(at * 1000))
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// Claim claims up to limit messages for the group under token, with a lease of ttl: first
// those due again, then new ones after the group's position, which it advances.
//
// With due false it claims new messages only: it reads no claim of the group, so its cost
// does not depend on how many claims were settled since the last vacuum (see dueSQL).
func (s *Store) Claim(ctx context.Context, q dbx.Querier, groupID int32, token int64, ttl time.Duration, limit int, due bool, out []Claimed) ([]Claimed, error) {
	return s.ClaimPassing(ctx, q, groupID, token, ttl, limit, 0, due, out)
}

// ClaimPassing is Claim that passes up to pass delayed messages besides the limit messages it
// may claim: delayed messages it passes do not take the room of the messages behind them
// (with pass 0 they do, as in Claim). A claim that passed delayed messages is best followed
// by one with room to pass many: the run may go on.
func (s *Store) ClaimPassing(ctx context.Context, q dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due bool, out []Claimed) ([]Claimed, error) {
	if s.lite != nil {
		return s.lite.claim(ctx, q, groupID, token, ttl, limit, pass, due, out)
	}
	sql := s.claimNewSQL
	if due {
		sql = s.claimSQL
	}
	rows, err := q.Query(ctx, sql, groupID, token, ms(ttl), limit, pass)
	if err != nil {
		return out, err
	}
	return scanClaimed(rows, out)
}

// Fenced is a claim identified by its offset and the token it was claimed under.
type Fenced struct {
	Offset int64
	Token  int64
}

// Fence returns the claims cs as claimed under token, for the statements that settle or give
// them back.
func Fence(cs []Claimed, token int64) []Fenced {
	fs := make([]Fenced, len(cs))
	for i, c := range cs {
		fs[i] = Fenced{Offset: c.Offset, Token: token}
	}
	return fs
}

func split(fs []Fenced) ([]int64, []int64) {
	offs := make([]int64, len(fs))
	toks := make([]int64, len(fs))
	for i, f := range fs {
		offs[i], toks[i] = f.Offset, f.Token
	}
	return offs, toks
}

// ErrSettleRaced says that some claims of a settlement met concurrent changes of their rows
// on every try: neither applied nor refused, they may be settled again. It is returned only
// when the settlement cannot run in a transaction of its own (q is not a dbx.Beginner).
var ErrSettleRaced = errors.New("offsets: claims changed concurrently on every try; not settled")

// settleTries bounds the runs of one settlement statement for claims whose rows a concurrent
// statement changed after the statement's snapshot (see NewStore). One more run settles them
// unless the row changed yet again in the few microseconds between the two.
const settleTries = 3

// settle runs a settlement statement (sql, with args after the group, offsets and tokens)
// for the fenced claims fs and returns the offsets it applied, on an error too (those its
// statements applied before it). Claims it does not return were refused: their token no
// longer matches. Claims whose fence held on their newest row version but that the statement
// could not change are run again, up to settleTries times, then in a transaction in which
// the statement's row locks keep them from changing until its second run has applied them.
func (s *Store) settle(ctx context.Context, q dbx.Querier, sql string, groupID int32, fs []Fenced, args ...any) (map[int64]bool, error) {
	done := make(map[int64]bool, len(fs))
	var err error
	for range settleTries {
		if fs, err = s.settleOnce(ctx, q, sql, groupID, fs, done, args); err != nil || len(fs) == 0 {
			return done, err
		}
	}
	b, ok := q.(dbx.Beginner)
	if !ok {
		return done, ErrSettleRaced
	}
	// What the transaction applies counts only once it commits: on an error, done is what
	// the statements before it applied.
	applied := maps.Clone(done)
	err = dbx.InTx(ctx, b, func(tx dbx.Tx) error {
		for range 2 {
			var err error
			if fs, err = s.settleOnce(ctx, tx, sql, groupID, fs, done, args); err != nil || len(fs) == 0 {
				return err
			}
		}
		return ErrSettleRaced // the locks of the first run make this impossible
	})
	if err != nil {
		return applied, err
	}
	return done, nil
}

// settleOnce runs sql once for fs, adds the offsets it applied to done, and returns the claims
// whose fence held but that were not applied.
func (s *Store) settleOnce(ctx context.Context, q dbx.Querier, sql string, groupID int32, fs []Fenced, done map[int64]bool, args []any) ([]Fenced, error) {
	offs, toks := split(fs)
	rows, err := q.Query(ctx, sql, append([]any{groupID, offs, toks}, args...)...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var again map[int64]bool
	for rows.Next() {
		var off int64
		var ok bool
		if err := rows.Scan(&off, &ok); err != nil {
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

// Ack deletes the claims whose token still matches and returns the offsets it deleted; the
// others were stale (L3).
func (s *Store) Ack(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced) (map[int64]bool, error) {
	if s.lite != nil {
		return s.lite.settle(ctx, q, s.lite.ackPrefix, groupID, fs)
	}
	return s.settle(ctx, q, s.ackSQL, groupID, fs)
}

// Nack makes the claims visible again after backoff; the attempt count stays.
func (s *Store) Nack(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, backoff time.Duration) (map[int64]bool, error) {
	if s.lite != nil {
		return s.lite.settle(ctx, q, s.lite.nackPrefix, groupID, fs, msInt(backoff))
	}
	return s.settle(ctx, q, s.nackSQL, groupID, fs, ms(backoff))
}

// Release makes claims that never reached a handler visible again at once.
func (s *Store) Release(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced) (map[int64]bool, error) {
	if s.lite != nil {
		return s.lite.settle(ctx, q, s.lite.relPrefix, groupID, fs)
	}
	return s.settle(ctx, q, s.releaseSQL, groupID, fs)
}

// Extend moves the lease deadline of the claims to now()+ttl and returns the offsets it
// extended; a claim missing from the result has lost its lease (L4).
func (s *Store) Extend(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, ttl time.Duration) (map[int64]bool, error) {
	if s.lite != nil {
		return s.lite.settle(ctx, q, s.lite.extPrefix, groupID, fs, msInt(ttl))
	}
	return s.settle(ctx, q, s.extendSQL, groupID, fs, ms(ttl))
}

// HeldBack counts (up to 1000) messages after the group's position that are committed or in
// progress but not yet below the xmin horizon: delivery waits for the oldest running
// transaction of the cluster to end (M2).
func (s *Store) HeldBack(ctx context.Context, q dbx.Querier, groupID int32) (int, error) {
	if s.lite != nil {
		return 0, nil // offsets commit in order on SQLite: nothing is held back
	}
	var n int64
	err := dbx.QueryRow(ctx, q, s.horizonSQL, []any{groupID}, &n)
	return int(n), err
}

// Row is one message to insert.
type Row struct {
	UUID     string
	Payload  []byte
	Metadata string // JSON object

	// DeliverAt, when not zero, delays the message: no group is handed it before then.
	DeliverAt time.Time
}

// maxRowsPerInsert bounds the rows of one INSERT, whatever the database.
const maxRowsPerInsert = 10000

// The most bind parameters one statement may carry: PostgreSQL's wire protocol counts them in
// 16 bits, and SQLite's SQLITE_MAX_VARIABLE_NUMBER is 32766 (modernc.org/sqlite keeps the
// default).
const (
	maxParamsPostgres = 65535
	maxParamsSQLite   = 32766
)

// rowsPerInsert is the most rows of one INSERT on the store's database: maxRowsPerInsert, or
// fewer when their parameters (3 a row, 4 when the statement carries deliver_at) would pass
// the database's limit. On SQLite, a statement of delayed rows takes 8191.
func (s *Store) rowsPerInsert(delayed bool) int {
	limit := maxParamsPostgres
	if s.lite != nil {
		limit = maxParamsSQLite
	}
	per := 3
	if delayed {
		per = 4
	}
	return min(maxRowsPerInsert, limit/per)
}

// nextInsert is the number of rows at the head of rows that the next INSERT writes, and
// whether it carries deliver_at.
func (s *Store) nextInsert(rows []Row) (n int, delayed bool) {
	n = min(len(rows), s.rowsPerInsert(anyDelayed(rows[:min(len(rows), maxRowsPerInsert)])))
	return n, anyDelayed(rows[:n])
}

// OneStatement reports whether Insert writes rows in one statement (all or none by itself);
// more rows need a transaction around Insert to be written all or none.
func (s *Store) OneStatement(rows []Row) bool {
	return len(rows) <= s.rowsPerInsert(anyDelayed(rows))
}

// InsertSQL builds the multi-row INSERT for n rows. With notify, the same statement also sends
// NOTIFY on channel with the messages table's name as payload (delivered when the
// transaction commits).
func (s *Store) InsertSQL(n int, channel string) string { return s.insertSQL(n, channel, false) }

// insertSQL is InsertSQL; with delayed, every row has a fourth parameter, its deliver_at
// (NULL for a message that is not delayed).
func (s *Store) insertSQL(n int, channel string, delayed bool) string {
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
			quoteLiteral(channel), quoteLiteral(s.T.Messages))
	}
	return b.String()
}

// quoteLiteral quotes s as an SQL string literal (s holds no backslash: it is a channel or a
// table name built from validated parts).
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// Insert writes rows in statements of at most rowsPerInsert rows each (no statement passes
// the database's limit of bind parameters), the last of which also notifies channel when it
// is not "". Callers that need all-or-none for more rows than one statement holds
// (OneStatement) run it inside a transaction.
func (s *Store) Insert(ctx context.Context, q dbx.Querier, rows []Row, channel string) error {
	if s.lite != nil {
		return s.lite.insert(ctx, q, rows, s.nextInsert) // SQLite has no NOTIFY: channel does not apply
	}
	for len(rows) > 0 {
		n, delayed := s.nextInsert(rows)
		args := make([]any, 0, n*4)
		for _, r := range rows[:n] {
			payload := r.Payload
			if payload == nil {
				payload = []byte{}
			}
			args = append(args, r.UUID, payload, r.Metadata)
			if delayed {
				args = append(args, deliverAt(r))
			}
		}
		ch := ""
		if n == len(rows) {
			ch = channel
		}
		if _, err := q.Exec(ctx, s.insertSQL(n, ch, delayed), args...); err != nil {
			return err
		}
		rows = rows[n:]
	}
	return nil
}

// MaxRowsPerStatement says how many rows Insert writes in one statement at most (fewer on
// SQLite when a row is delayed: see OneStatement).
func MaxRowsPerStatement() int { return maxRowsPerInsert }

// CopyMinRows is the number of rows from which Copy writes faster than Insert on this
// library's messages rows (256-byte payloads, pgx, PostgreSQL 15, measured by
// BenchmarkInsertVsCopy): below it, the multi-row INSERT is as fast or faster, and it carries
// the NOTIFY in the same statement.
const CopyMinRows = 500

var (
	copyColumns        = []string{"uuid", "payload", "metadata"}
	copyDelayedColumns = []string{"uuid", "payload", "metadata", "deliver_at"}
)

// anyDelayed reports whether a row of rows is delayed: only then do the statements that write
// them carry the deliver_at column.
func anyDelayed(rows []Row) bool {
	for _, r := range rows {
		if !r.DeliverAt.IsZero() {
			return true
		}
	}
	return false
}

// deliverAt is the deliver_at value of r: nil (NULL) when it is not delayed.
func deliverAt(r Row) any {
	if r.DeliverAt.IsZero() {
		return nil
	}
	return r.DeliverAt
}

// Copy writes rows with COPY FROM STDIN, in one statement (all or none) however many there
// are. COPY cannot carry a NOTIFY: callers send one with Notify.
func (s *Store) Copy(ctx context.Context, c dbx.Copier, rows []Row) error {
	if s.lite != nil {
		return errors.New("offsets: COPY is PostgreSQL's")
	}
	src := make([][]any, len(rows))
	delayed := anyDelayed(rows)
	for i, r := range rows {
		payload := r.Payload
		if payload == nil {
			payload = []byte{}
		}
		src[i] = []any{r.UUID, payload, r.Metadata}
		if delayed {
			src[i] = append(src[i], deliverAt(r))
		}
	}
	columns := copyColumns
	if delayed {
		columns = copyDelayedColumns
	}
	table := []string{s.T.MessagesName}
	if s.T.Schema != "" {
		table = []string{s.T.Schema, s.T.MessagesName}
	}
	n, err := c.CopyFrom(ctx, table, columns, src)
	if err == nil && n != int64(len(rows)) {
		err = fmt.Errorf("offsets: COPY wrote %d rows of %d", n, len(rows))
	}
	return err
}

// Notify sends a NOTIFY of the messages table on channel, as Insert's statement does.
func (s *Store) Notify(ctx context.Context, q dbx.Querier, channel string) error {
	if s.lite != nil {
		return nil // SQLite has no NOTIFY
	}
	_, err := q.Exec(ctx, "SELECT pg_notify($1, $2)", channel, s.T.Messages)
	return err
}

// Prune deletes up to limit messages that every consumer group has passed and that no claim
// holds, written more than olderThan ago, and returns how many it deleted.
func (s *Store) Prune(ctx context.Context, q dbx.Querier, olderThan time.Duration, limit int) (int64, error) {
	if s.lite != nil {
		return q.Exec(ctx, s.lite.pruneSQL, msInt(olderThan), limit)
	}
	return q.Exec(ctx, s.pruneSQL, ms(olderThan), limit)
}
