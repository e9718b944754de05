package tests

import (
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// sqliteFeatures are the Features of the library on SQLite: those of PostgreSQL, less the
// restart of a server (SQLite has none: the database is a file of the process).
func sqliteFeatures(ordered bool) tests.Features {
	f := universalFeatures(ordered)
	f.RestartServiceCommand = nil
	return f
}

// sqliteConfig is the suite's subscriber configuration, as on PostgreSQL.
func sqliteConfig(group string, ordered, keyed bool) sqlbroker.SubscriberConfig {
	cfg := sqlbroker.SubscriberConfig{
		ConsumerGroup:    group,
		InitializeSchema: true,
		LeaseTTL:         5 * time.Second,
		RetryInterval:    200 * time.Millisecond,
		CloseTimeout:     10 * time.Second,
		OrderByKey:       keyed,
	}
	if ordered {
		cfg.MaxInFlight = 1
	}
	return cfg
}

// sqliteConstructors build the suite's publishers and subscribers on one SQLite file: through
// a Broker that Open builds for each of them (so the suite's consumers of one group work
// through pools of their own on one file, as processes would), or on one caller's *sql.DB.
// With keyed, as constructorsKeyed.
func sqliteConstructors(t *testing.T, viaOpen, ordered, keyed bool) (tests.PubSubConstructor, tests.ConsumerGroupPubSubConstructor) {
	var shared sqlbroker.DB
	if !viaOpen {
		shared = sqlbroker.SQLite(testdb.SQLite(t))
	}
	return brokerConstructors(testdb.SQLiteURL(t), sqlbroker.BrokerConfig{}, shared, viaOpen, ordered, keyed)
}

// brokerConstructors build the suite's publishers and subscribers, configured by
// sqliteConfig: with viaOpen, each pair through a Broker of its own that Open builds on url;
// otherwise on shared, a caller's pool.
func brokerConstructors(url string, bcfg sqlbroker.BrokerConfig, shared sqlbroker.DB, viaOpen, ordered, keyed bool) (tests.PubSubConstructor, tests.ConsumerGroupPubSubConstructor) {
	pcfg := sqlbroker.PublisherConfig{InitializeSchema: true}
	if keyed {
		pcfg.OrderKey = suiteOrderKey
	}
	build := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		var pub *sqlbroker.Publisher
		var sub *sqlbroker.Subscriber
		var err error
		if viaOpen {
			b, err := sqlbroker.Open(url, bcfg, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = b.Close() }) // runs after the closes below: the pool last
			if pub, err = b.NewPublisher(pcfg); err != nil {
				t.Fatal(err)
			}
			if sub, err = b.NewSubscriber(sqliteConfig(group, ordered, keyed)); err != nil {
				t.Fatal(err)
			}
		} else {
			if pub, err = sqlbroker.NewPublisher(shared, pcfg, nil); err != nil {
				t.Fatal(err)
			}
			if sub, err = sqlbroker.NewSubscriber(shared, sqliteConfig(group, ordered, keyed), nil); err != nil {
				t.Fatal(err)
			}
		}
		t.Cleanup(func() {
			_ = sub.Close()
			_ = pub.Close()
		})
		return pub, sub
	}
	own := func(t *testing.T) (message.Publisher, message.Subscriber) {
		return build(t, "own_"+watermill.NewShortUUID())
	}
	return own, build
}

// TestUniversal_SQLite runs Watermill's universal suite in lease mode on SQLite, through Open
// and through sqlbroker.SQLite on a caller's *sql.DB.
func TestUniversal_SQLite(t *testing.T) {
	for _, run := range []struct {
		name    string
		viaOpen bool
	}{{"open", true}, {"sqldb", false}} {
		t.Run(run.name, func(t *testing.T) {
			pubSub, groupPubSub := sqliteConstructors(t, run.viaOpen, false, false)
			tests.TestPubSub(t, sqliteFeatures(false), pubSub, groupPubSub)
		})
	}
}

// TestUniversal_SQLiteOrdered runs the suite in the ordered configuration (one message in
// flight, one subscriber), through Open. One message at a time through SQLite's single writer
// under -race takes longer than the rest of the universal pass together (its
// TestContinueAfterSubscribeClose alone ran past two minutes), so it runs only when
// SQLBROKER_TEST_SQLITE_ORDERED=1; PostgreSQL's ordered run stays in every pass.
func TestUniversal_SQLiteOrdered(t *testing.T) {
	if os.Getenv("SQLBROKER_TEST_SQLITE_ORDERED") != "1" {
		t.Skip("set SQLBROKER_TEST_SQLITE_ORDERED=1 to run the ordered suite on SQLite")
	}
	pubSub, groupPubSub := sqliteConstructors(t, true, true, false)
	tests.TestPubSub(t, sqliteFeatures(true), pubSub, groupPubSub)
}

// TestUniversal_SQLiteKeyed is TestUniversal_LeaseKeyed on SQLite, through Open: the
// subscribers ordered by key, the suite's "type" of TestPublishSubscribeInOrder as the key,
// then that test with GuaranteedOrder, which holds per key with many messages in flight.
// Under -race the whole run took 6 to 12 minutes on two cores, most of it in
// TestConcurrentSubscribe (50 groups reading 5,000 messages through SQLite's one writer; run
// alone, about as long as the unordered suite's, 5 minutes), so it runs, like
// TestUniversal_SQLiteOrdered, only when SQLBROKER_TEST_SQLITE_ORDERED=1; the root package's
// order tests run on SQLite in every pass.
func TestUniversal_SQLiteKeyed(t *testing.T) {
	if os.Getenv("SQLBROKER_TEST_SQLITE_ORDERED") != "1" {
		t.Skip("set SQLBROKER_TEST_SQLITE_ORDERED=1 to run the suite ordered by key on SQLite")
	}
	pubSub, groupPubSub := sqliteConstructors(t, true, false, true)
	tests.TestPubSub(t, sqliteFeatures(false), pubSub, groupPubSub)
	t.Run("TestPublishSubscribeInOrderPerKey", func(t *testing.T) {
		tests.TestPublishSubscribeInOrder(t, tests.TestContext{TestID: tests.NewTestID(), Features: sqliteFeatures(true)}, pubSub)
	})
}
