package sqlbroker_test

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// lockMessages holds a lock on topic's messages table that its writes wait on (lockTableSQL),
// in a transaction of the test's own, until the returned function is called.
func lockMessages(t *testing.T, topic string) (release func()) {
	t.Helper()
	ctx := context.Background()
	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, lockTableSQL(tables(topic).Messages))
	require.NoError(t, err)
	var once sync.Once
	release = func() { once.Do(func() { _ = tx.Rollback(ctx) }) }
	t.Cleanup(release)
	return release
}

// appWaiting is the number of backends of application app waiting on a lock.
func appWaiting(t *testing.T, app string) int {
	return queryInt(t, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE a.application_name = $1 AND NOT l.granted`, app)
}

// appActive is the number of backends of application app running a statement.
func appActive(t *testing.T, app string) int {
	return queryInt(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state <> 'idle'`, app)
}

// A publish blocked on a table lock when Broker.Shutdown runs with a 1 s deadline is
// cancelled on the server: Shutdown returns within its deadline plus the cancel wait, the
// publish fails, no backend of the library waits on the lock afterwards, and once the lock is
// released no row is committed (S8, S11), grouped or not, with both drivers. PostgreSQL only:
// it takes a table lock and reads pg_locks; on SQLite a publish waits on the database's write
// lock instead, which TestSQLite_shutdownInterruptsStatementInFlight holds.
func TestShutdown_S8_S11_publishBlockedOnTableLock(t *testing.T) {
	t.Parallel()
	for _, scheme := range []string{"postgres", "libpq+postgres"} {
		for _, grouped := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/grouped=%v", scheme, grouped), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				topic := testdb.Topic(t, "")
				url, app := brokerURL(t, scheme)
				broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
				require.NoError(t, err)
				require.NoError(t, broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
				pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{DisableGroupInsert: !grouped})
				require.NoError(t, err)
				release := lockMessages(t, topic)
				published := publishAsync(pub, topic, newMessages(3, "blocked")...)
				testdb.Eventually(t, 10*time.Second, "the publish waiting on the lock", func() bool { return appWaiting(t, app) == 1 })

				sctx, cancel := context.WithTimeout(ctx, time.Second)
				defer cancel()
				start := time.Now()
				rep, err := broker.Shutdown(sctx)
				took := time.Since(start)
				assert.ErrorIs(t, err, context.DeadlineExceeded)
				assert.Less(t, took, time.Second+dbx.CancelWait, "Shutdown overran its deadline and the cancel wait")
				assert.Equal(t, 0, appWaiting(t, app), "a backend of the library still waits on the lock after Shutdown")
				assert.Equal(t, 0, appActive(t, app), "a backend of the library still runs a statement after Shutdown")
				assert.Equal(t, 1, rep.PublishesCancelled, "report: %+v", rep)
				assert.Zero(t, rep.PublishesAbandoned)
				select {
				case err := <-published:
					require.Error(t, err)
					assert.ErrorIs(t, err, sqlbroker.ErrClosed)
					assert.Contains(t, err.Error(), "nothing was written")
				default:
					t.Fatal("the publish had not returned when Shutdown did")
				}

				release()
				testdb.Eventually(t, 5*time.Second, "no backend of the library left", func() bool { return backends(t, app) == 0 })
				assert.Equal(t, 0, countMessages(t, topic), "a row was committed after Shutdown returned")
			})
		}
	}
}

// No NOTIFY of a publisher reaches a listener after Shutdown returned: a publish blocked on a
// table lock at Shutdown is cancelled with the NOTIFY it carries or would have scheduled, and a
// trailing NOTIFY still pending is sent before Shutdown returns or not at all (S11). A marker
// the test notifies after Shutdown returned orders the notifications: every one the library
// committed before comes before it. PostgreSQL only: SQLite has no NOTIFY.
func TestShutdown_S11_noNotifyAfterShutdown(t *testing.T) {
	t.Parallel()
	for _, byBroker := range []bool{true, false} {
		for _, grouped := range []bool{false, true} {
			t.Run(fmt.Sprintf("broker=%v/grouped=%v", byBroker, grouped), func(t *testing.T) {
				t.Parallel()
				testNoNotifyAfterShutdown(t, byBroker, grouped)
			})
		}
	}
}

// testNoNotifyAfterShutdown runs the case of TestShutdown_S11_noNotifyAfterShutdown: shut down
// by Broker.Shutdown, or by Publisher.Close on a pool of the caller's that stays open.
func testNoNotifyAfterShutdown(t *testing.T, byBroker, grouped bool) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	url, app := brokerURL(t, "postgres")
	debounce := 300 * time.Millisecond
	cfg := sqlbroker.PublisherConfig{InitializeSchema: true, DisableGroupInsert: !grouped, NotifyDebounce: debounce, CloseTimeout: time.Second}
	var pub *sqlbroker.Publisher
	var shutdown func()
	if byBroker {
		broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
		require.NoError(t, err)
		pub, err = broker.NewPublisher(cfg)
		require.NoError(t, err)
		shutdown = func() {
			sctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			_, _ = broker.Shutdown(sctx)
		}
	} else {
		pool, err := pgxpool.New(ctx, url)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		pub, err = sqlbroker.NewPublisher(sqlbroker.Pgx(pool), cfg, nil)
		require.NoError(t, err)
		shutdown = func() { _ = pub.Close() }
	}

	conn, err := pgx.Connect(ctx, testdb.URL())
	require.NoError(t, err)
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, "LISTEN "+listen.Channel)
	require.NoError(t, err)
	table := tables(topic).Messages
	marker := "marker " + topic
	next := func(d time.Duration) (string, bool) {
		for {
			wctx, cancel := context.WithTimeout(ctx, d)
			n, err := conn.WaitForNotification(wctx)
			cancel()
			if err != nil {
				return "", false
			}
			if n.Payload == table || n.Payload == marker {
				return n.Payload, true
			}
		}
	}

	publish(t, pub, topic, "first") // notifies at once
	got, ok := next(5 * time.Second)
	require.True(t, ok, "no NOTIFY of the first publish")
	require.Equal(t, table, got)

	// Within the debounce time: no NOTIFY of its own, a trailing one is due after it.
	publish(t, pub, topic, "second")
	if grouped {
		// Past the debounce time, the blocked statement carries a NOTIFY of its own.
		got, ok := next(5 * time.Second)
		require.True(t, ok, "no trailing NOTIFY of the second publish")
		require.Equal(t, table, got)
		time.Sleep(debounce) // lets the debounce time pass; no synchronisation
	}
	release := lockMessages(t, topic)
	published := publishAsync(pub, topic, newMessages(1, "blocked")...)
	testdb.Eventually(t, 10*time.Second, "the publish waiting on the lock", func() bool { return appWaiting(t, app) == 1 })
	shutdown()
	_, err = testdb.Pgx(t).Exec(ctx, "SELECT pg_notify($1, $2)", listen.Channel, marker)
	require.NoError(t, err)
	release()
	_ = result(t, published)
	if byBroker {
		testdb.Eventually(t, 5*time.Second, "no backend of the library left", func() bool { return backends(t, app) == 0 })
	} else { // the caller's pool keeps its idle connections
		testdb.Eventually(t, 5*time.Second, "no statement of the library running", func() bool { return appActive(t, app) == 0 })
	}

	for {
		got, ok := next(5 * time.Second)
		require.True(t, ok, "the marker did not arrive")
		if got == marker {
			break
		}
	}
	got, ok = next(2 * debounce)
	assert.False(t, ok, "a NOTIFY of the library (%q) arrived after Shutdown returned", got)
	assert.Equal(t, 2, countMessages(t, topic))
}

// Publisher.Close waits for the publishes running up to PublisherConfig.CloseTimeout, then
// cancels them on the server: a publish blocked on a table lock fails, and nothing of it
// waits on the server when Close returns. On SQLite, see
// TestPublisher_S11_closeTimeoutInterruptsSQLiteWriteLockWait.
func TestPublisher_S11_closeTimeoutCancelsOnTheServer(t *testing.T) {
	t.Parallel()
	for name, db := range drivers(t) {
		t.Run(name, func(t *testing.T) {
			topic := testdb.Topic(t, "")
			pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true, CloseTimeout: 500 * time.Millisecond, DisableGroupInsert: true}, nil)
			require.NoError(t, err)
			publish(t, pub, topic, "creates the tables")
			release := lockMessages(t, topic)
			published := publishAsync(pub, topic, newMessages(1, "blocked")...)
			waitBlocked(t, topic, 1)
			start := time.Now()
			err = pub.Close()
			assert.ErrorIs(t, err, context.DeadlineExceeded)
			assert.Less(t, time.Since(start), 500*time.Millisecond+dbx.CancelWait)
			assert.Equal(t, 0, queryInt(t, "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass", tables(topic).Messages))
			require.Error(t, result(t, published))
			release()
			assert.Equal(t, 1, countMessages(t, topic))
		})
	}
}

// On SQLite, Publisher.Close waits for a publish running up to PublisherConfig.CloseTimeout,
// then interrupts it: a publish waiting on the database's write lock (another connection holds
// BEGIN IMMEDIATE) fails well within the busy timeout, nothing of it runs when Close returns,
// and nothing of it is written.
func TestPublisher_S11_closeTimeoutInterruptsSQLiteWriteLockWait(t *testing.T) {
	t.Parallel()
	path := testdb.SQLitePath(t)
	handle, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = handle.Close() })
	pub, err := sqlbroker.NewPublisher(sqlbroker.SQLite(handle), sqlbroker.PublisherConfig{InitializeSchema: true, CloseTimeout: 500 * time.Millisecond, DisableGroupInsert: true}, nil)
	require.NoError(t, err)
	publish(t, pub, "t", "creates the tables")

	release := holdWriteLock(t, path)
	published := publishAsync(pub, "t", newMessages(1, "blocked")...)
	testdb.Eventually(t, 5*time.Second, "the publish to wait for the write lock", func() bool {
		return sqlbroker.PublisherRunning(pub) == 1
	})
	start := time.Now()
	err = pub.Close()
	assert.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Less(t, time.Since(start), 3*time.Second, "Close waited for the busy timeout instead of interrupting")
	assert.Equal(t, 0, sqlbroker.PublisherRunning(pub), "the publish still runs after Close returned")
	require.Error(t, result(t, published))
	release()
	var n int
	require.NoError(t, handle.QueryRow(`SELECT count(*) FROM `+tables("t").Messages).Scan(&n))
	assert.Equal(t, 1, n, "the interrupted publish wrote its row")
}
