package tests

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// advTopic returns a unique topic name for a test.
func advTopic(prefix string) string {
	return prefix + "_" + watermill.NewShortUUID()
}

// lockKey1 is key1 of the advisory locks of topic and group (default schema and prefix).
func lockKey1(topic, group string) int32 {
	return advisory.Key1(offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic).Messages, group)
}

// advisoryLocks counts the advisory locks with key1 held in the test database.
func advisoryLocks(t testing.TB, key1 int32) int {
	t.Helper()
	var n int
	err := testdb.Pgx(t).QueryRow(context.Background(), `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND classid = $1::int4::oid
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`, key1).Scan(&n)
	require.NoError(t, err)
	return n
}

// requireNoLocksLeft waits until pg_locks shows no lock of key1, and fails otherwise.
func requireNoLocksLeft(t testing.TB, key1 int32) {
	t.Helper()
	testdb.Eventually(t, 5*time.Second, fmt.Sprintf("no advisory lock of key1 %#x left", key1), func() bool {
		return advisoryLocks(t, key1) == 0
	})
}

// libraryLocks counts every advisory lock in the library's key1 range in the test database.
func libraryLocks(t testing.TB, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND classid::bigint BETWEEN $1 AND $2
		  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())`,
		int64(advisory.NamespaceFirst), int64(advisory.NamespaceLast)).Scan(&n)
	require.NoError(t, err)
	return n
}

// advSubscriber builds an advisory-mode subscriber; mod adjusts its config.
func advSubscriber(t testing.TB, db sqlbroker.DB, group string, mod func(*sqlbroker.SubscriberConfig)) *sqlbroker.Subscriber {
	t.Helper()
	cfg := sqlbroker.SubscriberConfig{
		ConsumerGroup:     group,
		ClaimMode:         sqlbroker.ClaimAdvisoryLock,
		InitializeSchema:  true,
		RetryInterval:     100 * time.Millisecond,
		LockCheckInterval: 200 * time.Millisecond,
		CloseTimeout:      5 * time.Second,
	}
	if mod != nil {
		mod(&cfg)
	}
	sub, err := sqlbroker.NewSubscriber(db, cfg, watermill.NopLogger{})
	require.NoError(t, err)
	return sub
}

// publishN publishes n messages to topic and returns their UUIDs in order.
func publishN(t testing.TB, db sqlbroker.DB, topic string, n int) []string {
	t.Helper()
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, watermill.NopLogger{})
	require.NoError(t, err)
	defer pub.Close()
	ids := make([]string, n)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		ids[i] = watermill.NewUUID()
		msgs[i] = message.NewMessage(ids[i], []byte(fmt.Sprintf("payload %d", i)))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	return ids
}

// receive reads one message from ch within timeout.
var receive = testdb.Receive

// advisoryStdMaxOpen sizes the lib/pq pool of the advisory suites: up to 50 lock connections
// of Watermill's TestConcurrentSubscribe, plus room for the claims and settlements of the
// other tests running beside it. Idle connections are kept (up to the same number): with
// fewer, every statement past them would open a new server process.
const advisoryStdMaxOpen = 110

var (
	advStdOnce sync.Once
	advStdDB   *sql.DB
	advStdErr  error
)

// advisoryStd is a lib/pq pool for the advisory suites (see advisoryDriver).
func advisoryStd(t testing.TB) *sql.DB {
	t.Helper()
	advStdOnce.Do(func() {
		advStdDB, advStdErr = sql.Open("postgres", testdb.URL())
		if advStdErr != nil {
			return
		}
		advStdDB.SetMaxOpenConns(advisoryStdMaxOpen)
		advStdDB.SetMaxIdleConns(advisoryStdMaxOpen)
		advStdDB.SetConnMaxIdleTime(30 * time.Second)
	})
	require.NoError(t, advStdErr)
	return advStdDB
}

func closeAdvisoryStd() {
	if advStdDB != nil {
		_ = advStdDB.Close()
	}
}
