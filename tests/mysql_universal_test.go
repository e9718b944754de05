package tests

import (
	"os"
	"testing"

	"github.com/ThreeDotsLabs/watermill/pubsub/tests"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// mysqlConstructors build the suite's publishers and subscribers on MySQL, configured as on
// SQLite (sqliteConfig): through a Broker that Open builds for each of them (so the suite's
// consumers of one group work through pools of their own, as processes would), or on the
// shared pool of the MySQL test database.
func mysqlConstructors(t *testing.T, viaOpen, ordered bool) (tests.PubSubConstructor, tests.ConsumerGroupPubSubConstructor) {
	var shared sqlbroker.DB
	if !viaOpen {
		shared = sqlbroker.MySQL(testdb.MySQL(t))
	}
	return brokerConstructors(testdb.MySQLURL(t), sqlbroker.BrokerConfig{MaxConns: 8}, shared, viaOpen, ordered, false)
}

// TestUniversal_MySQL runs Watermill's universal suite in lease mode on MySQL (or MariaDB),
// through Open and on a caller's pool.
func TestUniversal_MySQL(t *testing.T) {
	for _, run := range []struct {
		name    string
		viaOpen bool
	}{{"open", true}, {"sqldb", false}} {
		t.Run(run.name, func(t *testing.T) {
			pubSub, groupPubSub := mysqlConstructors(t, run.viaOpen, false)
			tests.TestPubSub(t, mysqlFeatures(false), pubSub, groupPubSub)
		})
	}
}

// TestUniversal_MySQLOrdered runs the suite in the ordered configuration (one message in
// flight, one subscriber) on the caller's pool. One message at a time, a claim and an ack
// each a transaction that waits for its flush to disk, its TestContinueAfterSubscribeClose
// and TestConcurrentSubscribe take ten minutes and more under -race on two cores, as on
// SQLite, so it runs only when SQLBROKER_TEST_MYSQL_ORDERED=1.
func TestUniversal_MySQLOrdered(t *testing.T) {
	if os.Getenv("SQLBROKER_TEST_MYSQL_ORDERED") != "1" {
		t.Skip("set SQLBROKER_TEST_MYSQL_ORDERED=1 to run the ordered suite on MySQL")
	}
	pubSub, groupPubSub := mysqlConstructors(t, false, true)
	tests.TestPubSub(t, mysqlFeatures(true), pubSub, groupPubSub)
}

// mysqlFeatures are the Features of the library on MySQL: those of PostgreSQL, less the
// restart of a server (the suite restarts PostgreSQL's).
func mysqlFeatures(ordered bool) tests.Features {
	f := universalFeatures(ordered)
	f.RestartServiceCommand = nil
	return f
}
