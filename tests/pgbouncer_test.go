package tests

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The PgBouncers in front of the test database: make test starts two of its own (.ci/testenv.sh)
// and passes their URLs in these variables.
var bouncerURLs = map[string]struct{ env, url string }{
	"session":     {"SQLBROKER_TEST_PGBOUNCER_SESSION_URL", "postgres://postgres@127.0.0.1:6432/test?sslmode=disable"},
	"transaction": {"SQLBROKER_TEST_PGBOUNCER_TRANSACTION_URL", "postgres://postgres@127.0.0.1:6433/test?sslmode=disable"},
}

// bouncerURL is the URL of the PgBouncer of the pooling mode. Without one, the test is skipped,
// except in CI, where it fails.
func bouncerURL(t *testing.T, mode string) string {
	t.Helper()
	b := bouncerURLs[mode]
	u := b.url
	if v := os.Getenv(b.env); v != "" {
		u = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	db, err := sql.Open("postgres", u)
	if err == nil {
		err = db.PingContext(ctx)
		_ = db.Close()
	}
	if err != nil {
		msg := "no PgBouncer in " + mode + " pooling mode at " + u + " (make test starts one when pgbouncer is installed, or set " + b.env + "): " + err.Error()
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return u
}

// withParam adds a query parameter to u.
func withParam(u, kv string) string {
	if strings.Contains(u, "?") {
		return u + "&" + kv
	}
	return u + "?" + kv
}

// bouncerPgx opens a pgx pool through the PgBouncer. Transaction pooling hands each
// transaction (each statement outside one) to any server connection, so a statement prepared
// on one is unknown on the next: pgx must not prepare statements there. The exec mode sends
// each statement with its parameters in one round trip, unnamed.
func bouncerPgx(t *testing.T, mode string) sqlbroker.DB {
	t.Helper()
	u := bouncerURL(t, mode)
	if mode == "transaction" {
		u = withParam(u, "default_query_exec_mode=exec")
	}
	cfg, err := pgxpool.ParseConfig(u)
	require.NoError(t, err)
	cfg.MaxConns = 10
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return sqlbroker.Pgx(pool)
}

// bouncerStd opens a lib/pq pool through the PgBouncer. lib/pq sends a statement with
// parameters in two round trips (prepare, then execute, each ending in Sync), which
// transaction pooling may hand to two server connections: binary_parameters=yes sends it in
// one.
func bouncerStd(t *testing.T, mode string) sqlbroker.DB {
	t.Helper()
	u := bouncerURL(t, mode)
	if mode == "transaction" {
		u = withParam(u, "binary_parameters=yes")
	}
	db, err := sql.Open("postgres", u)
	require.NoError(t, err)
	db.SetMaxOpenConns(10)
	t.Cleanup(func() { _ = db.Close() })
	return sqlbroker.StdSQL(db)
}

var bouncerDrivers = map[string]func(*testing.T, string) sqlbroker.DB{"pgx": bouncerPgx, "lib/pq": bouncerStd}

// deliverThrough publishes n messages through db and consumes them with a subscriber of mode
// on db, acking each; it returns the subscriber's stats once every ack is applied.
func deliverThrough(t *testing.T, db sqlbroker.DB, mode sqlbroker.ClaimMode, n int) sqlbroker.Stats {
	t.Helper()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
		InitializeSchema: true, ClaimMode: mode, PollInterval: 20 * time.Millisecond,
		MaxInFlight: 4, LeaseTTL: 2 * time.Second,
	}, nil)
	require.NoError(t, err)
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	for i := range n {
		require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte{byte(i)})))
	}
	seen := map[string]bool{}
	for len(seen) < n {
		m := testdb.Receive(t, msgs, 15*time.Second)
		seen[m.UUID] = true
		if len(seen) == 1 {
			// A handler that outlives several lease extensions.
			time.Sleep(1500 * time.Millisecond)
		}
		m.Ack()
	}
	testdb.Eventually(t, 10*time.Second, "every ack applied", func() bool { return sub.Stats().Acked >= int64(n) })
	st := sub.Stats()
	report, err := sub.Shutdown(ctx)
	require.NoError(t, err)
	assert.Zero(t, report.LocksReleased, "nothing was in work at shutdown")
	claims := offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic).Claims
	assert.Equal(t, 0, queryCount(t, "SELECT count(*) FROM "+claims), "no claim left")
	return st
}

func queryCount(t *testing.T, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(), sql).Scan(&n))
	return n
}

// The lease mode works through PgBouncer in both pooling modes, with both drivers: it holds
// no session state (in transaction pooling LISTEN cannot follow the client, so delivery
// comes from polling).
func TestPgBouncer_leaseModeBothPoolingModes(t *testing.T) {
	for _, mode := range []string{"session", "transaction"} {
		for name, open := range bouncerDrivers {
			t.Run(mode+"/"+name, func(t *testing.T) {
				st := deliverThrough(t, open(t, mode), sqlbroker.ClaimLease, 20)
				assert.Equal(t, int64(20), st.Acked)
				assert.Zero(t, st.StaleSettlements)
				assert.Zero(t, st.LeasesLost, "every lease was extended in time")
				assert.Zero(t, st.Errors)
			})
		}
	}
}

// The advisory mode works through session pooling: a client connection is one server session
// for as long as it lasts, so its locks are held.
func TestPgBouncer_advisoryModeSessionPooling(t *testing.T) {
	for name, open := range bouncerDrivers {
		t.Run(name, func(t *testing.T) {
			st := deliverThrough(t, open(t, "session"), sqlbroker.ClaimAdvisoryLock, 10)
			assert.Equal(t, int64(10), st.Acked)
			assert.Zero(t, st.StaleSettlements)
			assert.Zero(t, st.Errors)
		})
	}
}

// The advisory mode is refused through transaction pooling, where a session lock would stay
// on a server connection that the next client gets: Subscribe fails with
// ErrNotSessionConnection and takes no lock.
func TestPgBouncer_A5_advisoryModeRefusedInTransactionPooling(t *testing.T) {
	for name, open := range bouncerDrivers {
		t.Run(name, func(t *testing.T) {
			db := open(t, "transaction")
			topic := testdb.Topic(t, "")
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{InitializeSchema: true, ClaimMode: sqlbroker.ClaimAdvisoryLock}, nil)
			require.NoError(t, err)
			defer sub.Close()
			_, err = sub.Subscribe(context.Background(), topic)
			require.Error(t, err)
			assert.True(t, errors.Is(err, advisory.ErrNotSessionConnection), "got %v", err)
			assert.Zero(t, sub.Stats().LocksHeld)
		})
	}
}
