package tests

import (
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
// through Open and on a caller's pool, then in the ordered configuration (one message in
// flight, one subscriber) on the caller's pool.
func TestUniversal_MySQL(t *testing.T) {
	for _, run := range []struct {
		name             string
		viaOpen, ordered bool
	}{{"open", true, false}, {"sqldb", false, false}, {"ordered", false, true}} {
		t.Run(run.name, func(t *testing.T) {
			pubSub, groupPubSub := mysqlConstructors(t, run.viaOpen, run.ordered)
			f := universalFeatures(run.ordered)
			f.RestartServiceCommand = nil
			tests.TestPubSub(t, f, pubSub, groupPubSub)
		})
	}
}
