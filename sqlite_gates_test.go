package sqlbroker_test

import (
	"context"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// newGates lists the write gates of paths that before did not hold.
func newGates(before []string) []string {
	var out []string
	for _, p := range sqlbroker.SQLiteGatePaths() {
		if !slices.Contains(before, p) {
			out = append(out, p)
		}
	}
	return out
}

// Every sqlite::memory: broker has a database, and a write gate, of its own: its Shutdown
// drops the gate, so opening and shutting down many leaves the process's gates as they were.
// Not parallel: the gates are the process's.
func TestSQLite_memoryBrokersLeaveNoWriteGate(t *testing.T) {
	ctx := context.Background()
	before := sqlbroker.SQLiteGatePaths()
	const n = 50
	var brokers []*sqlbroker.Broker
	for range n {
		b, err := sqlbroker.Open("sqlite::memory:", sqlbroker.BrokerConfig{}, nil)
		require.NoError(t, err)
		brokers = append(brokers, b)
		pub, err := b.NewPublisher(sqlbroker.PublisherConfig{InitializeSchema: true})
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x"))))
	}
	require.Len(t, newGates(before), n, "one gate per broker's database while they are open")
	for _, b := range brokers {
		_, err := b.Shutdown(ctx)
		require.NoError(t, err)
	}
	assert.Zero(t, len(newGates(before)), "gates left behind by brokers shut down")

	// A caller's handle on a file: its gate lives while a pool of the library uses it, and
	// goes once none does.
	h := testdb.SQLite(t)
	func() {
		pub, err := sqlbroker.NewPublisher(sqlbroker.SQLite(h), sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x"))))
		require.Len(t, newGates(before), 1, "the file's gate")
		require.NoError(t, pub.Close())
	}()
	testdb.Eventually(t, 10*time.Second, "the caller's handle's gate dropped once unused", func() bool {
		runtime.GC()
		return len(newGates(before)) == 0
	})
}

// The set of connections a caller's handle has seen set up stays bounded while database/sql
// closes and opens connections (none kept idle): each Publish here runs on a new one.
func TestSQLite_readyConnectionsBounded(t *testing.T) {
	t.Parallel()
	h := testdb.SQLite(t)
	h.SetMaxIdleConns(0)
	db := sqlbroker.SQLite(h)
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true, DisableGroupInsert: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	most := 0
	for range 2 * sqlbroker.SQLiteMaxReady {
		require.NoError(t, pub.Publish("t", message.NewMessage(watermill.NewUUID(), []byte("x"))))
		most = max(most, sqlbroker.SQLiteReadyConns(db))
	}
	assert.LessOrEqual(t, most, sqlbroker.SQLiteMaxReady)
	assert.Greater(t, h.Stats().MaxIdleClosed, int64(sqlbroker.SQLiteMaxReady), "the connections did not churn")
}
