package sqlbroker_test

import (
	"context"
	"database/sql"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// callerTx is a caller's open transaction on one driver, wrapped for a publisher, with the
// backend pid it runs on.
type callerTx struct {
	db       sqlbroker.DB
	pid      int
	commit   func() error
	rollback func()
}

func beginCallerTx(t *testing.T, driver string) callerTx {
	t.Helper()
	ctx := context.Background()
	var c callerTx
	switch driver {
	case "pgx":
		tx, err := testdb.Pgx(t).Begin(ctx)
		require.NoError(t, err)
		require.NoError(t, tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&c.pid))
		c.db = sqlbroker.PgxTx(tx)
		c.commit = func() error { return tx.Commit(ctx) }
		c.rollback = func() { _ = tx.Rollback(ctx) }
	default:
		tx, err := testdb.Std(t).BeginTx(ctx, &sql.TxOptions{})
		require.NoError(t, err)
		require.NoError(t, tx.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&c.pid))
		c.db = sqlbroker.StdTx(tx)
		c.commit = tx.Commit
		c.rollback = func() { _ = tx.Rollback() }
	}
	t.Cleanup(c.rollback)
	return c
}

// strongLocks lists the locks stronger than ROW EXCLUSIVE that backend pid holds or awaits on
// the tables of topic (and their indexes), and any advisory lock it holds.
func strongLocks(t *testing.T, pid int, topic string) []string {
	t.Helper()
	tb := tables(topic)
	rows, err := testdb.Pgx(t).Query(context.Background(), `SELECT l.locktype || ' ' || l.mode || coalesce(' on ' || c.relname, '')
		FROM pg_locks l LEFT JOIN pg_class c ON c.oid = l.relation
		WHERE l.pid = $1 AND (
			l.locktype = 'advisory' OR
			(l.relation IN (SELECT oid FROM pg_class WHERE oid IN ($2::regclass, $3::regclass, $4::regclass)
			                UNION SELECT indexrelid FROM pg_index WHERE indrelid IN ($2::regclass, $3::regclass, $4::regclass))
			 AND l.mode NOT IN ('AccessShareLock', 'RowShareLock', 'RowExclusiveLock')))`,
		pid, tb.Messages, tb.Groups, tb.Claims)
	require.NoError(t, err)
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	return out
}

// A transaction publisher with InitializeSchema, on tables that exist, takes no DDL lock in
// the caller's transaction: while that transaction stays open after Publish, it holds nothing
// stronger than ROW EXCLUSIVE on the topic's tables, and other publishers of the topic (on a
// pool, or in another transaction) are not blocked (C3, issue 14 defect 4).
func TestPublisher_C3_txPublisherTakesNoDDLLock(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "libpq"} {
		t.Run(driver, func(t *testing.T) {
			topic := testdb.Topic(t, "")
			pool := newPublisher(t, pgxDB(t))
			publish(t, pool, topic, "creates the tables")

			tx := beginCallerTx(t, driver)
			txPub, err := sqlbroker.NewPublisher(tx.db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
			require.NoError(t, err)
			publish(t, txPub, topic, "in the caller's transaction")
			assert.Empty(t, strongLocks(t, tx.pid, topic), "locks the open transaction holds")

			// A pool publisher and another transaction's publisher are not blocked.
			done := make(chan error, 2)
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				defer cancel()
				msg := message.NewMessage(watermill.NewUUID(), []byte("pool"))
				msg.SetContext(ctx)
				done <- pool.Publish(topic, msg)
			}()
			other := beginCallerTx(t, driver)
			go func() {
				otherPub, err := sqlbroker.NewPublisher(other.db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
				if err == nil {
					err = otherPub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("other tx")))
				}
				done <- err
			}()
			for range 2 {
				select {
				case err := <-done:
					require.NoError(t, err)
				case <-time.After(10 * time.Second):
					tx.rollback() // lets the blocked publishes end before the cleanups run
					t.Fatal("a publish of the topic waits for the open transaction")
				}
			}
			require.NoError(t, other.commit())
			require.NoError(t, tx.commit())
			assert.Equal(t, 4, countMessages(t, topic))
		})
	}
}

// Two transactions publishing to two topics in opposite orders both commit: with the tables
// in place, neither holds a lock the other's insert waits for (C3, issue 14 defect 4).
func TestPublisher_C3_txPublishersInOppositeOrdersBothCommit(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "libpq"} {
		t.Run(driver, func(t *testing.T) {
			a, b := testdb.Topic(t, ""), testdb.Topic(t, "")
			pool := newPublisher(t, pgxDB(t))
			publish(t, pool, a, "creates the tables")
			publish(t, pool, b, "creates the tables")

			cfg := sqlbroker.PublisherConfig{InitializeSchema: true}
			tx1, tx2 := beginCallerTx(t, driver), beginCallerTx(t, driver)
			pub1, err := sqlbroker.NewPublisher(tx1.db, cfg, nil)
			require.NoError(t, err)
			pub2, err := sqlbroker.NewPublisher(tx2.db, cfg, nil)
			require.NoError(t, err)

			publish(t, pub1, a, "1a")
			publish(t, pub2, b, "2b")
			second := make(chan error, 2)
			go func() { second <- pub1.Publish(b, message.NewMessage(watermill.NewUUID(), []byte("1b"))) }()
			go func() { second <- pub2.Publish(a, message.NewMessage(watermill.NewUUID(), []byte("2a"))) }()
			var errs []error
			for range 2 {
				select {
				case err := <-second:
					errs = append(errs, err)
				case <-time.After(10 * time.Second):
					tx1.rollback()
					tx2.rollback()
					t.Fatal("the second publishes wait on each other")
				}
			}
			for _, err := range errs {
				require.NoError(t, err, "a transaction publisher was refused (deadlock)")
			}
			require.NoError(t, tx1.commit())
			require.NoError(t, tx2.commit())
			assert.Equal(t, 3, countMessages(t, a))
			assert.Equal(t, 3, countMessages(t, b))
		})
	}
}

// A broker keeps nothing of the transaction publishers it builds, one per transaction in an
// outbox service: 100,000 of them leave no entry behind and the heap flat; one taken before
// Shutdown still refuses with ErrClosed after it (issue 15 item 5, S1).
func TestBroker_txPublishersAreNotKept(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, _ := brokerURL(t, "postgres")
	broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	defer broker.Close()
	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	db := sqlbroker.PgxTx(tx)

	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapInuse
	}
	before := heap()
	var last *sqlbroker.Publisher
	for range 100_000 {
		last, err = broker.NewTxPublisher(db, sqlbroker.PublisherConfig{})
		require.NoError(t, err)
	}
	grown := int64(heap()) - int64(before)
	t.Logf("heap in use grew by %d KiB over 100,000 transaction publishers", grown/1024)
	assert.Zero(t, sqlbroker.BrokerPublishers(broker), "transaction publishers kept by the broker")
	assert.Less(t, grown, int64(8<<20), "heap growth over 100,000 transaction publishers")

	topic := testdb.Topic(t, "")
	require.NoError(t, broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
	require.NoError(t, last.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)))
	_, err = broker.Shutdown(ctx)
	require.NoError(t, err)
	assert.ErrorIs(t, last.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)), sqlbroker.ErrClosed)
	_, err = broker.NewTxPublisher(db, sqlbroker.PublisherConfig{})
	assert.ErrorIs(t, err, sqlbroker.ErrClosed)
}

type requestIDKey struct{}

// valueTracer records, for each INSERT into a messages table, the request id its context
// carries.
type valueTracer struct {
	mu   sync.Mutex
	seen []any
}

func (v *valueTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, "INSERT INTO") && strings.Contains(data.SQL, "_messages") && !strings.Contains(data.SQL, "CREATE TABLE") {
		v.mu.Lock()
		v.seen = append(v.seen, ctx.Value(requestIDKey{}))
		v.mu.Unlock()
	}
	return ctx
}

func (v *valueTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A grouped publish runs its statement with the values of the leading call's message context
// (a tracing span, a request id), though not with its cancellation: a pgx tracer sees them.
func TestPublisher_group_statementCarriesCallerContextValues(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	tracer := &valueTracer{}
	cfg.ConnConfig.Tracer = tracer
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	pub, err := sqlbroker.NewPublisher(sqlbroker.Pgx(pool), sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()

	msg := message.NewMessage(watermill.NewUUID(), []byte("traced"))
	mctx, cancel := context.WithCancel(context.WithValue(ctx, requestIDKey{}, "req-42"))
	defer cancel()
	msg.SetContext(mctx)
	require.NoError(t, pub.Publish(topic, msg))

	tracer.mu.Lock()
	defer tracer.mu.Unlock()
	require.NotEmpty(t, tracer.seen, "no INSERT traced")
	assert.Equal(t, []any{"req-42"}, tracer.seen)
}

// A DB that wraps nothing is refused with an error that names every way to build one.
func TestPublisher_emptyDBNamesEveryConstructor(t *testing.T) {
	_, err := sqlbroker.NewPublisher(sqlbroker.DB{}, sqlbroker.PublisherConfig{}, nil)
	var ce *sqlbroker.ConfigError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "db", ce.Field)
	for _, name := range []string{"Pgx", "StdSQL", "SQLite", "PgxTx", "StdTx", "SQLiteTx"} {
		assert.Contains(t, err.Error(), name)
	}
}
