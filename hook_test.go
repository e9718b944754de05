package sqlbroker_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// hookedBroker is a broker on a URL of its own application_name (PostgreSQL) or on a SQLite
// file of its own, with a Router and a hook on it, and the topics' tables created.
type hookedBroker struct {
	broker *sqlbroker.Broker
	pub    *sqlbroker.Publisher
	sub    *sqlbroker.Subscriber
	router *message.Router
	hook   *sqlbroker.RouterHook
	app    string // PostgreSQL's
	raw    rawSQL // the same database, for the test's own SQL
}

func newHookedBroker(t *testing.T, cfg sqlbroker.SubscriberConfig, closeTimeout time.Duration, topics ...string) *hookedBroker {
	t.Helper()
	return newHookedBrokerOn(t, "pgx", cfg, closeTimeout, topics...)
}

// newHookedBrokerOn is newHookedBroker on the database named db: "pgx" or "sqlite".
func newHookedBrokerOn(t *testing.T, db string, cfg sqlbroker.SubscriberConfig, closeTimeout time.Duration, topics ...string) *hookedBroker {
	t.Helper()
	scheme := "postgres"
	if db == "sqlite" {
		scheme = "sqlite"
	}
	url, app, raw, _ := brokerTarget(t, scheme)
	broker, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = broker.Close() })
	require.NoError(t, broker.InitializeSchema(context.Background(), sqlbroker.PublisherConfig{}, topics...))
	pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{})
	require.NoError(t, err)
	if cfg.ConsumerGroup == "" {
		cfg.ConsumerGroup = "g"
	}
	sub, err := broker.NewSubscriber(cfg)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: closeTimeout}, watermill.NopLogger{})
	require.NoError(t, err)
	hook := sqlbroker.NewRouterHook(broker, sqlbroker.RouterHookConfig{CloseTimeout: closeTimeout})
	router.AddPlugin(hook.Plugin)
	return &hookedBroker{broker: broker, pub: pub, sub: sub, router: router, hook: hook, app: app, raw: raw}
}

// run runs the Router until the test ends, and returns Run's result channel.
func (hb *hookedBroker) run(t *testing.T, ctx context.Context) <-chan error {
	t.Helper()
	runErr := make(chan error, 1)
	go func() { runErr <- hb.router.Run(ctx) }()
	select {
	case <-hb.router.Running():
	case err := <-runErr:
		t.Fatalf("router.Run: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the Router is not running after 10s")
	}
	return runErr
}

// leftOnServer asserts that no lock and, once the server ended them, no backend of the
// library is left. On SQLite, with no server to ask, it asserts that the library holds no
// write lock: another connection takes it at once.
func (hb *hookedBroker) leftOnServer(t *testing.T) {
	t.Helper()
	if hb.raw.lite != nil {
		hb.raw.writeLockFree(t)
		return
	}
	testdb.Eventually(t, 5*time.Second, "no backend of the library left", func() bool { return backends(t, hb.app) == 0 })
	assert.Equal(t, 0, queryInt(t, "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1", hb.app))
}

func waitClosed[T any](t *testing.T, ch <-chan T, d time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(d):
		t.Fatalf("%s: not within %s", what, d)
	}
}

// Stopping one of two handlers with Handler.Stop is not the Router closing: that handler
// stops alone and promptly, the claims its subscription held ahead are given back, the other
// handler goes on, the owner is not shut down and its pool stays open. The Router's Close
// then shuts the owner down (S12). On PostgreSQL and SQLite.
func TestRouterHook_S12_handlerStopStopsAlone(t *testing.T) {
	t.Parallel()
	for _, db := range []string{"pgx", "sqlite"} {
		t.Run(db, func(t *testing.T) {
			t.Parallel()
			testHandlerStopStopsAlone(t, db)
		})
	}
}

func testHandlerStopStopsAlone(t *testing.T, db string) {
	ctx := context.Background()
	topicA, topicB := testdb.Topic(t, ""), testdb.Topic(t, "")
	hb := newHookedBrokerOn(t, db, sqlbroker.SubscriberConfig{MaxInFlight: 2, BatchSize: 4}, 20*time.Second, topicA, topicB)
	publish(t, hb.pub, topicA, numbered(20)...)

	startedA := make(chan struct{}, 20)
	releaseA := make(chan struct{})
	handlerA := hb.router.AddNoPublisherHandler("a", topicA, hb.sub, func(*message.Message) error {
		startedA <- struct{}{}
		<-releaseA
		return nil
	})
	gotB := make(chan string, 20)
	hb.router.AddNoPublisherHandler("b", topicB, hb.sub, func(msg *message.Message) error {
		gotB <- string(msg.Payload)
		return nil
	})
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := hb.run(t, runCtx)

	for range 2 {
		waitClosed(t, startedA, 10*time.Second, "a message of topic A in a handler")
	}
	claimsA := func() int { return hb.raw.claimed(t, tables(topicA).Claims, "token > 0") }
	testdb.Eventually(t, 10*time.Second, "claims held ahead on topic A", func() bool { return claimsA() > 2 })

	handlerA.Stop()
	close(releaseA) // the two in work finish and are acked
	waitClosed(t, handlerA.Stopped(), 5*time.Second, "handler A stopped")
	testdb.Eventually(t, 5*time.Second, "topic A's claims settled or given back", func() bool { return claimsA() == 0 })

	_, err := hb.hook.Report()
	require.ErrorIs(t, err, sqlbroker.ErrNotShutDown, "stopping one handler shut the owner down")
	// Handler B still delivers, through the same pool.
	publish(t, hb.pub, topicB, "after-stop")
	select {
	case p := <-gotB:
		assert.Equal(t, "after-stop", p)
	case <-time.After(10 * time.Second):
		t.Fatal("handler B delivered nothing after handler A stopped")
	}
	require.NoError(t, hb.pub.Publish(topicA, message.NewMessage(watermill.NewUUID(), []byte("still open"))))

	require.NoError(t, hb.router.Close())
	require.NoError(t, <-runErr)
	rep, err := hb.hook.Report()
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Subscriptions, "the subscription of handler B")
	assert.Positive(t, rep.ConnectionsClosed)
	assert.ErrorIs(t, hb.pub.Publish(topicB, message.NewMessage(watermill.NewUUID(), nil)), sqlbroker.ErrClosed)
	hb.leftOnServer(t)
}

// A Subscribe of its own on a hooked subscriber, whose context ends, stops alone: its channel
// closes at once and the owner is not shut down while the Router runs (S12). On PostgreSQL
// and SQLite.
func TestRouterHook_S12_manualSubscribeEndDoesNotShutDown(t *testing.T) {
	t.Parallel()
	for _, db := range []string{"pgx", "sqlite"} {
		t.Run(db, func(t *testing.T) {
			t.Parallel()
			testManualSubscribeEndDoesNotShutDown(t, db)
		})
	}
}

func testManualSubscribeEndDoesNotShutDown(t *testing.T, db string) {
	ctx := context.Background()
	topicA, topicB := testdb.Topic(t, ""), testdb.Topic(t, "")
	hb := newHookedBrokerOn(t, db, sqlbroker.SubscriberConfig{}, 20*time.Second, topicA, topicB)
	gotA := make(chan string, 20)
	hb.router.AddNoPublisherHandler("a", topicA, hb.sub, func(msg *message.Message) error {
		gotA <- string(msg.Payload)
		return nil
	})
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := hb.run(t, runCtx)

	subCtx, stop := context.WithCancel(ctx)
	msgs, err := hb.sub.Subscribe(subCtx, topicB)
	require.NoError(t, err)
	publish(t, hb.pub, topicB, "manual")
	receive(t, msgs, 10*time.Second).Ack()
	stop()
	closed := make(chan struct{})
	go func() {
		for range msgs {
		}
		close(closed)
	}()
	waitClosed(t, closed, 5*time.Second, "the channel of the manual subscription closed")

	_, err = hb.hook.Report()
	require.ErrorIs(t, err, sqlbroker.ErrNotShutDown, "the end of a manual subscription shut the owner down")
	publish(t, hb.pub, topicA, "after")
	select {
	case p := <-gotA:
		assert.Equal(t, "after", p)
	case <-time.After(10 * time.Second):
		t.Fatal("the Router's handler delivered nothing after the manual subscription ended")
	}

	cancel()
	require.NoError(t, <-runErr)
	rep, err := hb.hook.Report()
	require.NoError(t, err)
	t.Logf("%+v", rep)
	assert.Equal(t, 1, rep.Subscriptions)
	hb.leftOnServer(t)
}

// The report counts what the Router's shutdown did whichever way it began: in advisory mode,
// with claims held ahead, router.Close() and cancelling Run's context report the same
// subscriptions, claims given back and locks released (S12). PostgreSQL only: the advisory
// mode is PostgreSQL's.
func TestRouterHook_S12_reportSameByCloseAndCancel(t *testing.T) {
	t.Parallel()
	const inWork, ahead = 4, 4
	reports := map[string]sqlbroker.CloseReport{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, stopBy := range []string{"close", "cancel"} {
		wg.Add(1)
		t.Run(stopBy, func(t *testing.T) {
			defer wg.Done()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			cfg := sqlbroker.SubscriberConfig{ClaimMode: sqlbroker.ClaimAdvisoryLock, MaxInFlight: inWork, BatchSize: ahead}
			hb := newHookedBroker(t, cfg, 10*time.Second, topic)
			publish(t, hb.pub, topic, numbered(30)...)
			started := make(chan struct{}, 30)
			release := make(chan struct{})
			hb.router.AddNoPublisherHandler("h", topic, hb.sub, func(*message.Message) error {
				started <- struct{}{}
				<-release
				return nil
			})
			runCtx, cancel := context.WithCancel(ctx)
			defer cancel()
			runErr := hb.run(t, runCtx)
			for range inWork {
				waitClosed(t, started, 10*time.Second, "a message in a handler")
			}
			held := func() int {
				return claimedPG(t, tables(topic).Claims, "visible_at = 'infinity'")
			}
			testdb.Eventually(t, 10*time.Second, "claims held ahead", func() bool { return held() == inWork+ahead })

			closed := make(chan error, 1)
			if stopBy == "close" {
				go func() { closed <- hb.router.Close() }()
			} else {
				cancel()
				closed <- nil
			}
			// The claims ahead are given back while the handlers still work.
			testdb.Eventually(t, 10*time.Second, "the claims ahead given back", func() bool { return held() == inWork })
			close(release)
			require.NoError(t, <-runErr)
			require.NoError(t, <-closed)
			rep, err := hb.hook.Report()
			require.NoError(t, err)
			t.Logf("%s: %+v", stopBy, rep)
			assert.Equal(t, 1, rep.Subscriptions)
			assert.Equal(t, ahead, rep.ClaimsReleased)
			assert.Equal(t, ahead, rep.LocksReleased, "the locks of the claims ahead; the handlers' acks released theirs")
			assert.Equal(t, 0, rep.DeliveriesInWork)
			hb.leftOnServer(t)
			mu.Lock()
			reports[stopBy] = rep
			mu.Unlock()
		})
	}
	wg.Wait()
	c, k := reports["close"], reports["cancel"]
	// ConnectionsClosed is left out: it counts the pool's open connections, which vary.
	assert.Equal(t, [3]int{c.Subscriptions, c.ClaimsReleased, c.LocksReleased}, [3]int{k.Subscriptions, k.ClaimsReleased, k.LocksReleased},
		"router.Close() and Run's ctx cancelled report differently")
}

// fakeOwner is a Shutdowner of a user's own.
type fakeOwner struct {
	mu    sync.Mutex
	calls int
}

func (f *fakeOwner) Shutdown(context.Context) (sqlbroker.CloseReport, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	return sqlbroker.CloseReport{Subscriptions: 7}, nil
}

func (f *fakeOwner) shutdowns() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

// A Shutdowner of one's own can own the hook: a handler stopped alone does not shut it down,
// the Router's closing does, once (S12).
func TestRouterHook_S12_ownShutdowner(t *testing.T) {
	t.Parallel()
	owner := &fakeOwner{}
	hook := sqlbroker.NewRouterHook(owner, sqlbroker.RouterHookConfig{CloseTimeout: 5 * time.Second})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddPlugin(hook.Plugin)
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer ps.Close()
	a := router.AddNoPublisherHandler("a", "a", ps, func(*message.Message) error { return nil })
	router.AddNoPublisherHandler("b", "b", ps, func(*message.Message) error { return nil })
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(context.Background()) }()
	waitClosed(t, router.Running(), 10*time.Second, "the Router running")

	a.Stop()
	waitClosed(t, a.Stopped(), 5*time.Second, "handler a stopped")
	select {
	case <-hook.Done():
		t.Fatal("stopping one handler shut the owner down")
	case <-time.After(100 * time.Millisecond):
	}

	require.NoError(t, router.Close())
	require.NoError(t, <-runErr)
	rep, err := hook.Report() // router.Run waited for the shutdown
	require.NoError(t, err)
	assert.Equal(t, 7, rep.Subscriptions)
	assert.Equal(t, 1, owner.shutdowns())
}

// The owner's only handler stopped while a handler of another subscriber runs on: the Router
// is not closing, so the owner is not shut down and its publishers still publish (S12). On
// PostgreSQL and SQLite.
func TestRouterHook_S12_ownHandlerStoppedWhileOthersRun(t *testing.T) {
	t.Parallel()
	for _, db := range []string{"pgx", "sqlite"} {
		t.Run(db, func(t *testing.T) {
			t.Parallel()
			testOwnHandlerStoppedWhileOthersRun(t, db)
		})
	}
}

func testOwnHandlerStoppedWhileOthersRun(t *testing.T, db string) {
	topic := testdb.Topic(t, "")
	hb := newHookedBrokerOn(t, db, sqlbroker.SubscriberConfig{}, 10*time.Second, topic)
	own := hb.router.AddNoPublisherHandler("own", topic, hb.sub, func(*message.Message) error { return nil })
	ps := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer ps.Close()
	hb.router.AddNoPublisherHandler("other", "other", ps, func(*message.Message) error { return nil })
	runErr := hb.run(t, context.Background())

	own.Stop()
	waitClosed(t, own.Stopped(), 5*time.Second, "the owner's handler stopped")
	select {
	case <-hb.hook.Done():
		t.Fatal("the owner was shut down while a handler of the Router still runs")
	case <-time.After(200 * time.Millisecond):
	}
	require.NoError(t, hb.pub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil)))

	require.NoError(t, hb.router.Close())
	require.NoError(t, <-runErr)
	_, err := hb.hook.Report()
	require.NoError(t, err)
	hb.leftOnServer(t)
}
