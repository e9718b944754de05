package sqlbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// brokerURL is the test database's URL with an application_name of the test's own, so that
// the broker's backends can be counted in pg_stat_activity.
func brokerURL(t *testing.T, scheme string) (string, string) {
	app := "sqlbroker_" + strings.ToLower(watermill.NewShortUUID())
	u := testdb.URL()
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	u = strings.Replace(u, "postgres://", scheme+"://", 1) + sep + "application_name=" + app
	return u, app
}

// brokerTarget returns a URL for sqlbroker.Open on a database of its own for this test and a
// handle on the same data for the test's own statements: scheme is "sqlite" (a file of the
// test) or a PostgreSQL scheme of brokerURL, whose application name app marks the broker's
// backends (empty on SQLite).
func brokerTarget(t *testing.T, scheme string) (url, app string, raw rawSQL, handle *sql.DB) {
	t.Helper()
	if scheme != "sqlite" {
		url, app = brokerURL(t, scheme)
		return url, app, rawSQL{pg: testdb.Pgx(t)}, nil
	}
	path := testdb.SQLitePath(t)
	h, err := sql.Open("sqlite", "file:"+path)
	require.NoError(t, err)
	t.Cleanup(func() { _ = h.Close() })
	return "sqlite:" + path + "?mode=rwc", "", rawSQL{lite: h}, h
}

func backends(t *testing.T, app string) int {
	return queryInt(t, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", app)
}

// A claim blocked on the server when its subscription stops is cancelled there, and Shutdown
// returns only once the server has ended it: no backend of the library is left running it,
// and none holds a lock on the topic's tables (S3). PostgreSQL only: it blocks the claim on a
// row lock and reads pg_stat_activity and pg_locks; on SQLite a claim waits on the database's
// write lock instead, which TestSQLite_shutdownInterruptsClaimInFlight holds.
func TestShutdown_S3_cancelledClaimRollsBack(t *testing.T) {
	t.Parallel()
	// pgx, and lib/pq with prepared statements, whose claims run on the driver's connection.
	for _, d := range []database{{"pgx", pgxDB}, {"libpq-prepared", func(t *testing.T) sqlbroker.DB { return sqlbroker.StdSQLPrepared(testdb.Std(t)) }}} {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testCancelledClaimRollsBack(t, d.open(t))
		})
	}
}

func testCancelledClaimRollsBack(t *testing.T, db sqlbroker.DB) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, db)
	publish(t, pub, topic, "x")
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 10 * time.Millisecond})
	require.NoError(t, sub.SubscribeInitialize(topic))

	// Hold the group's row: the next claim waits on it.
	seed := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g"})
	seedMsgs, err := seed.Subscribe(ctx, topic)
	require.NoError(t, err)
	receive(t, seedMsgs, 10*time.Second).Ack()
	require.NoError(t, seed.Close())
	publish(t, pub, topic, "y") // waiting, and committed before the lock below is taken
	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, "SELECT 1 FROM "+tables(topic).Groups+" WHERE consumer_group = 'g' FOR UPDATE")
	require.NoError(t, err)

	_, err = sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	waiting := func() int {
		return queryInt(t, `SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`, tables(topic).ClaimsName)
	}
	testdb.Eventually(t, 10*time.Second, "a claim waiting on the group's row", func() bool { return waiting() == 1 })

	rep, err := sub.Shutdown(ctx)
	require.NoError(t, err)
	assert.Equal(t, 1, rep.QueriesCancelled)
	assert.Equal(t, 0, queryInt(t, `SELECT count(*) FROM pg_stat_activity WHERE state <> 'idle' AND query LIKE '%' || $1 || '%' AND pid <> pg_backend_pid()`, tables(topic).ClaimsName),
		"a backend still runs the claim after Shutdown returned")
	var txPID int
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&txPID))
	assert.Equal(t, 0, queryInt(t, `SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
		WHERE c.relname IN ($1, $2, $3) AND l.pid <> $4 AND l.pid <> pg_backend_pid()`,
		tables(topic).MessagesName, tables(topic).GroupsName, tables(topic).ClaimsName, txPID), "a lock on the topic's tables is left")
}

// Lease mode: a delivery still in work at shutdown keeps its lease, which runs out: an ack
// that comes after Shutdown returned is not applied (nothing of the subscriber waits for it
// any more, S11), and both messages return to the queue after the lease, for a new
// subscriber (S4). On PostgreSQL and SQLite.
func TestShutdown_S4_leaseModeDeliveriesKeepTheirLeases(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testLeaseModeDeliveriesKeepTheirLeases(t, d)
		})
	}
}

func testLeaseModeDeliveriesKeepTheirLeases(t *testing.T, d database) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	db, raw := d.openSQL(t)
	pub := newPublisher(t, db)
	sent := publish(t, pub, topic, "acked late", "never acked")
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", LeaseTTL: 2 * time.Second, LeaseRenewInterval: 200 * time.Millisecond})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	got := map[string]*message.Message{}
	for range 2 {
		m := receive(t, msgs, 10*time.Second)
		got[string(m.Payload)] = m
	}
	rep, err := sub.Shutdown(ctx)
	stopped := time.Now()
	require.NoError(t, err)
	assert.Equal(t, 2, rep.DeliveriesInWork)
	assert.Equal(t, 2, rep.LeasesLeft)

	got["acked late"].Ack() // after Shutdown: not applied
	holds(t, 500*time.Millisecond, "the late ack not applied", func() bool {
		return raw.claimed(t, tables(topic).Claims, "token > 0") == 2
	})

	next := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
	again, err := next.Subscribe(ctx, topic)
	require.NoError(t, err)
	back := map[string]string{}
	for range 2 {
		m := receive(t, again, 10*time.Second)
		back[m.UUID] = m.Metadata.Get(sqlbroker.MetadataAttempt)
		m.Ack()
	}
	assert.GreaterOrEqual(t, time.Since(stopped), time.Second, "redelivered before the leases ran out")
	assert.Equal(t, map[string]string{sent[0].UUID: "2", sent[1].UUID: "2"}, back)
	assert.Equal(t, int64(0), sub.Stats().Acked)
}

// A pool built from a URL closes last: new statements fail after Shutdown, a lease-mode
// settlement after Shutdown is not applied and its message returns after the lease,
// and ConnectionsClosed is the drop in the broker's backends. The caller's own pool stays
// open (S6, S7). On SQLite too, where the backends are not there to count: the broker's
// pool of a sqlite: URL closes, and the caller's handle on the same file stays open.
func TestShutdown_S6_S7_builtPoolClosesLastCallersPoolStaysOpen(t *testing.T) {
	t.Parallel()
	for _, scheme := range []string{"postgres", "libpq+postgres", "sqlite"} {
		t.Run(scheme, func(t *testing.T) {
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			url, app, _, h := brokerTarget(t, scheme)
			var callers sqlbroker.DB
			if h != nil {
				callers = sqlbroker.SQLite(h)
			} else {
				callers = pgxDB(t)
			}
			broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
			require.NoError(t, err)
			defer broker.Close()
			if app != "" {
				assert.Equal(t, 0, backends(t, app), "Open connected")
			}

			require.NoError(t, broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
			pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{})
			require.NoError(t, err)
			publish(t, pub, topic, "x")
			// One message in flight: once it is handed out, only lease extension uses the pool,
			// so the number of its connections holds still while it is measured.
			sub, err := broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "g", MaxInFlight: 1, LeaseTTL: 3 * time.Second, LeaseRenewInterval: 200 * time.Millisecond})
			require.NoError(t, err)
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			m := receive(t, msgs, 10*time.Second)
			if scheme == "postgres" {
				// pgx pools also get the process's LISTEN connection, opened beside the first
				// claim: count the backends once it is in place.
				testdb.Eventually(t, 10*time.Second, "the LISTEN connection", func() bool {
					return queryInt(t, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %'", app) == 1
				})
			}

			before := -1
			if app != "" {
				before = backends(t, app)
				require.Positive(t, before)
			}
			rep, err := broker.Shutdown(ctx)
			require.NoError(t, err)
			if app != "" {
				testdb.Eventually(t, 5*time.Second, "the broker's backends to end", func() bool { return backends(t, app) == 0 })
				assert.Equal(t, before, rep.ConnectionsClosed)
			} else {
				assert.Positive(t, rep.ConnectionsClosed)
			}

			err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil))
			assert.ErrorIs(t, err, sqlbroker.ErrClosed)
			_, err = broker.NewSubscriber(sqlbroker.SubscriberConfig{})
			assert.ErrorIs(t, err, sqlbroker.ErrClosed)

			m.Ack() // after Shutdown: not applied, and nothing tries; the row returns after its lease
			assert.Equal(t, int64(0), sub.Stats().Acked)

			// The caller's pool is the caller's: still open.
			other := newSubscriberOn(t, callers, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
			again, err := other.Subscribe(ctx, topic)
			require.NoError(t, err)
			m2 := receive(t, again, 10*time.Second)
			assert.Equal(t, m.UUID, m2.UUID)
			m2.Ack()
		})
	}
}

// Publishers taken before Shutdown refuse every publish after it with ErrClosed, and no row is
// written after Shutdown returns: every Publish that returned nil has its row (S8), including
// a publisher bound to a caller's transaction. On PostgreSQL and SQLite.
func TestShutdown_S8_publishersRefuseAfterShutdown(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testPublishersRefuseAfterShutdown(t, d)
		})
	}
}

func testPublishersRefuseAfterShutdown(t *testing.T, d database) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	scheme := "postgres"
	if d.name == "sqlite" {
		scheme = "sqlite"
	}
	url, _, raw, _ := brokerTarget(t, scheme)
	countMessages := func(t *testing.T, topic string) int {
		return raw.count(t, "SELECT count(*) FROM "+tables(topic).Messages)
	}
	broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{MaxConns: 20}, nil)
	require.NoError(t, err)
	require.NoError(t, broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
	pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{})
	require.NoError(t, err)

	var mu sync.Mutex
	var ok []string
	var closedErrs, otherErrs int
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				msg := message.NewMessage(watermill.NewUUID(), []byte("x"))
				err := pub.Publish(topic, msg)
				mu.Lock()
				switch {
				case err == nil:
					ok = append(ok, msg.UUID)
				case errors.Is(err, sqlbroker.ErrClosed):
					closedErrs++
				default:
					otherErrs++
				}
				mu.Unlock()
			}
		}()
	}
	testdb.Eventually(t, 10*time.Second, "publishes to flow", func() bool { mu.Lock(); defer mu.Unlock(); return len(ok) > 200 })
	_, err = broker.Shutdown(ctx)
	require.NoError(t, err)
	// Every Publish that returns nil wrote its row, so once the publishers are stopped, as many
	// successes as rows counted right after Shutdown means no publish succeeded after it.
	// (Counting the successes at Shutdown instead would race: a Publish that returned nil
	// before Shutdown may be recorded by its goroutine only after.)
	rows := countMessages(t, topic)
	testdb.Eventually(t, 10*time.Second, "publishes to be refused", func() bool { mu.Lock(); defer mu.Unlock(); return closedErrs >= 16 })
	close(stop)
	wg.Wait()

	assert.Equal(t, len(ok), rows, "successful publishes and rows at Shutdown differ: a Publish returned nil after Shutdown returned, or wrote nothing")
	assert.Equal(t, 0, otherErrs)
	assert.Equal(t, rows, countMessages(t, topic), "a row was written after Shutdown returned")
	var missing int
	for _, id := range ok {
		if raw.count(t, "SELECT count(*) FROM "+tables(topic).Messages+" WHERE uuid = $1", id) != 1 {
			missing++
		}
	}
	assert.Zero(t, missing)

	// A publisher bound to a caller's transaction, taken before the shutdown, refuses too.
	broker2, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	var txDB sqlbroker.DB
	if raw.lite != nil {
		tx, err := raw.lite.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback() }()
		txDB = sqlbroker.SQLiteTx(tx)
	} else {
		tx, err := testdb.Pgx(t).Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		txDB = sqlbroker.PgxTx(tx)
	}
	txPub, err := broker2.NewTxPublisher(txDB, sqlbroker.PublisherConfig{})
	require.NoError(t, err)
	require.NoError(t, broker2.Close())
	assert.ErrorIs(t, txPub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)), sqlbroker.ErrClosed)
}

// With the hook, router.Run returns after the handlers drained and the library shut down,
// whether the Router was closed or its context cancelled; the report is there to read and no
// connection of the library is left (S10). On SQLite too, where no server is there to ask
// about backends and locks: the write lock must be free, and the claims left are read from the
// file.
func TestShutdown_S10_routerHook(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ db, stopBy string }{{"pgx", "close"}, {"pgx", "cancel"}, {"sqlite", "close"}, {"sqlite", "cancel"}} {
		stopBy := c.stopBy
		t.Run(c.db+"/"+stopBy, func(t *testing.T) {
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			scheme := "postgres"
			if c.db == "sqlite" {
				scheme = "sqlite"
			}
			url, app, raw, _ := brokerTarget(t, scheme)
			broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
			require.NoError(t, err)
			require.NoError(t, broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
			pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{})
			require.NoError(t, err)
			sub, err := broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "g"})
			require.NoError(t, err)
			for i := range 20 {
				publish(t, pub, topic, fmt.Sprint(i))
			}

			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
			require.NoError(t, err)
			hook := sqlbroker.NewRouterHook(broker, sqlbroker.RouterHookConfig{CloseTimeout: 5 * time.Second})
			router.AddPlugin(hook.Plugin)
			started := make(chan struct{}, 20)
			release := make(chan struct{})
			var handled sync.WaitGroup
			router.AddNoPublisherHandler("slow", topic, sub, func(msg *message.Message) error {
				handled.Add(1)
				defer handled.Done()
				started <- struct{}{}
				<-release
				// Still in work after the Router began to close: the lease is still being
				// extended, so the ack applies.
				return nil
			})
			runCtx, cancel := context.WithCancel(ctx)
			defer cancel()
			runErr := make(chan error, 1)
			go func() { runErr <- router.Run(runCtx) }()
			<-started

			closed := make(chan error, 1)
			if stopBy == "close" {
				go func() { closed <- router.Close() }()
			} else {
				cancel()
				closed <- nil
			}
			_, err = hook.Report()
			assert.ErrorIs(t, err, sqlbroker.ErrNotShutDown, "shut down before the handlers drained")
			time.Sleep(100 * time.Millisecond) // the handlers are still in work meanwhile
			close(release)
			require.NoError(t, <-runErr)
			require.NoError(t, <-closed)

			rep, err := hook.Report()
			require.NoError(t, err)
			assert.Equal(t, 0, rep.DeliveriesInWork, "Run returned before the handlers drained")
			assert.Equal(t, 1, rep.Subscriptions)
			assert.Positive(t, rep.ConnectionsClosed)
			if app != "" {
				// The library has closed its connections; the server ends their backends a moment later.
				testdb.Eventually(t, 5*time.Second, "no backend of the library left", func() bool { return backends(t, app) == 0 })
				assert.Equal(t, 0, queryInt(t, "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1", app))
			} else {
				raw.writeLockFree(t)
			}
			assert.ErrorIs(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)), sqlbroker.ErrClosed)
			// What the handlers acked is settled; what was claimed and not handed out was given back.
			assert.Equal(t, 0, raw.claimed(t, tables(topic).Claims, "token > 0"))
		})
	}
}

// Open checks the URL and never shows its password.
func TestOpen_badURLs(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"", "not a url", "redis://u:secret@h/db", "mysql://u:secret@h", "postgres://u:secret@/db", "postgres://u:secret@h:port/db"} {
		_, err := sqlbroker.Open(u, sqlbroker.BrokerConfig{}, nil)
		require.Error(t, err, u)
		assert.NotContains(t, err.Error(), "secret", u)
	}
	// A server that is not there fails fast on first use, naming the host.
	b, err := sqlbroker.Open("postgres://u:secret@127.0.0.1:1/db", sqlbroker.BrokerConfig{ConnectTimeout: time.Second}, nil)
	require.NoError(t, err)
	defer b.Close()
	assert.NotContains(t, b.String(), "secret")
	start := time.Now()
	err = b.InitializeSchema(context.Background(), sqlbroker.PublisherConfig{}, "t")
	require.Error(t, err)
	assert.Less(t, time.Since(start), 10*time.Second)
	assert.Contains(t, err.Error(), "127.0.0.1")
	assert.NotContains(t, err.Error(), "secret")
}

// PrepareStatements gives a libpq+postgres:// broker a pool that prepares the library's
// statements per connection, and a publish and a delivery run on it; on the URLs of pgx and
// SQLite, which prepare statements by themselves, it is refused by name.
func TestOpen_prepareStatements(t *testing.T) {
	t.Parallel()
	for _, scheme := range []string{"postgres", "sqlite"} {
		url, _, _, _ := brokerTarget(t, scheme)
		_, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{PrepareStatements: true}, nil)
		var ce *sqlbroker.ConfigError
		require.ErrorAs(t, err, &ce, scheme)
		assert.Equal(t, "PrepareStatements", ce.Field, scheme)
	}
	url, _, _, _ := brokerTarget(t, "libpq+postgres")
	plain, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	defer plain.Close()
	assert.False(t, sqlbroker.BrokerPrepares(plain))

	b, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{PrepareStatements: true}, nil)
	require.NoError(t, err)
	defer b.Close()
	require.True(t, sqlbroker.BrokerPrepares(b))
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	require.NoError(t, b.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
	pub, err := b.NewPublisher(sqlbroker.PublisherConfig{})
	require.NoError(t, err)
	sent := publish(t, pub, topic, "prepared")
	sub, err := b.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "g"})
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	assert.Equal(t, sent[0].UUID, m.UUID)
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool { return sub.Stats().Acked == 1 })
}
