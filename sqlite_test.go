package sqlbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func requireConfigError(t *testing.T, err error, field string, says ...string) {
	t.Helper()
	var ce *sqlbroker.ConfigError
	require.True(t, errors.As(err, &ce), "want a ConfigError, got %v", err)
	assert.Equal(t, field, ce.Field)
	for _, s := range says {
		assert.Contains(t, err.Error(), s)
	}
}

// What SQLite cannot do is refused with a ConfigError that names the field and says why.
func TestSQLite_badInputRefused(t *testing.T) {
	t.Parallel()
	db := sqlbroker.SQLite(testdb.SQLite(t))

	_, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ClaimMode: sqlbroker.ClaimAdvisoryLock}, nil)
	requireConfigError(t, err, "ClaimMode", "advisory", "ClaimLease", "lease mode")
	_, err = sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{Schema: "app"}, nil)
	requireConfigError(t, err, "Schema", "SQLite")
	_, err = sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{Schema: "app"}, nil)
	requireConfigError(t, err, "Schema", "SQLite")
	_, err = sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{Schema: "app"})
	requireConfigError(t, err, "Schema", "SQLite")
	admin, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{})
	require.NoError(t, err, "the operator's tools run on SQLite")
	_, err = admin.MigrateWatermillSQL(context.Background(), "t", "g", sqlbroker.MigrateOptions{})
	requireConfigError(t, err, "db", "PostgreSQL")

	for _, url := range []string{"sqlite:", "sqlite:?mode=rwc", "sqlite://host/file.db", "sqlite:x.db?%zz"} {
		_, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
		requireConfigError(t, err, "url")
	}

	b, err := sqlbroker.Open("sqlite::memory:", sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	defer b.Close()
	_, err = b.NewSubscriber(sqlbroker.SubscriberConfig{ClaimMode: sqlbroker.ClaimAdvisoryLock})
	requireConfigError(t, err, "ClaimMode", "lease mode")
	err = b.InitializeSchema(context.Background(), sqlbroker.PublisherConfig{Schema: "app"}, "t")
	requireConfigError(t, err, "Schema")
	err = b.InitializeSchema(context.Background(), sqlbroker.PublisherConfig{}, "bad topic")
	require.Error(t, err)
}

// A caller's *sql.DB opened with none of the settings is set up by the library: WAL and a busy
// timeout on the connections it uses.
func TestSQLite_callerHandleIsSetUp(t *testing.T) {
	t.Parallel()
	raw := testdb.SQLite(t)
	raw.SetMaxOpenConns(4)
	pub, err := sqlbroker.NewPublisher(sqlbroker.SQLite(raw), sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x"))))
	var mode string
	require.NoError(t, raw.QueryRow("PRAGMA journal_mode").Scan(&mode))
	assert.Equal(t, "wal", mode)
}

// Shutdown interrupts a publish that waits for SQLite's write lock (another process's
// transaction holds it, here a handle of its own), and returns once the statement has ended:
// the publish fails with ErrClosed, and nothing of it is written.
func TestSQLite_shutdownInterruptsStatementInFlight(t *testing.T) {
	t.Parallel()
	path := testdb.SQLitePath(t)
	b, err := sqlbroker.Open("sqlite:"+path+"?mode=rwc", sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, b.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, "t"))
	pub, err := b.NewPublisher(sqlbroker.PublisherConfig{})
	require.NoError(t, err)
	require.NoError(t, pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("before"))))

	other, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	require.NoError(t, err)
	defer other.Close()
	hold, err := other.Conn(ctx)
	require.NoError(t, err)
	_, err = hold.ExecContext(ctx, "BEGIN IMMEDIATE")
	require.NoError(t, err)

	published := make(chan error, 1)
	go func() { published <- pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("during"))) }()
	testdb.Eventually(t, 5*time.Second, "the publish to wait for the write lock", func() bool {
		return sqlbroker.PublisherRunning(pub) == 1
	})
	sctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	rep, _ := b.Shutdown(sctx)
	took := time.Since(start)
	err = <-published
	assert.ErrorIs(t, err, sqlbroker.ErrClosed)
	assert.Equal(t, 1, rep.PublishesCancelled, "the report counts the statement interrupted")
	assert.Less(t, took, 3*time.Second, "Shutdown waited for the busy timeout instead of interrupting")

	_, err = hold.ExecContext(ctx, "ROLLBACK")
	require.NoError(t, err)
	_ = hold.Close()
	var n int
	require.NoError(t, other.QueryRow(`SELECT count(*) FROM "sqlbroker_t_messages"`).Scan(&n))
	assert.Equal(t, 1, n, "only the publish before the shutdown is written")
	assert.ErrorIs(t, pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("after"))), sqlbroker.ErrClosed)
}

// Shutdown interrupts a claim that waits for SQLite's write lock (another process's
// transaction holds it), and returns once the statement has ended: the claim is rolled back,
// and the message it would have taken is handed out later, at its first attempt. Its
// PostgreSQL counterpart, a claim blocked on a row lock, is TestShutdown_S3_cancelledClaimRollsBack.
//
// The claim is made to come at a known moment: the message is delayed, the subscription's
// first claim passes it (its claim row is due at its time), and with a PollInterval of a
// minute the subscription's next statement is the claim at that time.
func TestSQLite_shutdownInterruptsClaimInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testdb.SQLitePath(t)
	handle, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = handle.Close() }) // after the subscribers' and publisher's closes
	db := sqlbroker.SQLite(handle)
	pub := newPublisher(t, db)
	m := message.NewMessage(watermill.NewUUID(), []byte("delayed"))
	delay.Message(m, delay.For(3*time.Second))
	require.NoError(t, pub.Publish("t", m))
	claims := tables("t").Claims

	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: time.Minute, InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	count := func(q string) int {
		var n int
		require.NoError(t, handle.QueryRow(q).Scan(&n))
		return n
	}
	testdb.Eventually(t, 5*time.Second, "the delayed message passed", func() bool {
		return count(`SELECT count(*) FROM `+claims+` WHERE "token" = 0`) == 1
	})

	other, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	require.NoError(t, err)
	defer other.Close()
	hold, err := other.Conn(ctx)
	require.NoError(t, err)
	_, err = hold.ExecContext(ctx, "BEGIN IMMEDIATE")
	require.NoError(t, err)
	held := true
	defer func() {
		if held {
			_, _ = hold.ExecContext(ctx, "ROLLBACK")
		}
		_ = hold.Close()
	}()
	// The claim reads first (is anything due?) without the write lock, for a moment: the
	// statement is taken to wait for the lock once it has run for 20 polls in a row.
	streak := 0
	testdb.Eventually(t, 10*time.Second, "the claim to wait for the write lock", func() bool {
		if sqlbroker.SubscriberRunning(sub) == 1 {
			streak++
		} else {
			streak = 0
		}
		return streak >= 20
	})

	sctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	rep, _ := sub.Shutdown(sctx)
	took := time.Since(start)
	assert.Equal(t, 0, sqlbroker.SubscriberRunning(sub), "Shutdown returned before the claim ended")
	assert.Equal(t, 1, rep.ClaimStatementsCancelled, "the report counts the claim interrupted")
	assert.Less(t, took, 3*time.Second, "Shutdown waited for the busy timeout instead of interrupting")
	_, open := <-msgs
	assert.False(t, open, "a message was handed out")

	_, err = hold.ExecContext(ctx, "ROLLBACK")
	require.NoError(t, err)
	held = false
	assert.Equal(t, 1, count(`SELECT count(*) FROM `+claims+` WHERE "token" = 0 AND "attempts" = 0`), "the interrupted claim changed the claim row")

	next := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
	again, err := next.Subscribe(ctx, "t")
	require.NoError(t, err)
	got := receive(t, again, 10*time.Second)
	assert.Equal(t, m.UUID, got.UUID)
	assert.Equal(t, "1", got.Metadata.Get(sqlbroker.MetadataAttempt))
	got.Ack()
}

// A publisher inside the caller's SQLite transaction: its messages are seen exactly when the
// caller commits, and never after a rollback.
func TestSQLite_txPublisherVisibleAtCommit(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	handle := testdb.SQLite(t)
	db := sqlbroker.SQLite(handle)
	topic := testdb.Topic(t, "sqlite-tx")
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", InitializeSchema: true, PollInterval: 20 * time.Millisecond}, nil)
	require.NoError(t, err)
	defer sub.Close()
	require.NoError(t, sub.SubscribeInitialize(topic))

	publishIn := func(payload string, commit bool) {
		tx, err := handle.BeginTx(ctx, nil)
		require.NoError(t, err)
		txPub, err := sqlbroker.NewPublisher(sqlbroker.SQLiteTx(tx), sqlbroker.PublisherConfig{}, nil)
		require.NoError(t, err)
		require.NoError(t, txPub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte(payload))))
		if commit {
			require.NoError(t, tx.Commit())
		} else {
			require.NoError(t, tx.Rollback())
		}
	}
	publishIn("rolled back", false)
	publishIn("committed", true)

	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	select {
	case msg := <-msgs:
		assert.Equal(t, "committed", string(msg.Payload))
		msg.Ack()
	case <-ctx.Done():
		t.Fatal("the committed message never came")
	}
	var n int
	require.NoError(t, handle.QueryRowContext(ctx, `SELECT count(*) FROM "sqlbroker_`+topic+`_messages"`).Scan(&n))
	assert.Equal(t, 1, n, "only the committed message was written")
}

// An idle subscription on SQLite sees a commit of another connection (another process, for
// SQLite: nothing in this process wakes it) through its pool's watch of commits, which holds
// one connection of the pool. The last subscription's stop closes that connection and counts
// it in ConnectionsClosed.
func TestSQLite_commitOfAnotherConnectionSeen(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testdb.SQLitePath(t)
	raw, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	defer raw.Close()
	raw.SetMaxOpenConns(8)
	raw.SetMaxIdleConns(8) // idle connections stay: the pool's count moves only by what closes them
	const topic = "watched"
	sub, err := sqlbroker.NewSubscriber(sqlbroker.SQLite(raw), sqlbroker.SubscriberConfig{ConsumerGroup: "g", InitializeSchema: true}, nil)
	require.NoError(t, err)
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msgs, err := sub.Subscribe(sctx, topic)
	require.NoError(t, err)
	testdb.Eventually(t, 10*time.Second, "the watch's connection held", func() bool { return raw.Stats().InUse == 1 })

	other, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	require.NoError(t, err)
	defer other.Close()
	insert := "INSERT INTO " + offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic).OnSQLite().Messages + ` ("uuid", "payload", "metadata") VALUES (?, ?, '{}')`
	for i := range 3 {
		id := watermill.NewUUID()
		_, err := other.ExecContext(ctx, insert, id, []byte(fmt.Sprint(i)))
		require.NoError(t, err)
		select {
		case m := <-msgs:
			assert.Equal(t, id, m.UUID)
			m.Ack()
		case <-time.After(10 * time.Second):
			t.Fatalf("message %d of another connection not delivered within 10s", i)
		}
	}

	rep, err := sub.Shutdown(ctx)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, rep.ConnectionsClosed, 1, "the watch's connection: %+v", rep)
	assert.Zero(t, raw.Stats().InUse, "a connection still held after the shutdown")
}

// A pool limited to one connection cannot spare one for the watch: subscriptions look by
// themselves every PollInterval, and still see another connection's commit (a watch holding
// the one connection would leave none for the claims).
func TestSQLite_oneConnectionPoolPolls(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testdb.SQLitePath(t)
	raw, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	defer raw.Close()
	raw.SetMaxOpenConns(1)
	const topic = "polled"
	sub, err := sqlbroker.NewSubscriber(sqlbroker.SQLite(raw), sqlbroker.SubscriberConfig{ConsumerGroup: "g", InitializeSchema: true}, nil)
	require.NoError(t, err)
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	msgs, err := sub.Subscribe(sctx, topic)
	require.NoError(t, err)
	other, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	require.NoError(t, err)
	defer other.Close()
	id := watermill.NewUUID()
	_, err = other.ExecContext(ctx, "INSERT INTO "+offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic).OnSQLite().Messages+` ("uuid", "payload", "metadata") VALUES (?, 'x', '{}')`, id)
	require.NoError(t, err)
	select {
	case m := <-msgs:
		assert.Equal(t, id, m.UUID)
		m.Ack()
	case <-time.After(10 * time.Second):
		t.Fatal("the message of another connection not delivered within 10s")
	}
	_, err = sub.Shutdown(ctx)
	require.NoError(t, err)
	assert.Zero(t, raw.Stats().InUse)
}
