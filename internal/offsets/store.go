package offsets

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
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

	db database // T's database, with the topic's statements made

	mu    sync.Mutex // one Maintain at a time
	parts partState  // what Maintain learned
}

// NewStore makes the statements of t's topic. With asyncCommit, claims, extensions and
// settlements commit without waiting for their WAL record to reach disk, where the database
// has such a setting (PostgreSQL's synchronous_commit): a server crash can then forget the
// last fraction of a second of them, and the messages concerned are delivered again, which
// at-least-once delivery allows. Publishing is never asynchronous.
func NewStore(t Tables, asyncCommit bool) *Store {
	return &Store{T: t, db: t.database().prepare(t, asyncCommit)}
}

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

	// After is, for a message of a group ordered by key claimed on PostgreSQL, a token below
	// that of every parked row of its key (parkedTokenSQL) that may hold the key's next
	// message: AckHandingOver starts its look for that row there (see ackHandingOverSQL),
	// past the index entries of the key's parked rows handed out before, which a vacuum
	// removes only later. 0 when unknown. A wrong After costs no order: the key's next
	// message is then left to the group's next ordered claim.
	After int64

	// leasedAfter is, for a line of an ordered claim on PostgreSQL, how long after its
	// transaction began its leases began (see orderedClaimSQL).
	leasedAfter time.Duration
}

// TakeDelayed moves the delayed entries (Claimed.Delayed) of cs out of it, keeping the order of the
// others, and returns their times, in the order of cs.
func TakeDelayed(cs []Claimed) ([]Claimed, []time.Time) {
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

// EnsureGroup creates the group's row if it is missing and returns its id. A new group starts
// at the oldest message kept, or, with startAtNewest, after every message already committed.
func (s *Store) EnsureGroup(ctx context.Context, q dbx.Querier, group string, startAtNewest bool) (int32, error) {
	return s.db.ensureGroup(ctx, q, group, startAtNewest)
}

func scanClaimed(rows dbx.Rows, out []Claimed) ([]Claimed, error) {
	return scanClaimedLines(rows, out, lineSinks{})
}

// lineSinks take the lines of a claim statement that are no claims.
type lineSinks struct {
	// floor: each line has an eighth column, its Claimed.After, and a line of kind 3 gives
	// *floor instead of a claim (orderedClaimSQL's lines).
	floor *int64
	// refused: a line of kind 4 is an offset whose lock the claim was to drop and the
	// session did not hold (unlockStepSQL), appended to *refused.
	refused *[]int64
}

// scanClaimedLines reads the lines of a claim statement into out, and those that are no
// claims into sinks.
func scanClaimedLines(rows dbx.Rows, out []Claimed, sinks lineSinks) ([]Claimed, error) {
	defer rows.Close()
	var c Claimed
	var attempts, kind int64
	var at float64
	dest := []any{&c.Offset, &c.UUID, &c.Payload, &c.Metadata, &attempts, &kind, &at}
	if sinks.floor != nil {
		dest = append(dest, &c.After)
	}
	for rows.Next() {
		c = Claimed{}
		if err := rows.Scan(dest...); err != nil {
			return out, err
		}
		if kind == 3 && sinks.floor != nil {
			*sinks.floor = c.After
			continue
		}
		if kind == 4 && sinks.refused != nil {
			*sinks.refused = append(*sinks.refused, c.Offset)
			continue
		}
		c.Attempts, c.Again = int(attempts), kind == 0
		if kind == 2 {
			c.Delayed = time.UnixMicro(int64(at * 1000))
		} else {
			c.leasedAfter = time.Duration(at * float64(time.Millisecond))
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// Due says which claims due again a claim statement takes back before new messages.
type Due uint8

const (
	// DueNone takes new messages only: the claim reads no claim of the group, so its cost
	// does not depend on how many claims were settled since the last vacuum.
	DueNone Due = iota
	// DueGivenBack takes back the claims no one holds whose time came: nacked after their
	// backoff, released, delayed messages whose time came, and in the advisory mode those
	// whose lock was taken elsewhere. On PostgreSQL these are a range of the claims' primary
	// key of their own, whose entries come and go with them only: the look's cost does not
	// grow with the claims settled while vacuum is held back.
	DueGivenBack
	// DueRecent takes back, besides, the held claims whose lease ran out within the last
	// RecentWindow. On PostgreSQL it reads those by an index of the held claims' lease
	// deadlines, from RecentWindow ago to now: the versions a held snapshot keeps alive
	// that it reads are those whose deadline fell in that window, however long vacuum has
	// been held back. A lease that ran out earlier is left to DueAll.
	DueRecent
	// DueAll takes back, besides, every held claim whose lease ran out. On PostgreSQL this
	// reads every claim row of the group, live or dead.
	DueAll
)

// RecentWindow is how far back a claim with DueRecent looks for leases that ran out. A
// subscription uses it only while its own looks at lost leases have left no longer gap (see
// the claim loop).
const RecentWindow = 5 * time.Second

// Claim claims up to limit messages for the group under token, with a lease of ttl: first
// those due again (as due says), then new ones after the group's position, which it advances.
func (s *Store) Claim(ctx context.Context, q dbx.Querier, groupID int32, token int64, ttl time.Duration, limit int, due Due, out []Claimed) ([]Claimed, error) {
	return s.ClaimPassing(ctx, q, groupID, token, ttl, limit, 0, due, out)
}

// ClaimPassing is Claim that passes up to pass delayed messages besides the limit messages it
// may claim: delayed messages it passes do not take the room of the messages behind them
// (with pass 0 they do, as in Claim). A claim that passed delayed messages is best followed
// by one with room to pass many: the run may go on.
func (s *Store) ClaimPassing(ctx context.Context, q dbx.Querier, groupID int32, token int64, ttl time.Duration, limit, pass int, due Due, out []Claimed) ([]Claimed, error) {
	return s.db.claim(ctx, q, groupID, token, ttl, limit, pass, due, out)
}

// ErrOrderUnsupported says that the database has no claims ordered by key.
var ErrOrderUnsupported = errors.New("offsets: this database has no claims ordered by key")

// parkPass is how many messages an ordered claim may pass besides its room, parked behind
// their keys or delayed, while its group has parked messages (on PostgreSQL; on SQLite,
// always): the messages behind a run of a busy key's are reached in one claim.
const parkPass = 1_000

// MaxParked is the most messages of a group ordered by key that wait parked behind their key:
// while as many wait, a claim reads no new message (see orderedClaimSQL).
const MaxParked = 1_000

// ClaimOrdered is ClaimPassing for a group ordered by key (MetaOrderKey): a message of a key
// is claimed only once every message of its key before it in the group's order is settled;
// the others wait parked. It runs in a transaction of its own begun on b, which locks the
// group's row first, so that the group's ordered claims run one after another. It passes up
// to pass delayed messages besides its room, as ClaimPassing does, and, while the group has
// parked messages, up to parkPass delayed or parked ones if that is more.
//
// It also returns, when it claimed, a time no later than when its leases began, which comes
// after the wait for the lock (on PostgreSQL, a time taken before the transaction began plus
// how long after its start the leases began; on SQLite, when the database's write lock was
// had): a deadline counted from then never outlives them, and the wait for the lock (another
// consumer's claim, a frozen process holding the write lock) does not shorten it.
func (s *Store) ClaimOrdered(ctx context.Context, b dbx.Beginner, groupID int32, token int64, ttl time.Duration, limit, pass int, out []Claimed) ([]Claimed, time.Time, error) {
	floor := NoParkFloor
	return s.db.claimOrdered(ctx, b, groupID, token, ttl, limit, pass, &floor, out)
}

// ClaimOrderedFrom is ClaimOrdered reading the group's parked messages from *floor, a token
// at or below that of every parked row of the group, and leaving in *floor such a token for
// the next claim (NoParkFloor where the database keeps none: SQLite). On PostgreSQL the
// parked rows written and handed out since the last vacuum leave their index entries below
// the group's live parked rows; a claim that starts at its floor reads past them. Parked
// tokens only grow (the groups row keeps the highest one given), so a floor that any claim
// of the group gave back stays at or below every parked row written after it.
func (s *Store) ClaimOrderedFrom(ctx context.Context, b dbx.Beginner, groupID int32, token int64, ttl time.Duration, limit, pass int, floor *int64, out []Claimed) ([]Claimed, time.Time, error) {
	return s.db.claimOrdered(ctx, b, groupID, token, ttl, limit, pass, floor, out)
}

// NoParkFloor is the floor of a claim that reads every parked row of its group (see
// ClaimOrderedFrom).
const NoParkFloor int64 = math.MinInt64

// Fenced is a claim identified by its offset and the token it was claimed under.
type Fenced struct {
	Offset int64
	Token  int64
	After  int64 // its Claimed.After, read by AckHandingOver only
}

// Fence returns the claims cs as claimed under token, for the statements that settle or give
// them back.
func Fence(cs []Claimed, token int64) []Fenced {
	fs := make([]Fenced, len(cs))
	for i, c := range cs {
		fs[i] = Fenced{Offset: c.Offset, Token: token, After: c.After}
	}
	return fs
}

// Ack deletes the claims whose token still matches and returns the offsets it deleted; the
// others were stale (L3).
func (s *Store) Ack(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced) (map[int64]bool, error) {
	return s.db.settle(ctx, q, settleAck, groupID, fs, 0)
}

// AckHandingOver is Ack for a group ordered by key (see ClaimOrdered) that also claims, in
// the same statement, under token and with a lease of ttl, the message each settled key lets
// go next: the key's first parked message, unless it is delayed. It returns them appended to
// out[:0], claimed at attempt 1, in no particular order (they are of distinct keys). A key
// freed without a message handed over (SQLite's acks hand none over, a delayed message) is
// taken by the group's next ordered claim.
func (s *Store) AckHandingOver(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, token int64, ttl time.Duration, out []Claimed) (map[int64]bool, []Claimed, error) {
	return s.db.ackHandingOver(ctx, q, groupID, fs, token, ttl, out)
}

// Nack makes the claims visible again after backoff; the attempt count stays.
func (s *Store) Nack(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, backoff time.Duration) (map[int64]bool, error) {
	return s.db.settle(ctx, q, settleNack, groupID, fs, backoff)
}

// Release makes claims that never reached a handler visible again at once.
func (s *Store) Release(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced) (map[int64]bool, error) {
	return s.db.settle(ctx, q, settleRelease, groupID, fs, 0)
}

// Extend moves the lease deadline of the claims to now()+ttl and returns the offsets it
// extended; a claim missing from the result has lost its lease (L4).
func (s *Store) Extend(ctx context.Context, q dbx.Querier, groupID int32, fs []Fenced, ttl time.Duration) (map[int64]bool, error) {
	return s.db.settle(ctx, q, settleExtend, groupID, fs, ttl)
}

// HeldBack counts (up to 1000) messages after the group's position that are committed or in
// progress but not yet visible to claims: on PostgreSQL, delivery waits for the oldest running
// transaction of the cluster to end (M2); where offsets commit in order, it is 0.
func (s *Store) HeldBack(ctx context.Context, q dbx.Querier, groupID int32) (int, error) {
	return s.db.heldBack(ctx, q, groupID)
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

// rowsPerInsert is the most rows of one INSERT on the store's database: maxRowsPerInsert, or
// fewer when their parameters (3 a row, 4 when the statement carries deliver_at) would pass
// the database's limit. On SQLite, a statement of delayed rows takes 8191.
func (s *Store) rowsPerInsert(delayed bool) int {
	limit := s.T.Dialect().MaxParams
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

// InsertSQL builds the multi-row INSERT for n rows. With channel, where the database has
// NOTIFY, the same statement also notifies channel with the messages table's name as payload
// (delivered when the transaction commits).
func (s *Store) InsertSQL(n int, channel string) string { return s.db.insertSQL(n, channel, false) }

// repeatTuples is prefix followed by n copies of tuple, comma-separated: a multi-row INSERT.
func repeatTuples(prefix, tuple string, n int) string {
	var b strings.Builder
	b.Grow(len(prefix) + n*(len(tuple)+1))
	b.WriteString(prefix)
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(tuple)
	}
	return b.String()
}

// inChunks runs fn on offs in chunks of up to size, each given as a list of ? placeholders and
// its arguments, and returns the sum of what the runs counted.
func inChunks(offs []int64, size int, fn func(in string, args []any) (int64, error)) (int64, error) {
	var total int64
	for len(offs) > 0 {
		n := min(len(offs), size)
		args := make([]any, n)
		for i, o := range offs[:n] {
			args[i] = o
		}
		d, err := fn(placeholders(n), args)
		total += d
		if err != nil {
			return total, err
		}
		offs = offs[n:]
	}
	return total, nil
}

// quoteLiteral quotes s as an SQL string literal (s holds no backslash: it is a channel or a
// table name built from validated parts).
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// Insert writes rows in statements of at most rowsPerInsert rows each (no statement passes
// the database's limit of bind parameters), the last of which also notifies channel when it
// is not "" and the database has NOTIFY. Callers that need all-or-none for more rows than one
// statement holds (OneStatement) run it inside a transaction.
func (s *Store) Insert(ctx context.Context, q dbx.Querier, rows []Row, channel string) error {
	return s.db.appending(ctx, q, func(q dbx.Querier) error { return s.insert(ctx, q, rows, channel) })
}

func (s *Store) insert(ctx context.Context, q dbx.Querier, rows []Row, channel string) error {
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
				var at any // NULL: not delayed
				if !r.DeliverAt.IsZero() {
					at = s.db.deliverAt(r.DeliverAt)
				}
				args = append(args, at)
			}
		}
		ch := ""
		if n == len(rows) {
			ch = channel
		}
		if _, err := q.Exec(ctx, s.db.insertSQL(n, ch, delayed), args...); err != nil {
			return err
		}
		rows = rows[n:]
	}
	return nil
}

// MaxRowsPerStatement says how many rows Insert writes in one statement at most (fewer on
// SQLite when a row is delayed: see OneStatement).
func MaxRowsPerStatement() int { return maxRowsPerInsert }

// CopyMinRows is the number of rows from which Copy writes faster than Insert
// (BenchmarkInsertVsCopy; BENCHMARKS.md): below it, the multi-row INSERT is as fast or faster,
// and it carries the NOTIFY in the same statement.
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
	if d := s.T.Dialect(); !d.Copy {
		return fmt.Errorf("offsets: %s has no COPY", d.Name)
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

// Notify sends a NOTIFY of the messages table on channel, as Insert's statement does; it does
// nothing where the database has no NOTIFY.
func (s *Store) Notify(ctx context.Context, q dbx.Querier, channel string) error {
	return s.db.notify(ctx, q, channel, s.T.Messages)
}

// AddPartitions makes sure the messages table can take the next n rows: on PostgreSQL, that
// its partitions reach past them (and two partitions further); elsewhere it does nothing.
func (s *Store) AddPartitions(ctx context.Context, q dbx.Querier, n int) error {
	return s.db.addPartitions(ctx, q, n)
}

// NoPartition reports whether err is a write refused because no partition of the messages
// table takes its row: AddPartitions, then writing again, succeeds.
func (s *Store) NoPartition(err error) bool { return s.db.noPartition(err) }

// Maintain runs one pass of retention on c, which must be one connection, not in a
// transaction (c may run DETACH PARTITION ... CONCURRENTLY). On PostgreSQL it adds
// partitions ahead of the sequence, moves each group's floor past the partitions it has
// passed, and, with opts.Drop, detaches and drops the partitions that every group has passed,
// no claim holds and whose messages were all written more than opts.OlderThan ago. On SQLite,
// with opts.Drop, it deletes such messages one by one. What a pass learns is kept for the next
// pass of the Store; passes of one Store run one at a time.
func (s *Store) Maintain(ctx context.Context, c dbx.Querier, opts MaintainOptions) (MaintainResult, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.db.maintain(ctx, &s.parts, c, opts)
}
