package sqlbroker_test

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"runtime/pprof"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// recLogger records every entry with the time it was logged.
type recLogger struct {
	mu      sync.Mutex
	entries []logEntry
	fields  watermill.LogFields
	root    *recLogger
}

type logEntry struct {
	at    time.Time
	level string
	msg   string
	err   error
}

func newRecLogger() *recLogger {
	l := &recLogger{}
	l.root = l
	return l
}

func (l *recLogger) add(level, msg string, err error) {
	r := l.root
	r.mu.Lock()
	defer r.mu.Unlock()
	r.entries = append(r.entries, logEntry{at: time.Now(), level: level, msg: msg, err: err})
}

func (l *recLogger) Error(msg string, err error, _ watermill.LogFields) { l.add("error", msg, err) }
func (l *recLogger) Info(msg string, _ watermill.LogFields)             { l.add("info", msg, nil) }
func (l *recLogger) Debug(msg string, _ watermill.LogFields)            { l.add("debug", msg, nil) }
func (l *recLogger) Trace(msg string, _ watermill.LogFields)            { l.add("trace", msg, nil) }
func (l *recLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return &recLogger{fields: f, root: l.root}
}

// since returns the entries logged at or after t.
func (l *recLogger) since(t time.Time) []string {
	r := l.root
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, e := range r.entries {
		if !e.at.Before(t) {
			out = append(out, fmt.Sprintf("%s %s: %q (%v)", e.at.Format("15:04:05.000"), e.level, e.msg, e.err))
		}
	}
	return out
}

// ownDB builds a pool of the test's own for driver ("pgx" or "libpq"), bounded at maxConns,
// whose backends carry an application_name of their own, returned beside it.
func ownDB(t *testing.T, driver string, maxConns int) (sqlbroker.DB, string) {
	db, app, _ := ownPool(t, driver, maxConns)
	return db, app
}

// ownPool is ownDB, and a hold that takes a connection of the pool until the func it returns
// is called (or the test ends).
func ownPool(t *testing.T, driver string, maxConns int) (sqlbroker.DB, string, func() func()) {
	t.Helper()
	app := "sqlbroker_" + strings.ToLower(watermill.NewShortUUID())
	switch driver {
	case "pgx":
		pool := ownPgxPool(t, app, maxConns)
		hold := func() func() {
			c, err := pool.Acquire(context.Background())
			require.NoError(t, err)
			return onceCleanup(t, c.Release)
		}
		return sqlbroker.Pgx(pool), app, hold
	default:
		u := testdb.URL()
		sep := "?"
		if strings.Contains(u, "?") {
			sep = "&"
		}
		db, err := sql.Open("postgres", u+sep+"application_name="+app)
		require.NoError(t, err)
		db.SetMaxOpenConns(maxConns)
		t.Cleanup(func() { _ = db.Close() })
		hold := func() func() {
			c, err := db.Conn(context.Background())
			require.NoError(t, err)
			return onceCleanup(t, func() { _ = c.Close() })
		}
		return sqlbroker.StdSQL(db), app, hold
	}
}

// ownPgxPool builds a pgx pool of the test's own, bounded at maxConns, whose backends carry
// application_name app (none: the server's default), closed when the test ends.
func ownPgxPool(t *testing.T, app string, maxConns int) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	if app != "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = app
	}
	cfg.MaxConns = int32(maxConns)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// tableLocks counts the locks held or awaited by backends of app on the topic's tables.
func tableLocks(t *testing.T, app, topic string) int {
	tb := tables(topic)
	return queryInt(t, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		JOIN pg_class c ON c.oid = l.relation
		WHERE a.application_name = $1 AND c.relname IN ($2, $3, $4)`, app, tb.MessagesName, tb.GroupsName, tb.ClaimsName)
}

// activeBackends counts the backends of app running or waiting in a statement.
func activeBackends(t *testing.T, app string) int {
	return queryInt(t, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND state <> 'idle'", app)
}

// backendPIDs lists the backends of app.
func backendPIDs(t *testing.T, app string) string {
	var s string
	require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(),
		"SELECT coalesce(string_agg(pid::text, ',' ORDER BY pid), '') FROM pg_stat_activity WHERE application_name = $1", app).Scan(&s))
	return s
}

// labelled runs f with a goroutine label of its own, which every goroutine f starts (and
// every goroutine those start) inherits, and returns the label.
func labelled(f func(ctx context.Context)) string {
	id := watermill.NewShortUUID()
	pprof.Do(context.Background(), pprof.Labels("sqlbroker_test", id), f)
	return id
}

// libraryGoroutines returns the stacks of the goroutines labelled id that run a function of
// the library (driver goroutines are not the library's).
func libraryGoroutines(id string) []string {
	var buf bytes.Buffer
	_ = pprof.Lookup("goroutine").WriteTo(&buf, 1)
	var out []string
	for _, block := range strings.Split(buf.String(), "\n\n") {
		if strings.Contains(block, `"sqlbroker_test":"`+id+`"`) && strings.Contains(block, "github.com/sqlbroker/watermill-sqlbroker") {
			out = append(out, block)
		}
	}
	return out
}

// watchQuiet checks, for d after Shutdown returned at returned, that nothing is logged, no
// backend of app runs or waits in a statement, none holds or awaits a lock on the topic's
// tables, and no connection is opened.
func watchQuiet(t *testing.T, log *recLogger, returned time.Time, app, topic string, d time.Duration) {
	t.Helper()
	pids := backendPIDs(t, app)
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if n := activeBackends(t, app); n != 0 {
			t.Fatalf("%s after Shutdown returned, %d backends of the library run a statement", time.Since(returned), n)
		}
		if n := tableLocks(t, app, topic); n != 0 {
			t.Fatalf("%s after Shutdown returned, backends of the library hold or await %d locks on the topic's tables", time.Since(returned), n)
		}
		if now := backendPIDs(t, app); now != pids && !strings.HasPrefix(pids, now) && !isSubset(now, pids) {
			t.Fatalf("%s after Shutdown returned, a connection was opened: backends %q, then %q", time.Since(returned), pids, now)
		}
	}
	assert.Empty(t, log.since(returned), "logged after Shutdown returned")
}

// holds fails t if cond stops holding within d: it checks that something does not happen
// (a late settlement applied), not how fast anything is.
func holds(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if !cond() {
			t.Fatalf("%s: no longer so", what)
		}
	}
}

// isSubset reports whether every pid of the comma list a is in b.
func isSubset(a, b string) bool {
	if a == "" {
		return true
	}
	in := map[string]bool{}
	for _, p := range strings.Split(b, ",") {
		in[p] = true
	}
	for _, p := range strings.Split(a, ",") {
		if !in[p] {
			return false
		}
	}
	return true
}

// A settlement blocked by a migration's table lock when the service stops: Shutdown, bounded
// at 3 s, cancels it on the server and waits for the server's answer, and returns ctx's error
// with a report that counts it. Right after it returns, no backend of the library holds or
// awaits a lock on the topic's tables, and in the next 3 s nothing is logged and no backend of
// the library becomes active or is opened (S11). PostgreSQL only: it takes a table lock and
// reads pg_locks and pg_stat_activity; its SQLite counterpart, a settlement waiting on the
// database's write lock, is TestShutdown_S11_settlementBlockedOnSQLiteWriteLock.
func TestShutdown_S11_settlementBlockedOnTableLock(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "libpq"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			db, app := ownDB(t, driver, 10)
			log := newRecLogger()
			pub := newPublisher(t, pgxDB(t))
			publish(t, pub, topic, "a", "b")
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", MaxInFlight: 2, InitializeSchema: true}, log)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			got := []*message.Message{receive(t, msgs, 10*time.Second), receive(t, msgs, 10*time.Second)}

			// A migration takes the claims table.
			tx, err := testdb.Pgx(t).Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, lockTableSQL(tables(topic).Claims))
			require.NoError(t, err)
			for _, m := range got {
				m.Ack()
			}
			testdb.Eventually(t, 10*time.Second, "a settlement waiting on the table lock", func() bool {
				return queryInt(t, `SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
					WHERE a.application_name = $1 AND NOT l.granted AND a.query LIKE '/* sqlbroker ack */%'`, app) > 0
			})

			sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			rep, err := sub.Shutdown(sctx)
			returned := time.Now()
			require.ErrorIs(t, err, context.DeadlineExceeded)
			assert.Equal(t, 0, tableLocks(t, app, topic), "a backend of the library holds or awaits a lock on the topic's tables after Shutdown returned")
			assert.Equal(t, 0, activeBackends(t, app), "a backend of the library runs a statement after Shutdown returned")
			assert.Positive(t, rep.SettlementStatementsCancelled, "report: %+v", rep)
			assert.Equal(t, 2, rep.SettlementsNotApplied, "report: %+v", rep)
			assert.Equal(t, 2, rep.LeasesLeft, "report: %+v", rep)
			assert.Zero(t, rep.StatementsAbandoned, "report: %+v", rep)
			assert.GreaterOrEqual(t, rep.QueriesCancelled, rep.SettlementStatementsCancelled)
			watchQuiet(t, log, returned, app, topic, 3*time.Second)
		})
	}
}

// With every connection of a bounded pool taken by someone else, the claim waits for a
// connection; Shutdown ends that wait at once, and once the connection is free again no
// claim runs (S11). Its SQLite counterpart is TestShutdown_S11_exhaustedSQLitePoolAcquire,
// which sees the quiet from the process instead of pg_stat_activity.
func TestShutdown_S11_exhaustedPoolAcquire(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "libpq"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			db, app, hold := ownPool(t, driver, 1)
			log := newRecLogger()
			pub := newPublisher(t, pgxDB(t))
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond, InitializeSchema: true}, log)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			publish(t, pub, topic, "x")
			receive(t, msgs, 10*time.Second).Ack()
			testdb.Eventually(t, 10*time.Second, "the ack", func() bool { return sub.Stats().Acked == 1 })

			// Take the pool's only connection; the next claim waits for it.
			release := hold()
			publish(t, pub, topic, "y")
			sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			start := time.Now()
			_, err = sub.Shutdown(sctx)
			require.NoError(t, err, "Shutdown waited for the claim's connection")
			assert.Less(t, time.Since(start), time.Second)
			returned := time.Now()
			release()
			watchQuiet(t, log, returned, app, topic, 1500*time.Millisecond)
			assert.Equal(t, 0, claimedPG(t, tables(topic).Claims, "true"), "a claim ran after Shutdown returned")
			assert.Equal(t, int64(1), sub.Stats().Claimed)
		})
	}
}

// onceCleanup returns f to be called once, by the caller or when t ends.
func onceCleanup(t *testing.T, f func()) func() {
	var once sync.Once
	g := func() { once.Do(f) }
	t.Cleanup(g)
	return g
}

// After Shutdown returns, with deliveries in work, settlements queued and claims held ahead,
// no goroutine of the subscriber runs any more, and nothing is logged: a late ack is not
// waited for (S11). On SQLite too, where what watchQuiet asks PostgreSQL's server is seen
// from the process.
func TestShutdown_S11_nothingLoggedAfterShutdown(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		driver string
		mode   sqlbroker.ClaimMode
	}{{"pgx", sqlbroker.ClaimLease}, {"libpq", sqlbroker.ClaimLease}, {"pgx", sqlbroker.ClaimAdvisoryLock}, {"libpq", sqlbroker.ClaimAdvisoryLock}, {"sqlite", sqlbroker.ClaimLease}} {
		driver := c.driver
		t.Run(driver+"/"+c.mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			var db, pubDB sqlbroker.DB
			var app string
			if driver == "sqlite" {
				db = sqliteDB(t)
				pubDB = db
			} else {
				db, app = ownDB(t, driver, 10)
				pubDB = pgxDB(t)
			}
			log := newRecLogger()
			pub := newPublisher(t, pubDB)
			publish(t, pub, topic, numbered(20)...)
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", MaxInFlight: 4, ClaimMode: c.mode,
				Retention: time.Hour, LeaseTTL: 2 * time.Second, InitializeSchema: true}, log)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			var msgs <-chan *message.Message
			id := labelled(func(ctx context.Context) {
				msgs, err = sub.Subscribe(ctx, topic)
			})
			require.NoError(t, err)
			var got []*message.Message
			for range 4 {
				got = append(got, receive(t, msgs, 10*time.Second))
			}
			got[0].Ack()
			require.NotEmpty(t, libraryGoroutines(id), "the goroutine scan sees nothing of the subscriber")

			rep, err := sub.Shutdown(ctx)
			returned := time.Now()
			require.NoError(t, err)
			// A goroutine that has done its last work may still be on its way out (a deferred
			// Done ran, the function returns): it is given a moment; one that waits or works
			// would stay.
			testdb.Eventually(t, 200*time.Millisecond, "goroutines of the subscriber ended after Shutdown returned",
				func() bool { return len(libraryGoroutines(id)) == 0 })
			require.Empty(t, log.since(returned), "logged after Shutdown returned")
			if c.mode == sqlbroker.ClaimLease {
				assert.Equal(t, 3, rep.LeasesLeft)
			} else {
				assert.Equal(t, 3, rep.DeliveriesInWork)
				assert.GreaterOrEqual(t, rep.LocksReleased, 3, "the locks of the deliveries in work")
			}
			got[1].Ack() // after Shutdown: not applied, not waited for
			got[2].Nack()
			if driver == "sqlite" {
				sqliteQuiet(t, log, sub, returned, time.Second)
			} else {
				watchQuiet(t, log, returned, app, topic, time.Second)
			}
			assert.Empty(t, libraryGoroutines(id), "a late settlement started a goroutine")
		})
	}
}

// sqliteQuiet checks, for d after Shutdown returned at returned, that nothing is logged and no
// statement of the subscriber runs: what watchQuiet checks on PostgreSQL's server, seen from
// the process (a SQLite database has no server to ask).
func sqliteQuiet(t *testing.T, log *recLogger, sub *sqlbroker.Subscriber, returned time.Time, d time.Duration) {
	t.Helper()
	holds(t, d, "no statement of the subscriber after Shutdown returned", func() bool { return sqlbroker.SubscriberRunning(sub) == 0 })
	assert.Empty(t, log.since(returned), "logged after Shutdown returned")
}

// On SQLite, acks waiting on the database's write lock (another connection holds BEGIN
// IMMEDIATE) when the service stops: Shutdown, bounded at 3 s, interrupts them and waits for
// them to return, and returns ctx's error with a report that counts them; afterwards nothing
// is logged, no statement runs, and the claims are as they were (S11).
func TestShutdown_S11_settlementBlockedOnSQLiteWriteLock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testdb.SQLitePath(t)
	handle, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = handle.Close() })
	db := sqlbroker.SQLite(handle)
	log := newRecLogger()
	pub := newPublisher(t, db)
	publish(t, pub, "t", "a", "b")
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", MaxInFlight: 2, PollInterval: time.Minute, InitializeSchema: true}, log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	got := []*message.Message{receive(t, msgs, 10*time.Second), receive(t, msgs, 10*time.Second)}

	release := holdWriteLock(t, path)
	for _, m := range got {
		m.Ack()
	}
	// The ack statement waits on the lock; it has run for 20 polls in a row.
	streak := 0
	testdb.Eventually(t, 10*time.Second, "an ack waiting on the write lock", func() bool {
		if sqlbroker.SubscriberRunning(sub) > 0 {
			streak++
		} else {
			streak = 0
		}
		return streak >= 20
	})

	sctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	rep, err := sub.Shutdown(sctx)
	returned := time.Now()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Equal(t, 0, sqlbroker.SubscriberRunning(sub), "a statement runs after Shutdown returned")
	assert.Positive(t, rep.SettlementStatementsCancelled, "report: %+v", rep)
	assert.Equal(t, 2, rep.SettlementsNotApplied, "report: %+v", rep)
	assert.Equal(t, 2, rep.LeasesLeft, "report: %+v", rep)
	assert.Zero(t, rep.StatementsAbandoned, "report: %+v", rep)
	release()
	sqliteQuiet(t, log, sub, returned, time.Second)
	var n int
	require.NoError(t, handle.QueryRow(`SELECT count(*) FROM `+tables("t").Claims+` WHERE "token" <> 0`).Scan(&n))
	assert.Equal(t, 2, n, "an interrupted ack was applied")
}

// On SQLite, with the only connection of a bounded handle taken by someone else, the claim
// waits for a connection; Shutdown ends that wait at once, and once the connection is free
// again no claim runs (S11).
func TestShutdown_S11_exhaustedSQLitePoolAcquire(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := testdb.SQLitePath(t)
	handle, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = handle.Close() })
	handle.SetMaxOpenConns(1)
	pubHandle, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pubHandle.Close() })
	log := newRecLogger()
	pub := newPublisher(t, sqlbroker.SQLite(pubHandle))
	sub, err := sqlbroker.NewSubscriber(sqlbroker.SQLite(handle), sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond, InitializeSchema: true}, log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, "t")
	require.NoError(t, err)
	publish(t, pub, "t", "x")
	receive(t, msgs, 10*time.Second).Ack()
	testdb.Eventually(t, 10*time.Second, "the ack", func() bool { return sub.Stats().Acked == 1 })

	// Take the handle's only connection; the next claim waits for it.
	c, err := handle.Conn(ctx)
	require.NoError(t, err)
	release := onceCleanup(t, func() { _ = c.Close() })
	waited := handle.Stats().WaitCount
	publish(t, pub, "t", "y")
	testdb.Eventually(t, 10*time.Second, "the claim to wait for the connection", func() bool {
		return handle.Stats().WaitCount > waited
	})
	sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	start := time.Now()
	_, err = sub.Shutdown(sctx)
	require.NoError(t, err, "Shutdown waited for the claim's connection")
	assert.Less(t, time.Since(start), time.Second)
	returned := time.Now()
	release()
	sqliteQuiet(t, log, sub, returned, 1500*time.Millisecond)
	var n int
	require.NoError(t, pubHandle.QueryRow(`SELECT count(*) FROM `+tables("t").Claims).Scan(&n))
	assert.Equal(t, 0, n, "a claim ran after Shutdown returned")
	assert.Equal(t, int64(1), sub.Stats().Claimed)
}
