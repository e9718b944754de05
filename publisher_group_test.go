package sqlbroker_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func drivers(t *testing.T) map[string]sqlbroker.DB {
	return map[string]sqlbroker.DB{"pgx": pgxDB(t), "libpq": sqlbroker.StdSQL(testdb.Std(t))}
}

func newMessages(n int, payload string) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(payload))
	}
	return msgs
}

// blockInserts holds a lock on topic's messages table that makes every INSERT or COPY into it
// wait, until the returned function is called.
func blockInserts(t *testing.T, topic string) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "LOCK TABLE "+tables(topic).Messages+" IN SHARE MODE")
	require.NoError(t, err)
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(ctx) }) }
	t.Cleanup(release)
	return release
}

// waitBlocked waits until n statements wait for the lock of blockInserts.
func waitBlocked(t *testing.T, topic string, n int) {
	t.Helper()
	testdb.Eventually(t, 10*time.Second, "a publish waiting on the table lock", func() bool {
		return queryInt(t, "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass", tables(topic).Messages) == n
	})
}

func waitQueued(t *testing.T, pub *sqlbroker.Publisher, topic string, n int) {
	t.Helper()
	testdb.Eventually(t, 10*time.Second, fmt.Sprintf("%d queued publishes", n), func() bool {
		return sqlbroker.QueuedCalls(pub, topic) == n
	})
}

// publishAsync publishes msgs from a goroutine; the channel gets its result.
func publishAsync(pub *sqlbroker.Publisher, topic string, msgs ...*message.Message) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- pub.Publish(topic, msgs...) }()
	return ch
}

func result(t *testing.T, ch <-chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(15 * time.Second):
		t.Fatal("Publish did not return")
		return nil
	}
}

// xids is the number of distinct writing transactions among the rows of msgs.
func xids(t *testing.T, topic string, msgs []*message.Message) int {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.UUID
	}
	return queryInt(t, "SELECT count(DISTINCT xid) FROM "+tables(topic).Messages+" WHERE uuid = ANY($1)", ids)
}

func countUUIDs(t *testing.T, topic string, msgs []*message.Message) int {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.UUID
	}
	return queryInt(t, "SELECT count(*) FROM "+tables(topic).Messages+" WHERE uuid = ANY($1)", ids)
}

// Many goroutines publishing at once: every message lands exactly once, the calls are grouped
// into fewer statements than calls, and each call's messages are in one statement together
// (one writing transaction, consecutive offsets, in the call's order), with both drivers.
func TestPublisher_group_concurrentCallsLandOnceAndWhole(t *testing.T) {
	t.Parallel()
	for name, db := range drivers(t) {
		t.Run(name, func(t *testing.T) {
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, db)
			publish(t, pub, topic, "creates the tables")
			const goroutines, calls = 24, 15
			var wg sync.WaitGroup
			errs := make(chan error, goroutines*calls)
			total := 0
			for g := range goroutines {
				for c := range calls {
					total += 1 + (g+c)%4
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					for c := range calls {
						msgs := newMessages(1+(g+c)%4, "x")
						for i, m := range msgs {
							m.Metadata.Set("call", fmt.Sprintf("%d/%d", g, c))
							m.Metadata.Set("i", fmt.Sprint(i))
						}
						errs <- pub.Publish(topic, msgs...)
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				require.NoError(t, err)
			}
			m := tables(topic).Messages
			assert.Equal(t, total+1, countMessages(t, topic))
			assert.Equal(t, total+1, queryInt(t, "SELECT count(DISTINCT uuid) FROM "+m), "a message landed twice")
			assert.Equal(t, goroutines*calls, queryInt(t, "SELECT count(DISTINCT metadata->>'call') FROM "+m+" WHERE metadata ? 'call'"))
			// Every call: one transaction, consecutive offsets, in the call's order.
			assert.Zero(t, queryInt(t, `SELECT count(*) FROM (
				SELECT metadata->>'call' FROM `+m+` WHERE metadata ? 'call' GROUP BY 1
				HAVING count(DISTINCT xid) <> 1 OR max("offset") - min("offset") + 1 <> count(*)
				    OR array_agg((metadata->>'i')::int ORDER BY "offset") <> array_agg((metadata->>'i')::int ORDER BY (metadata->>'i')::int)
			) bad`), "a call's messages were split or reordered")
			statements := queryInt(t, "SELECT count(DISTINCT xid) FROM "+m+" WHERE metadata ? 'call'")
			assert.Less(t, statements, goroutines*calls, "no call was grouped with another")
			t.Logf("%d calls in %d statements", goroutines*calls, statements)
		})
	}
}

// A call whose context is cancelled while it waits behind a running statement returns the
// context's error at once, not after that statement, and writes nothing; the running
// statement is not affected.
func TestPublisher_group_cancelledWhileQueuedWritesNothing(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "creates the tables")
	release := blockInserts(t, topic)
	running := newMessages(1, "running")
	runningErr := publishAsync(pub, topic, running...)
	waitBlocked(t, topic, 1)

	ctx, cancel := context.WithCancel(context.Background())
	queued := newMessages(3, "queued")
	queued[1].SetContext(ctx) // one message's context is enough
	queuedErr := publishAsync(pub, topic, queued...)
	waitQueued(t, pub, topic, 1)
	cancel()
	err := result(t, queuedErr) // the table is still locked: it did not wait for the statement
	require.ErrorIs(t, err, context.Canceled)
	assert.ErrorContains(t, err, "nothing was written")
	assert.Zero(t, sqlbroker.QueuedCalls(pub, topic))

	release()
	require.NoError(t, result(t, runningErr))
	assert.Equal(t, 1, countUUIDs(t, topic, running))
	assert.Zero(t, countUUIDs(t, topic, queued))
	assert.Equal(t, 2, countMessages(t, topic))
}

// A call whose context ends after its rows went into a running statement gets that
// statement's outcome: here the rows are committed and it returns nil.
func TestPublisher_group_cancelAfterSendReturnsOutcome(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "creates the tables")
	release := blockInserts(t, topic)
	ctx, cancel := context.WithCancel(context.Background())
	msgs := newMessages(2, "sent")
	msgs[0].SetContext(ctx)
	errCh := publishAsync(pub, topic, msgs...)
	waitBlocked(t, topic, 1) // its statement is running
	cancel()
	select {
	case err := <-errCh:
		t.Fatalf("Publish returned %v while its statement still ran", err)
	case <-time.After(200 * time.Millisecond):
	}
	release()
	require.NoError(t, result(t, errCh))
	assert.Equal(t, 2, countUUIDs(t, topic, msgs))
}

// A database error fails the calls of its statement, each with its topic, and no call queued
// behind that statement; when it is about the values of one call (a constraint), only that
// call fails: the others of its statement are written, each alone.
func TestPublisher_group_databaseErrorFailsItsStatementOnly(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{InitializeSchema: true, MaxGroupRows: 2}, nil)
	require.NoError(t, err)
	defer pub.Close()
	publish(t, pub, topic, "creates the tables")
	_, err = testdb.Pgx(t).Exec(context.Background(), "ALTER TABLE "+tables(topic).Messages+" ADD CHECK (payload <> 'bad'::bytea)")
	require.NoError(t, err)

	release := blockInserts(t, topic)
	first := publishAsync(pub, topic, newMessages(1, "first")...)
	waitBlocked(t, topic, 1)
	good := newMessages(1, "good")
	goodErr := publishAsync(pub, topic, good...) // shares the next statement with bad, then runs alone
	waitQueued(t, pub, topic, 1)
	badErr := publishAsync(pub, topic, newMessages(1, "bad")...)
	waitQueued(t, pub, topic, 2)
	later := newMessages(1, "later")
	laterErr := publishAsync(pub, topic, later...) // MaxGroupRows 2: the statement after
	waitQueued(t, pub, topic, 3)
	release()

	require.NoError(t, result(t, first))
	require.NoError(t, result(t, goodErr), "failed for the values of another call")
	err = result(t, badErr)
	require.Error(t, err)
	assert.ErrorContains(t, err, fmt.Sprintf("publish to %q", topic))
	assert.ErrorContains(t, err, "23514") // check_violation
	require.NoError(t, result(t, laterErr))
	assert.Equal(t, 1, countUUIDs(t, topic, good))
	assert.Equal(t, 1, countUUIDs(t, topic, later))
	assert.Equal(t, 4, countMessages(t, topic))
}

// Close while calls are queued: the calls accepted before Close are written (in one
// statement), Close waits for them, and a Publish after Close began returns ErrClosed and
// writes nothing (S8, P3).
func TestPublisher_group_closeWaitsForQueuedCalls(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	publish(t, pub, topic, "creates the tables")
	release := blockInserts(t, topic)
	running := publishAsync(pub, topic, newMessages(1, "running")...)
	waitBlocked(t, topic, 1)
	var queued []*message.Message
	var queuedErrs []<-chan error
	for i := range 5 {
		msgs := newMessages(2, "queued")
		queued = append(queued, msgs...)
		queuedErrs = append(queuedErrs, publishAsync(pub, topic, msgs...))
		waitQueued(t, pub, topic, i+1)
	}

	closed := make(chan error, 1)
	go func() { closed <- pub.Close() }()
	testdb.Eventually(t, 10*time.Second, "Close to begin", func() bool { return sqlbroker.PublisherClosed(pub) })
	after := newMessages(1, "after close")
	assert.ErrorIs(t, pub.Publish(topic, after...), sqlbroker.ErrClosed)
	select {
	case err := <-closed:
		t.Fatalf("Close returned %v while publishes were running", err)
	case <-time.After(200 * time.Millisecond):
	}

	release()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(15 * time.Second):
		t.Fatal("Close did not return")
	}
	// Close returned after every accepted call ended.
	require.NoError(t, <-running)
	for _, ch := range queuedErrs {
		select {
		case err := <-ch:
			require.NoError(t, err)
		default:
			t.Fatal("a queued Publish had not returned when Close did")
		}
	}
	assert.Equal(t, 10, countUUIDs(t, topic, queued))
	assert.Equal(t, 1, xids(t, topic, queued), "the queued calls went into one statement")
	assert.Zero(t, countUUIDs(t, topic, after))
	assert.ErrorIs(t, pub.Publish(topic, after...), sqlbroker.ErrClosed)
	assert.Equal(t, 12, countMessages(t, topic))
}

// A missing table fails every grouped call with MissingTableError, on both paths (INSERT and
// COPY).
func TestPublisher_group_missingTable(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	publish(t, newPublisher(t, pgxDB(t)), topic, "creates the tables")
	pub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	defer pub.Close()
	publish(t, pub, topic, "checks the tables")
	testdb.DropTopic(t, "", topic)

	var wg sync.WaitGroup
	errs := make(chan error, 9)
	for i := range 9 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n := 1
			if i == 0 {
				n = 600 // COPY
			}
			errs <- pub.Publish(topic, newMessages(n, "x")...)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		var missing *sqlbroker.MissingTableError
		require.True(t, errors.As(err, &missing), "%v", err)
		assert.Equal(t, tables(topic).Messages, missing.Table)
	}
}

// Grouping can be turned off, and its bounds are checked.
func TestPublisherConfig_group(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		cfg  sqlbroker.PublisherConfig
		want string
	}{
		{sqlbroker.PublisherConfig{MaxGroupRows: -1}, "MaxGroupRows (-1) must be between 1 and 10000"},
		{sqlbroker.PublisherConfig{MaxGroupRows: 10001}, "MaxGroupRows (10001) must be between 1 and 10000"},
		{sqlbroker.PublisherConfig{GroupTimeout: -time.Second}, "GroupTimeout (-1s) must not be negative"},
	} {
		_, err := sqlbroker.NewPublisher(pgxDB(t), c.cfg, nil)
		var cerr *sqlbroker.ConfigError
		require.True(t, errors.As(err, &cerr), "%v", err)
		assert.ErrorContains(t, err, c.want)
	}
	topic := testdb.Topic(t, "")
	pub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{InitializeSchema: true, DisableGroupInsert: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			assert.NoError(t, pub.Publish(topic, newMessages(2, "x")...))
		}()
	}
	wg.Wait()
	assert.Equal(t, 16, countMessages(t, topic))
	assert.Equal(t, 8, queryInt(t, "SELECT count(DISTINCT xid) FROM "+tables(topic).Messages), "without grouping, one statement a call")
}

// COPY (pgx, from offsets.CopyMinRows rows): a large call lands whole in one transaction, in
// order, on a pool and inside the caller's transaction.
func TestPublisher_copy_largeBatchLandsWhole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	msgs := newMessages(3000, "copy")
	msgs[7].Metadata.Set("k", "v")
	require.NoError(t, pub.Publish(topic, msgs...))
	assert.Equal(t, 3000, countUUIDs(t, topic, msgs))
	assert.Equal(t, 1, xids(t, topic, msgs))
	assert.Equal(t, 1, queryInt(t, `SELECT count(*) FROM `+tables(topic).Messages+` WHERE uuid = $1 AND metadata = '{"k":"v"}' AND payload = 'copy'::bytea`, msgs[7].UUID))
	var first, last string
	require.NoError(t, testdb.Pgx(t).QueryRow(ctx, `SELECT (SELECT uuid FROM `+tables(topic).Messages+` ORDER BY "offset" LIMIT 1), (SELECT uuid FROM `+tables(topic).Messages+` ORDER BY "offset" DESC LIMIT 1)`).Scan(&first, &last))
	assert.Equal(t, msgs[0].UUID, first)
	assert.Equal(t, msgs[len(msgs)-1].UUID, last)

	// Inside a pgx transaction: rolled back, nothing; committed, all.
	for _, commit := range []bool{false, true} {
		tx, err := testdb.Pgx(t).Begin(ctx)
		require.NoError(t, err)
		txPub, err := sqlbroker.NewPublisher(sqlbroker.PgxTx(tx), sqlbroker.PublisherConfig{}, nil)
		require.NoError(t, err)
		txMsgs := newMessages(1500, "tx")
		require.NoError(t, txPub.Publish(topic, txMsgs...))
		if commit {
			require.NoError(t, tx.Commit(ctx))
			assert.Equal(t, 1500, countUUIDs(t, topic, txMsgs))
		} else {
			require.NoError(t, tx.Rollback(ctx))
			assert.Zero(t, countUUIDs(t, topic, txMsgs))
		}
	}
}

// A large call that the database refuses writes nothing: COPY on pgx (pool and caller's
// transaction), the transaction of INSERTs on lib/pq.
func TestPublisher_copy_failingBatchWritesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	publish(t, newPublisher(t, pgxDB(t)), topic, "creates the tables")
	_, err := testdb.Pgx(t).Exec(ctx, "ALTER TABLE "+tables(topic).Messages+" ADD CHECK (payload <> 'bad'::bytea)")
	require.NoError(t, err)
	bad := func(n int) []*message.Message {
		msgs := newMessages(n, "x")
		msgs[n-1].Payload = []byte("bad")
		return msgs
	}
	for name, db := range drivers(t) {
		pub := newPublisher(t, db)
		for _, n := range []int{1000, 12000} {
			err := pub.Publish(topic, bad(n)...)
			require.Error(t, err, "%s %d", name, n)
			assert.ErrorContains(t, err, "23514", "%s %d", name, n)
			assert.Equal(t, 1, countMessages(t, topic), "%s %d", name, n)
		}
	}
	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	txPub, err := sqlbroker.NewPublisher(sqlbroker.PgxTx(tx), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	assert.ErrorContains(t, txPub.Publish(topic, bad(1000)...), "23514")
	require.NoError(t, tx.Rollback(ctx))
	assert.Equal(t, 1, countMessages(t, topic))
}

// A large call on lib/pq (more rows than one INSERT holds) is still all or none and lands
// whole, in order.
func TestPublisher_P1_largeBatchLibpq(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, sqlbroker.StdSQL(testdb.Std(t)))
	msgs := newMessages(12000, "x")
	require.NoError(t, pub.Publish(topic, msgs...))
	assert.Equal(t, 12000, countUUIDs(t, topic, msgs))
	assert.Equal(t, 1, xids(t, topic, msgs))
}

// A COPY publish from a pool wakes a listener in another process: the NOTIFY follows the COPY.
func TestNotify_copyOnPoolNotifies(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "creates the tables")
	time.Sleep(2 * sqlbroker.DefaultNotifyDebounce) // the next publish notifies inline
	conn, err := pgx.Connect(ctx, testdb.URL())
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{listen.Channel}.Sanitize())
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, newMessages(600, "x")...))
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for { // other tests' publishes notify on the same channel
		n, err := conn.WaitForNotification(wctx)
		require.NoError(t, err, "no NOTIFY of the topic")
		if n.Payload == tables(topic).Messages {
			return
		}
	}
}

// A COPY publish inside a pgx transaction wakes a subscriber that polls once an hour when the
// transaction commits: the NOTIFY is sent in that transaction (a transaction publisher does
// not wake subscribers of its process directly).
func TestNotify_copyInTxWakesSubscriber(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{PollInterval: time.Hour})
	require.NoError(t, sub.SubscribeInitialize(topic))
	out, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	noMessage(t, out, 300*time.Millisecond) // the first poll found nothing

	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	txPub, err := sqlbroker.NewPublisher(sqlbroker.PgxTx(tx), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	msgs := newMessages(600, "x")
	require.NoError(t, txPub.Publish(topic, msgs...))
	require.NoError(t, tx.Commit(ctx))
	m := receive(t, out, 10*time.Second)
	assert.Equal(t, msgs[0].UUID, m.UUID)
	m.Ack()
}
