package offsets_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// mysqlStore creates a topic's tables on the MySQL test database, writes rows, and returns
// the store, the pool and the id of group "g", at the oldest message. The tables are dropped
// when t ends.
func mysqlStore(t *testing.T, ctx context.Context, rows []offsets.Row) (*offsets.Store, *dbx.MySQLPool, int32) {
	t.Helper()
	pool := dbx.NewMySQLPool(testdb.MySQL(t))
	tables := offsets.NewTables("", "sqlbroker_", testdb.Topic(t, "")).On(dbx.MySQL)
	if err := tables.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+tables.Messages+", "+tables.Groups+", "+tables.Claims)
	})
	store := offsets.NewStore(tables, false)
	if len(rows) > 0 {
		if err := store.Insert(ctx, pool, rows, ""); err != nil {
			t.Fatal(err)
		}
	}
	gid, err := store.EnsureGroup(ctx, pool, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	return store, pool, gid
}

func plainRows(n int) []offsets.Row {
	rows := make([]offsets.Row, n)
	for i := range rows {
		rows[i] = offsets.Row{UUID: fmt.Sprint(i + 1), Payload: []byte{byte(i)}, Metadata: `{"i":"` + fmt.Sprint(i+1) + `"}`}
	}
	return rows
}

func offsetsOf(cs []offsets.Claimed) []int64 {
	var out []int64
	for _, c := range cs {
		out = append(out, c.Offset)
	}
	return out
}

func count(t *testing.T, ctx context.Context, q dbx.Querier, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := dbx.QueryRow(ctx, q, sql, args, &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// On MySQL a claim writes one claims row for all the messages it takes, and the settlements
// keep the rows fenced: an ack under a stale token is refused, a nack makes its message due
// again after the backoff with its attempt count kept, a release at once with the attempt
// taken back, an extension moves the lease of its row; a message taken again gets a new
// token, which the former holder's settlements no longer match.
func TestMySQL_claimsAndSettlements(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store, pool, gid := mysqlStore(t, ctx, plainRows(5))

	cs, err := store.Claim(ctx, pool, gid, 7, time.Minute, 4, offsets.DueGivenBack, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := offsetsOf(cs); !slices.Equal(got, []int64{1, 2, 3, 4}) || cs[0].Attempts != 1 || cs[0].UUID != "1" || string(cs[2].Payload) != "\x02" || cs[3].Metadata != `{"i":"4"}` {
		t.Fatalf("first claim: %+v", cs)
	}
	if n := count(t, ctx, pool, "SELECT count(*) FROM "+store.T.Claims); n != 1 {
		t.Fatalf("claims rows after a claim of 4: %d, want 1", n)
	}

	// A stale token is refused; the right one acks.
	done, err := store.Ack(ctx, pool, gid, []offsets.Fenced{{Offset: 1, Token: 8}, {Offset: 2, Token: 7}})
	if err != nil || !maps(done, 2) {
		t.Fatalf("ack: %v, %v", done, err)
	}
	if done, err := store.Nack(ctx, pool, gid, []offsets.Fenced{{Offset: 3, Token: 7}}, time.Hour); err != nil || !maps(done, 3) {
		t.Fatalf("nack: %v, %v", done, err)
	}
	if done, err := store.Release(ctx, pool, gid, []offsets.Fenced{{Offset: 4, Token: 7}}); err != nil || !maps(done, 4) {
		t.Fatalf("release: %v, %v", done, err)
	}
	if done, err := store.Extend(ctx, pool, gid, []offsets.Fenced{{Offset: 1, Token: 7}, {Offset: 4, Token: 7}}, time.Hour); err != nil || !maps(done, 1) {
		t.Fatalf("extend: %v, %v (4 was released)", done, err)
	}

	// The released message comes back at once at attempt 1, before the new one; the nacked
	// one waits for its backoff.
	cs, err = store.Claim(ctx, pool, gid, 9, time.Minute, 10, offsets.DueGivenBack, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := offsetsOf(cs); !slices.Equal(got, []int64{4, 5}) || !cs[0].Again || cs[0].Attempts != 1 || cs[1].Again || cs[1].Attempts != 1 {
		t.Fatalf("second claim: %+v", cs)
	}
	// The nacked message, made due now by hand, comes back at attempt 2 (nacked at 1, taken
	// again).
	if _, err := pool.Exec(ctx, "UPDATE "+store.T.Claims+" SET `visible_at` = 0 WHERE `token` < 0"); err != nil {
		t.Fatal(err)
	}
	cs, err = store.Claim(ctx, pool, gid, 10, time.Minute, 10, offsets.DueGivenBack, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := offsetsOf(cs); !slices.Equal(got, []int64{3}) || cs[0].Attempts != 2 {
		t.Fatalf("third claim: %+v", cs)
	}
	// A lost lease is taken back by DueAll only, under a new token: the old one is refused.
	if _, err := pool.Exec(ctx, "UPDATE "+store.T.Claims+" SET `visible_at` = 0 WHERE `token` = 9"); err != nil {
		t.Fatal(err)
	}
	if cs, err := store.Claim(ctx, pool, gid, 11, time.Minute, 10, offsets.DueGivenBack, nil); err != nil || len(cs) != 0 {
		t.Fatalf("DueGivenBack took a lost lease: %+v, %v", cs, err)
	}
	cs, err = store.Claim(ctx, pool, gid, 11, time.Minute, 10, offsets.DueAll, nil)
	if err != nil || !slices.Equal(offsetsOf(cs), []int64{4, 5}) || cs[0].Attempts != 2 {
		t.Fatalf("DueAll: %+v, %v", cs, err)
	}
	if done, err := store.Ack(ctx, pool, gid, []offsets.Fenced{{Offset: 4, Token: 9}, {Offset: 5, Token: 9}}); err != nil || len(done) != 0 {
		t.Fatalf("ack under the lost token: %v, %v", done, err)
	}
	done, err = store.Ack(ctx, pool, gid, []offsets.Fenced{{Offset: 1, Token: 7}, {Offset: 3, Token: 10}, {Offset: 4, Token: 11}, {Offset: 5, Token: 11}})
	if err != nil || len(done) != 4 {
		t.Fatalf("final acks: %v, %v", done, err)
	}
	if n := count(t, ctx, pool, "SELECT count(*) FROM "+store.T.Claims); n != 0 {
		t.Fatalf("claims rows left after every ack: %d", n)
	}
}

func maps(done map[int64]bool, want ...int64) bool {
	if len(done) != len(want) {
		return false
	}
	for _, o := range want {
		if !done[o] {
			return false
		}
	}
	return true
}

// An ack of one token's offsets that are exactly one of its rows deletes the row in one
// statement; one that takes only part of a row, or a stale one, goes the locking way and
// leaves the rest of the row held.
func TestMySQL_ackWholeAndPartRows(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store, pool, gid := mysqlStore(t, ctx, plainRows(4))
	rows := func() int64 { return count(t, ctx, pool, "SELECT count(*) FROM "+store.T.Claims) }
	cs, err := store.Claim(ctx, pool, gid, 5, time.Minute, 2, offsets.DueNone, nil)
	if err != nil || len(cs) != 2 {
		t.Fatalf("claim: %+v, %v", cs, err)
	}
	if done, err := store.Ack(ctx, pool, gid, offsets.Fence(cs, 5)); err != nil || !maps(done, 1, 2) || rows() != 0 {
		t.Fatalf("whole-row ack: %v, %v, %d rows left", done, err, rows())
	}
	cs, err = store.Claim(ctx, pool, gid, 6, time.Minute, 2, offsets.DueNone, nil)
	if err != nil || len(cs) != 2 {
		t.Fatalf("claim: %+v, %v", cs, err)
	}
	if done, err := store.Ack(ctx, pool, gid, offsets.Fence(cs, 5)); err != nil || len(done) != 0 || rows() != 1 {
		t.Fatalf("stale whole-row ack: %v, %v, %d rows", done, err, rows())
	}
	if done, err := store.Ack(ctx, pool, gid, offsets.Fence(cs[:1], 6)); err != nil || !maps(done, 3) || rows() != 1 {
		t.Fatalf("part-row ack: %v, %v, %d rows", done, err, rows())
	}
	if done, err := store.Ack(ctx, pool, gid, offsets.Fence(cs[1:], 6)); err != nil || !maps(done, 4) || rows() != 0 {
		t.Fatalf("the rest of the row: %v, %v, %d rows", done, err, rows())
	}
}

// A claim passes delayed messages (their rows come due at their time, with no holder) and
// hands them out once due, at attempt 1.
func TestMySQL_delayed(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows := plainRows(3)
	rows[0].DeliverAt = time.Now().Add(700 * time.Millisecond)
	store, pool, gid := mysqlStore(t, ctx, rows)
	cs, err := store.ClaimPassing(ctx, pool, gid, 1, time.Minute, 2, 5, offsets.DueGivenBack, nil)
	if err != nil {
		t.Fatal(err)
	}
	kept, delayed := offsets.TakeDelayed(cs)
	if !slices.Equal(offsetsOf(kept), []int64{2, 3}) || len(delayed) != 1 {
		t.Fatalf("claim: %+v", cs)
	}
	var got []offsets.Claimed
	testdb.Eventually(t, 10*time.Second, "the delayed message handed out", func() bool {
		cs, err := store.Claim(ctx, pool, gid, 2, time.Minute, 5, offsets.DueGivenBack, nil)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, cs...)
		return len(got) > 0
	})
	if time.Now().Before(rows[0].DeliverAt) || !slices.Equal(offsetsOf(got), []int64{1}) || got[0].Attempts != 1 || got[0].UUID != "1" {
		t.Fatalf("delayed message: %+v at %v, due %v", got, time.Now(), rows[0].DeliverAt)
	}
}

// Claimers of one group racing on one pool hand out every message once.
func TestMySQL_racingClaimers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const n = 2000
	store, pool, gid := mysqlStore(t, ctx, plainRows(n))
	var mu sync.Mutex
	seen := map[int64]int{}
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for token := int64(w + 1); ; token += 8 {
				cs, err := store.Claim(ctx, pool, gid, token, time.Minute, 37, offsets.DueGivenBack, nil)
				if err != nil {
					t.Error(err)
					return
				}
				if len(cs) == 0 {
					return
				}
				if _, err := store.Ack(ctx, pool, gid, offsets.Fence(cs, token)); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				for _, c := range cs {
					seen[c.Offset]++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if len(seen) != n {
		t.Fatalf("handed out %d distinct messages of %d", len(seen), n)
	}
	for o, k := range seen {
		if k != 1 {
			t.Fatalf("offset %d handed out %d times", o, k)
		}
	}
}

// A transaction that publishes holds the topic's head row until it ends: another publisher
// waits for it, so offsets commit in order and a claim never passes a message still to be
// committed below one it sees.
func TestMySQL_publishersTakeTurns(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store, pool, gid := mysqlStore(t, ctx, nil)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Insert(ctx, tx, plainRows(1), ""); err != nil {
		t.Fatal(err)
	}
	second := make(chan error, 1)
	go func() { second <- store.Insert(ctx, pool, plainRows(1), "") }()
	select {
	case err := <-second:
		t.Fatalf("the second publisher did not wait for the first's transaction: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	if cs, err := store.Claim(ctx, pool, gid, 1, time.Minute, 10, offsets.DueNone, nil); err != nil || len(cs) != 0 {
		t.Fatalf("claim while the first publisher's transaction runs: %+v, %v", cs, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatal(err)
	}
	cs, err := store.Claim(ctx, pool, gid, 1, time.Minute, 10, offsets.DueNone, nil)
	if err != nil || !slices.Equal(offsetsOf(cs), []int64{1, 2}) {
		t.Fatalf("claim after both: %+v, %v", cs, err)
	}
}

// A dead letter moves the claimed message to another topic, with where it came from in its
// metadata; retention then deletes the settled messages and keeps those a claim holds.
func TestMySQL_deadLetterAndRetention(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	store, pool, gid := mysqlStore(t, ctx, plainRows(4))
	dlq, _, _ := mysqlStore(t, ctx, nil)
	cs, err := store.Claim(ctx, pool, gid, 3, time.Minute, 4, offsets.DueNone, nil)
	if err != nil || len(cs) != 4 {
		t.Fatalf("claim: %+v, %v", cs, err)
	}
	done, err := store.DeadLetter(ctx, pool, gid, "g", []offsets.Fenced{{Offset: 2, Token: 3}, {Offset: 3, Token: 4}}, dlq, [2]string{"i", "x"})
	if err != nil || !maps(done, 2) {
		t.Fatalf("dead letter: %v, %v", done, err)
	}
	moved, err := dlq.T.ReadMessages(ctx, pool, 0, 10)
	if err != nil || len(moved) != 1 {
		t.Fatalf("dead-letter topic: %+v, %v", moved, err)
	}
	want := fmt.Sprintf(`{"%s": "%s", "%s": "g", "%s": "1", "%s": "2"}`, offsets.MetaDeadLetterTopic, store.T.Topic, offsets.MetaDeadLetterGroup, offsets.MetaDeadLetterAttempts, offsets.MetaDeadLetterOffset)
	if moved[0].UUID != "2" || moved[0].Metadata != want {
		t.Fatalf("moved: %+v\nwant metadata %s", moved[0], want)
	}
	if _, err := store.Ack(ctx, pool, gid, []offsets.Fenced{{Offset: 1, Token: 3}, {Offset: 4, Token: 3}}); err != nil {
		t.Fatal(err)
	}
	// Offset 3 is still claimed: 1 and 2 go, 3 and 4 stay.
	res, err := store.Maintain(ctx, pool, offsets.MaintainOptions{Drop: true})
	if err != nil || res.Messages != 2 {
		t.Fatalf("retention: %+v, %v", res, err)
	}
	left, err := store.T.ReadMessages(ctx, pool, 0, 10)
	if err != nil || len(left) != 2 || left[0].Offset != 3 {
		t.Fatalf("left: %+v, %v", left, err)
	}
	// The next pass starts where this one stopped; a message younger than the retention
	// stays, and so do those after it.
	if _, err := store.Ack(ctx, pool, gid, []offsets.Fenced{{Offset: 3, Token: 3}}); err != nil {
		t.Fatal(err)
	}
	if res, err := store.Maintain(ctx, pool, offsets.MaintainOptions{Drop: true, OlderThan: time.Hour}); err != nil || res.Messages != 0 {
		t.Fatalf("retention of an hour: %+v, %v", res, err)
	}
	if res, err := store.Maintain(ctx, pool, offsets.MaintainOptions{Drop: true}); err != nil || res.Messages != 2 {
		t.Fatalf("second pass: %+v, %v", res, err)
	}
	if n, err := store.T.CountMessages(ctx, pool); err != nil || n != 0 {
		t.Fatalf("left after the second pass: %d, %v", n, err)
	}
}

// A key repository's key is taken once until its window passes.
func TestMySQL_keys(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := dbx.NewMySQLPool(testdb.MySQL(t))
	k := offsets.NewKeyTable(dbx.MySQL, "", "sqlbroker_keys_"+testdb.Topic(t, ""))
	if err := k.Check(ctx, pool); !errors.Is(err, offsets.ErrNoKeyTable) {
		t.Fatalf("check before create: %v", err)
	}
	if err := k.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+k.Table) })
	if ok, err := k.Claim(ctx, pool, []byte("a"), 200*time.Millisecond); err != nil || !ok {
		t.Fatalf("first claim: %v, %v", ok, err)
	}
	if ok, err := k.Claim(ctx, pool, []byte("a"), time.Hour); err != nil || ok {
		t.Fatalf("second claim: %v, %v", ok, err)
	}
	time.Sleep(250 * time.Millisecond) // the window is the condition: no event marks its end
	if ok, err := k.Claim(ctx, pool, []byte("a"), time.Millisecond); err != nil || !ok {
		t.Fatalf("claim after the window: %v, %v", ok, err)
	}
	time.Sleep(5 * time.Millisecond)
	if n, err := k.Prune(ctx, pool, 10); err != nil || n != 1 {
		t.Fatalf("prune: %d, %v", n, err)
	}
}
