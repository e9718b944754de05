package offsets_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// partitionRig is a topic whose messages table has small partitions, and the statements and
// connection of a maintenance pass.
type partitionRig struct {
	t      *testing.T
	ctx    context.Context
	tables offsets.Tables
	db     *dbx.PgxPool
	store  *offsets.Store
	conn   dbx.Conn
}

// newPartitionRig creates a topic with k partitions of size offsets.
func newPartitionRig(t *testing.T, size, k int) *partitionRig {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	tables, _, db := createTables(t, ctx)
	testdb.SmallPartitions(t, tables, size, k)
	conn, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	return &partitionRig{t: t, ctx: ctx, tables: tables, db: db, store: offsets.NewStore(tables, true), conn: conn}
}

func (r *partitionRig) insert(rows ...offsets.Row) {
	r.t.Helper()
	for i := range rows {
		if rows[i].UUID == "" {
			rows[i].UUID = fmt.Sprint(i)
		}
		rows[i].Metadata = "{}"
	}
	if err := r.store.Insert(r.ctx, r.db, rows, ""); err != nil {
		r.t.Fatal(err)
	}
}

func (r *partitionRig) group(name string) int32 {
	r.t.Helper()
	id, err := r.store.EnsureGroup(r.ctx, r.db, name, false)
	if err != nil {
		r.t.Fatal(err)
	}
	return id
}

// claim claims n messages (new ones, or due again as due says) for the group under token.
func (r *partitionRig) claim(gid int32, token int64, n int, due offsets.Due) []offsets.Fenced {
	r.t.Helper()
	var got []offsets.Claimed
	testdb.Eventually(r.t, 30*time.Second, "messages to claim", func() bool {
		cs, err := r.store.Claim(r.ctx, r.db, gid, token, time.Hour, n-len(got), due, nil)
		if err != nil {
			r.t.Fatal(err)
		}
		cs, _ = offsets.TakeDelayed(cs)
		got = append(got, cs...)
		return len(got) >= n
	})
	return offsets.Fence(got, token)
}

func (r *partitionRig) ack(gid int32, fs []offsets.Fenced) {
	r.t.Helper()
	if done, err := r.store.Ack(r.ctx, r.db, gid, fs); err != nil || len(done) != len(fs) {
		r.t.Fatalf("ack: %d of %d applied, %v", len(done), len(fs), err)
	}
}

// pass runs maintenance passes dropping what is older than nothing, until one drops nothing
// more (the first pass of a partition learns whether it is complete, the next one knows).
func (r *partitionRig) pass() {
	r.t.Helper()
	for range 3 {
		if _, err := r.store.Maintain(r.ctx, r.conn, offsets.MaintainOptions{Drop: true, Wait: 2 * time.Second}); err != nil {
			r.t.Fatal(err)
		}
	}
}

// partitions lists the lower bounds of the partitions below to.
func (r *partitionRig) partitions(to int64) []int64 {
	r.t.Helper()
	rows, err := r.db.Query(r.ctx, `SELECT substring(pg_get_expr(c.relpartbound, c.oid) FROM 'FROM \(''(\d+)''\)')::bigint
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass ORDER BY 1`, r.tables.Messages)
	if err != nil {
		r.t.Fatal(err)
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var lo int64
		if err := rows.Scan(&lo); err != nil {
			r.t.Fatal(err)
		}
		if lo < to {
			out = append(out, lo)
		}
	}
	return out
}

func (r *partitionRig) expect(what string, want ...int64) {
	r.t.Helper()
	if got := r.partitions(9); !slices.Equal(got, want) {
		r.t.Fatalf("%s: partitions from %v kept, want %v", what, got, want)
	}
}

// A partition is dropped only once every group has passed every message in it and no claim
// holds any of its offsets: a slow group holds it, so does a nacked claim waiting for its
// backoff and a delayed message waiting for its time; each lets go when it moves on.
// Partitions of two offsets: [1,3) [3,5) [5,7) [7,9).
func TestMaintain_dropsOnlyPassedUnclaimedPartitions(t *testing.T) {
	r := newPartitionRig(t, 2, 4)
	fast, slow := r.group("fast"), r.group("slow")
	r.insert(offsets.Row{}, offsets.Row{}, offsets.Row{}, offsets.Row{},
		offsets.Row{DeliverAt: time.Now().Add(time.Hour)}, // offset 5
		offsets.Row{}, offsets.Row{}, offsets.Row{})
	r.pass()
	r.expect("no group passed anything", 1, 3, 5, 7)

	// fast: everything passed; 3 nacked, 5 delayed (a claim row due at its time).
	fs := r.claim(fast, 1<<40, 7, offsets.DueNone) // the seven not delayed, passing the delayed one
	var nacked []offsets.Fenced
	for _, f := range fs {
		if f.Offset == 3 {
			nacked = append(nacked, f)
		}
	}
	if _, err := r.store.Nack(r.ctx, r.db, fast, nacked, time.Hour); err != nil {
		t.Fatal(err)
	}
	r.ack(fast, slices.DeleteFunc(fs, func(f offsets.Fenced) bool { return f.Offset == 3 }))
	// slow: the first two messages only.
	r.ack(slow, r.claim(slow, 1<<41, 2, offsets.DueNone))
	r.pass()
	r.expect("slow at 2, 3 nacked, 5 delayed", 3, 5, 7)

	r.ack(slow, r.claim(slow, 1<<42, 5, offsets.DueNone)) // 3, 4, 6, 7, 8; 5 delayed for it too
	r.pass()
	r.expect("slow has passed every message", 3, 5)

	// The nack's backoff and the delay pass: each group takes what is due and acks it.
	if _, err := r.db.Exec(r.ctx, `UPDATE `+r.tables.Claims+` SET "visible_at" = now()`); err != nil {
		t.Fatal(err)
	}
	r.ack(fast, r.claim(fast, 1<<43, 2, offsets.DueAll))
	r.pass()
	r.expect("slow's delayed message waits", 5)
	r.ack(slow, r.claim(slow, 1<<44, 1, offsets.DueAll))
	r.pass()
	r.expect("every claim settled")
	if n := testdb.Count(t, r.tables.Messages); n != 0 {
		t.Errorf("%d messages left", n)
	}
}

// A transaction that wrote a message into a partition and has not committed holds the
// partition, though every message visible in it has been passed by every group: the
// partition is not known complete until that transaction ends. Once it commits, its message
// is delivered, then the partition dropped.
func TestMaintain_openWriterHoldsItsPartition(t *testing.T) {
	r := newPartitionRig(t, 2, 4)
	g := r.group("g")
	r.insert(offsets.Row{})
	tx, err := r.db.Begin(r.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if err := r.store.Insert(r.ctx, tx, []offsets.Row{{UUID: "late", Metadata: "{}"}}, ""); err != nil {
		t.Fatal(err)
	}
	r.insert(offsets.Row{}, offsets.Row{}) // offsets 3 and 4, held back behind the open one
	r.ack(g, r.claim(g, 1<<40, 1, offsets.DueNone))
	if _, err := r.store.Maintain(r.ctx, r.conn, offsets.MaintainOptions{Drop: true, Wait: 500 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	r.pass()
	r.expect("the writer of offset 2 still runs", 1, 3, 5, 7)

	if err := tx.Commit(r.ctx); err != nil {
		t.Fatal(err)
	}
	fs := r.claim(g, 1<<41, 3, offsets.DueNone)
	if fs[0].Offset != 2 {
		t.Fatalf("claimed %v, want offset 2 first", fs)
	}
	r.ack(g, fs)
	r.pass()
	r.expect("every message settled", 5, 7)
}

// A pass moves each group's floor to the first partition it may still need, claims go on
// from there, and ResetGroup puts the floor back, so that the group reads the old partitions
// again.
func TestMaintain_floorsFollowTheGroups(t *testing.T) {
	r := newPartitionRig(t, 2, 4)
	ahead, behind := r.group("ahead"), r.group("behind")
	r.insert(offsets.Row{}, offsets.Row{}, offsets.Row{}, offsets.Row{}, offsets.Row{})
	r.ack(ahead, r.claim(ahead, 1<<40, 4, offsets.DueNone))
	if _, err := r.store.Maintain(r.ctx, r.conn, offsets.MaintainOptions{Wait: 10 * time.Second}); err != nil {
		t.Fatal(err)
	}
	floor := func(group string) int64 {
		return testdb.Int(t, `SELECT "floor_offset" FROM `+r.tables.Groups+` WHERE "consumer_group" = $1`, group)
	}
	if f := floor("ahead"); f != 5 {
		t.Errorf("floor of ahead %d, want 5", f)
	}
	if f := floor("behind"); f != 1 {
		t.Errorf("floor of behind %d, want 1", f)
	}
	if fs := r.claim(ahead, 1<<41, 1, offsets.DueNone); fs[0].Offset != 5 {
		t.Errorf("ahead claimed %v after its floor, want offset 5", fs)
	}
	if _, err := r.tables.ResetGroup(r.ctx, r.db, "ahead", 2, time.Time{}, false); err != nil {
		t.Fatal(err)
	}
	if f := floor("ahead"); f != 0 {
		t.Errorf("floor of ahead after the reset %d, want 0", f)
	}
	if fs := r.claim(ahead, 1<<42, 1, offsets.DueNone); fs[0].Offset != 2 {
		t.Errorf("ahead claimed %v after the reset to 2", fs)
	}
	_ = behind
}

// A detach that a long transaction outlasted stays pending until that transaction ends, and
// the passes meanwhile make no claim wait: completing the detach (FINALIZE) asks for an ACCESS
// EXCLUSIVE lock on the partition, and every claim of the topic would queue behind that
// request for as long as it waited. A REPEATABLE READ reader that read the table holds the
// partition here, as a report or a backup would.
func TestMaintain_pendingDetachHoldsNoClaimBack(t *testing.T) {
	r := newPartitionRig(t, 2, 4)
	g := r.group("g")
	r.insert(offsets.Row{}, offsets.Row{}, offsets.Row{}, offsets.Row{}, offsets.Row{}, offsets.Row{})
	r.ack(g, r.claim(g, 1<<40, 2, offsets.DueNone)) // [1,3) passed

	reader, err := r.db.Begin(r.ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(context.Background())
	if _, err := reader.Exec(r.ctx, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"); err != nil {
		t.Fatal(err)
	}
	var one int
	if err := dbx.QueryRow(r.ctx, reader, "SELECT 1 FROM "+r.tables.Messages+" LIMIT 1", nil, &one); err != nil {
		t.Fatal(err)
	}

	maintain := func() offsets.MaintainResult {
		t.Helper()
		res, err := r.store.Maintain(r.ctx, r.conn, offsets.MaintainOptions{Drop: true, Wait: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	// The first passes learn that [1,3) is complete, then begin its detach, which waits for
	// the reader and is left pending.
	testdb.Eventually(t, 30*time.Second, "a detach left pending by the reader", func() bool {
		return maintain().Waiting
	})

	// Passes while the reader holds the partition, and claims beside them; meanwhile no
	// session may wait for an ACCESS EXCLUSIVE lock on a partition of the table: every claim
	// would wait behind that request.
	stop := make(chan struct{})
	passes := make(chan error, 1)
	go func() {
		defer close(passes)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := r.store.Maintain(r.ctx, r.conn, offsets.MaintainOptions{Drop: true, Wait: 2 * time.Second}); err != nil {
				passes <- err
				return
			}
		}
	}()
	claims := make(chan error, 1)
	go func() {
		defer close(claims)
		for i := range 10 {
			token := int64(1<<41 + i)
			cs, err := r.store.Claim(r.ctx, r.db, g, token, time.Hour, 1, offsets.DueNone, nil)
			if err != nil {
				claims <- err
				return
			}
			if len(cs) == 1 {
				if _, err := r.store.Ack(r.ctx, r.db, g, offsets.Fence(cs, token)); err != nil {
					claims <- err
					return
				}
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	var waiting int
	var err2 error
	for end := time.Now().Add(3 * time.Second); waiting == 0 && err2 == nil && time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		err2 = dbx.QueryRow(r.ctx, r.db, `SELECT count(*)::int FROM pg_locks l
			WHERE NOT l.granted AND l.locktype = 'relation' AND l.mode = 'AccessExclusiveLock'
			  AND l.relation IN (SELECT i.inhrelid FROM pg_inherits i WHERE i.inhparent = $1::regclass)`, []any{r.tables.Messages}, &waiting)
	}
	close(stop)
	if err := <-passes; err != nil {
		t.Fatal(err)
	}
	if err := <-claims; err != nil {
		t.Fatal(err)
	}
	if err2 != nil {
		t.Fatal(err2)
	}
	if waiting > 0 {
		t.Fatal("a session waits for an ACCESS EXCLUSIVE lock on a partition the reader holds: every claim of the topic waits behind it")
	}
	r.expect("the reader holds the pending partition", 1, 3, 5, 7)

	if err := reader.Rollback(r.ctx); err != nil {
		t.Fatal(err)
	}
	// Once it has ended, a pass completes the detach (one at a time: a short lock held
	// elsewhere, autovacuum's say, leaves it to the next).
	testdb.Eventually(t, 30*time.Second, "the pending detach completed once the reader ended", func() bool {
		maintain()
		got := r.partitions(9)
		return len(got) > 0 && got[0] != 1
	})
}
