// Package tests runs the cross-driver and cross-mode suites: Watermill's universal Pub/Sub
// tests once per driver and claim mode.
package tests

import (
	"context"
	"database/sql"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m, closeAdvisoryStd, closeBounded) }

type driver struct {
	name string
	db   func(t *testing.T) sqlbroker.DB
}

var drivers = []driver{
	{"pgx", func(t *testing.T) sqlbroker.DB { return sqlbroker.Pgx(testdb.Pgx(t)) }},
	{"libpq", func(t *testing.T) sqlbroker.DB { return sqlbroker.StdSQL(testdb.Std(t)) }},
}

// restartCommand restarts the local PostgreSQL for TestReconnect. Watermill's TestReconnect
// starts each of its restarts in a goroutine of its own, and the reconnect pass runs the test
// for several configurations at once: two `pg_ctlcluster restart` that overlap make one of
// them exit 1, which fails the test whatever the Pub/Sub did (about one pass in six). The
// default command restarts under a file lock; a request that finds a restart running waits
// for it to end and counts it as its own, so requests neither overlap nor queue up (a queue
// of restarts would outlast the tests that asked for them).
func restartCommand() []string {
	if cmd := os.Getenv("SQLBROKER_TEST_RESTART_COMMAND"); cmd != "" {
		return []string{"sh", "-c", cmd}
	}
	return []string{"sh", "-c", `restart="pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql | sort -n | tail -1) main restart"
lock="${TMPDIR:-/tmp}/sqlbroker-test-pg-restart.lock"
if command -v flock >/dev/null; then flock -n -o -E 75 "$lock" $restart || { [ $? = 75 ] && flock "$lock" true; }; exit; fi
exec $restart`}
}

// universalFeatures are the Features of the library. RestartServiceCommand is left out under
// the race detector: Watermill's TestReconnect appends to a slice in one goroutine and reads
// it in another without synchronisation (pubsub/tests/test_pubsub.go, v1.5.1), which the race
// detector reports against whatever Pub/Sub runs it. `make test` runs the reconnect tests in a
// second pass without -race.
func universalFeatures(ordered bool) tests.Features {
	var restart []string
	if !raceEnabled {
		restart = restartCommand()
	}
	return tests.Features{
		ConsumerGroups:                      true,
		ExactlyOnceDelivery:                 false,
		GuaranteedOrder:                     ordered,
		GuaranteedOrderWithSingleSubscriber: ordered,
		Persistent:                          true,
		NewSubscriberReceivesOldMessages:    true,
		RestartServiceCommand:               restart,
	}
}

func constructors(d driver, mode sqlbroker.ClaimMode, ordered bool) (tests.PubSubConstructor, tests.ConsumerGroupPubSubConstructor) {
	return constructorsKeyed(d, mode, ordered, false)
}

// constructorsKeyed: with keyed, the subscribers keep order by key, and a message whose
// payload is a number below 100 has that number as its order key: the suite's
// TestPublishSubscribeInOrder puts the message's "type" (0 to 15) there. The suite's other
// messages ("x", empty, or a UUID) have no key: one key for thousands of messages, which the
// suite's 50 subscribers would then take one at a time, tests a hot key's throughput, not
// the Pub/Sub's contract.
func constructorsKeyed(d driver, mode sqlbroker.ClaimMode, ordered, keyed bool) (tests.PubSubConstructor, tests.ConsumerGroupPubSubConstructor) {
	build := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		db := d.db(t)
		logger := watermill.NopLogger{}
		pcfg := sqlbroker.PublisherConfig{InitializeSchema: true}
		if keyed {
			pcfg.OrderKey = suiteOrderKey
		}
		pub, err := sqlbroker.NewPublisher(db, pcfg, logger)
		if err != nil {
			t.Fatal(err)
		}
		cfg := sqlbroker.SubscriberConfig{
			ConsumerGroup:    group,
			ClaimMode:        mode,
			InitializeSchema: true,
			LeaseTTL:         5 * time.Second,
			RetryInterval:    200 * time.Millisecond,
			CloseTimeout:     10 * time.Second,
		}
		if ordered {
			cfg.MaxInFlight = 1
		}
		cfg.OrderByKey = keyed
		sub, err := sqlbroker.NewSubscriber(db, cfg, logger)
		if err != nil {
			t.Fatal(err)
		}
		// Closed again when the test ends (Close is idempotent): the suite's
		// TestPublishSubscribeInOrder closes its fan-in subscriber in a defer whose argument
		// is evaluated at once, then subscribes it, which builds subscribers nothing closes.
		t.Cleanup(func() {
			_ = sub.Close()
			_ = pub.Close()
		})
		watchStall(t, sub)
		if strings.Contains(t.Name(), "/TestReconnect") {
			return gateReconnect(pub, sub)
		}
		return pub, sub
	}
	// Without a group, every subscriber the suite builds is a consumer of its own (like a
	// Kafka consumer without a group): TestNewSubscriberReceivesOldMessages wants each new one
	// to read the topic from its oldest message.
	own := func(t *testing.T) (message.Publisher, message.Subscriber) {
		return build(t, "own_"+watermill.NewShortUUID())
	}
	return own, build
}

// suiteOrderKey is the order key of the keyed suites: a payload that is a number below 100
// (see constructorsKeyed).
func suiteOrderKey(_ string, m *message.Message) (string, error) {
	if n, err := strconv.Atoi(string(m.Payload)); err == nil && n >= 0 && n < 100 {
		return string(m.Payload), nil
	}
	return "", nil
}

func TestUniversal_Lease(t *testing.T) {
	for _, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			pubSub, groupPubSub := constructors(d, sqlbroker.ClaimLease, false)
			tests.TestPubSub(t, universalFeatures(false), pubSub, groupPubSub)
		})
	}
}

// TestUniversal_LeasePrepared runs the suite on lib/pq with the statements prepared once per
// connection (sqlbroker.StdSQLPrepared): every statement of the library goes through the
// prepared path, its arguments and rows converted there, and the reconnect pass checks that
// connections opened again prepare their statements anew.
func TestUniversal_LeasePrepared(t *testing.T) {
	d := driver{"prepared", func(t *testing.T) sqlbroker.DB { return sqlbroker.StdSQLPrepared(testdb.Std(t)) }}
	t.Run(d.name, func(t *testing.T) {
		pubSub, groupPubSub := constructors(d, sqlbroker.ClaimLease, false)
		tests.TestPubSub(t, universalFeatures(false), pubSub, groupPubSub)
	})
}

// TestUniversal_LeaseOrdered runs the suite once more in the ordered configuration: one
// message in flight, one subscriber, so messages arrive in the commit order of their
// publishers. It runs with pgx only: the ordering comes from the claim statement, which is the
// same text for both drivers, and with one message in flight the suite's 50-subscriber tests
// are long enough once.
func TestUniversal_LeaseOrdered(t *testing.T) {
	d := drivers[0]
	t.Run(d.name, func(t *testing.T) {
		pubSub, groupPubSub := constructors(d, sqlbroker.ClaimLease, true)
		tests.TestPubSub(t, universalFeatures(true), pubSub, groupPubSub)
	})
}

// TestUniversal_LeaseKeyed runs the suite with the subscribers ordered by key and, where a
// message's payload is the suite's "type" of TestPublishSubscribeInOrder, that type as its
// key. The whole suite runs without GuaranteedOrder, which Watermill's TestNoAck reads as one
// order for the whole topic; then TestPublishSubscribeInOrder runs with it: order per key
// with many messages in flight, as Kafka keeps it per partition key. Both drivers: the
// ordered claim runs in a transaction, which each driver begins its own way.
func TestUniversal_LeaseKeyed(t *testing.T) {
	for _, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			pubSub, groupPubSub := constructorsKeyed(d, sqlbroker.ClaimLease, false, true)
			tests.TestPubSub(t, universalFeatures(false), pubSub, groupPubSub)
			t.Run("TestPublishSubscribeInOrderPerKey", func(t *testing.T) {
				tests.TestPublishSubscribeInOrder(t, tests.TestContext{TestID: tests.NewTestID(), Features: universalFeatures(true)}, pubSub)
			})
		})
	}
}

func TestUniversal_Advisory(t *testing.T) {
	for _, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			pubSub, groupPubSub := constructors(advisoryDriver(d), sqlbroker.ClaimAdvisoryLock, false)
			tests.TestPubSub(t, universalFeatures(false), pubSub, groupPubSub)
		})
	}
	requireNoLibraryLocks(t)
}

// TestUniversal_AdvisoryPrepared runs the advisory suite on lib/pq with the statements prepared
// once per connection (sqlbroker.StdSQLPrepared): the lock connections' claims, takeovers and
// unlocks go through the prepared path too.
func TestUniversal_AdvisoryPrepared(t *testing.T) {
	d := driver{"prepared", func(t *testing.T) sqlbroker.DB { return sqlbroker.StdSQLPrepared(advisoryStd(t)) }}
	t.Run(d.name, func(t *testing.T) {
		pubSub, groupPubSub := constructors(d, sqlbroker.ClaimAdvisoryLock, false)
		tests.TestPubSub(t, universalFeatures(false), pubSub, groupPubSub)
	})
	requireNoLibraryLocks(t)
}

// requireNoLibraryLocks checks that no advisory lock in the library's namespace is left in
// the test database once a suite is done.
func requireNoLibraryLocks(t *testing.T) {
	t.Helper()
	pool := testdb.Pgx(t)
	testdb.Eventually(t, 15*time.Second, "no advisory lock of the library left", func() bool {
		return libraryLocks(t, pool) == 0
	})
}

// advisoryDriver is d for the advisory suites. database/sql cannot open a connection outside
// its pool, so every advisory subscription keeps one connection of the *sql.DB for its locks:
// the suite's 50 concurrent subscribers need a pool larger than the shared one.
func advisoryDriver(d driver) driver {
	if d.name != "libpq" {
		return d
	}
	return driver{d.name, func(t *testing.T) sqlbroker.DB { return sqlbroker.StdSQL(advisoryStd(t)) }}
}

// boundedMaxConns bounds the pools of the bounded-pool suites, as most services bound theirs.
const boundedMaxConns = 20

var (
	boundedOnce sync.Once
	boundedPgx  *pgxpool.Pool
	boundedStd  *sql.DB
	boundedErr  error
)

// boundedDriver is d on a pool of its own bounded at boundedMaxConns connections.
func boundedDriver(d driver) driver {
	get := func(t *testing.T) {
		t.Helper()
		boundedOnce.Do(func() {
			cfg, err := pgxpool.ParseConfig(testdb.URL())
			if err != nil {
				boundedErr = err
				return
			}
			cfg.MaxConns = boundedMaxConns
			cfg.MaxConnIdleTime = 5 * time.Second
			if boundedPgx, boundedErr = pgxpool.NewWithConfig(context.Background(), cfg); boundedErr != nil {
				return
			}
			if boundedStd, boundedErr = sql.Open("postgres", testdb.URL()); boundedErr != nil {
				return
			}
			boundedStd.SetMaxOpenConns(boundedMaxConns)
			boundedStd.SetMaxIdleConns(boundedMaxConns)
			boundedStd.SetConnMaxIdleTime(5 * time.Second)
		})
		if boundedErr != nil {
			t.Fatal(boundedErr)
		}
	}
	if d.name == "libpq" {
		return driver{d.name, func(t *testing.T) sqlbroker.DB { get(t); return sqlbroker.StdSQL(boundedStd) }}
	}
	return driver{d.name, func(t *testing.T) sqlbroker.DB { get(t); return sqlbroker.Pgx(boundedPgx) }}
}

func closeBounded() {
	if boundedPgx != nil {
		boundedPgx.Close()
	}
	if boundedStd != nil {
		_ = boundedStd.Close()
	}
}

// TestUniversal_BoundedPool runs the suite, in its short form, on pools bounded at 20
// connections: every subscription must be served without starving another. The advisory mode
// runs on pgx only: a pgx pool's lock connections are opened outside it, while each advisory
// subscription on a *sql.DB keeps one of its connections, so a *sql.DB bounded at 20 cannot
// hold the suite's concurrent subscribers; Subscribe then refuses with an error that says how
// many connections are needed (TestAdvisory_C4_boundedStdPoolRefusesClearly).
func TestUniversal_BoundedPool(t *testing.T) {
	features := universalFeatures(false)
	features.ForceShort = true
	for _, run := range []struct {
		mode sqlbroker.ClaimMode
		d    driver
	}{
		{sqlbroker.ClaimLease, drivers[0]},
		{sqlbroker.ClaimLease, drivers[1]},
		{sqlbroker.ClaimAdvisoryLock, drivers[0]},
	} {
		t.Run(run.mode.String()+"/"+run.d.name, func(t *testing.T) {
			pubSub, groupPubSub := constructors(boundedDriver(run.d), run.mode, false)
			tests.TestPubSub(t, features, pubSub, groupPubSub)
		})
	}
	requireNoLibraryLocks(t)
}
