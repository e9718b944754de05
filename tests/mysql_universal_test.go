package tests

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// mysqlConstructors build the suite's publishers and subscribers on the MySQL test database's
// shared pool, configured as on SQLite (sqliteConfig).
func mysqlConstructors(t *testing.T, ordered bool) (tests.PubSubConstructor, tests.ConsumerGroupPubSubConstructor) {
	db := sqlbroker.MySQL(testdb.MySQL(t))
	build := func(t *testing.T, group string) (message.Publisher, message.Subscriber) {
		pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
		if err != nil {
			t.Fatal(err)
		}
		sub, err := sqlbroker.NewSubscriber(db, sqliteConfig(group, ordered, false), nil)
		if err != nil {
			t.Fatal(err)
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

// TestUniversal_MySQL runs Watermill's universal suite in lease mode on MySQL (or MariaDB),
// then in the ordered configuration (one message in flight, one subscriber).
func TestUniversal_MySQL(t *testing.T) {
	for _, run := range []struct {
		name    string
		ordered bool
	}{{"lease", false}, {"ordered", true}} {
		t.Run(run.name, func(t *testing.T) {
			pubSub, groupPubSub := mysqlConstructors(t, run.ordered)
			f := universalFeatures(run.ordered)
			f.RestartServiceCommand = nil
			tests.TestPubSub(t, f, pubSub, groupPubSub)
		})
	}
}
