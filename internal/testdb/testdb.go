// Package testdb connects tests to the real PostgreSQL they run against.
package testdb

import (
	"context"
	"database/sql"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/lib/pq" // the database/sql driver under test
	"go.uber.org/goleak"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// DefaultURL is the test database when SQLBROKER_TEST_POSTGRES_URL is not set.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// URL is the test database's URL.
func URL() string {
	if u := os.Getenv("SQLBROKER_TEST_POSTGRES_URL"); u != "" {
		return u
	}
	return DefaultURL
}

var (
	pgxOnce sync.Once
	pgxPool *pgxpool.Pool
	pgxErr  error
	stdOnce sync.Once
	stdDB   *sql.DB
	stdErr  error
)

// Pgx returns a pgx pool shared by the tests of a package (closed by the process's end).
func Pgx(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pgxOnce.Do(func() {
		cfg, err := pgxpool.ParseConfig(URL())
		if err != nil {
			pgxErr = err
			return
		}
		cfg.MaxConns = 30
		// Hand idle connections back to the server soon: suites that run one after another
		// (and the advisory mode's lock connections) share max_connections.
		cfg.MaxConnIdleTime = 5 * time.Second
		cfg.HealthCheckPeriod = time.Second
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		pgxPool, pgxErr = pgxpool.NewWithConfig(ctx, cfg)
		if pgxErr == nil {
			pgxErr = pgxPool.Ping(ctx)
		}
	})
	if pgxErr != nil {
		t.Fatalf("test database %s: %v (start it, or set SQLBROKER_TEST_POSTGRES_URL)", URL(), pgxErr)
	}
	return pgxPool
}

// Std returns a lib/pq pool shared by the tests of a package.
func Std(t testing.TB) *sql.DB {
	t.Helper()
	stdOnce.Do(func() { stdDB, stdErr = openShared("postgres", URL(), 30) })
	if stdErr != nil {
		t.Fatalf("test database %s: %v (start it, or set SQLBROKER_TEST_POSTGRES_URL)", URL(), stdErr)
	}
	return stdDB
}

// openShared opens a database/sql pool of up to n connections shared by a package's tests,
// which hands idle connections back to the server soon (suites that run one after another
// share its max_connections), and checks that the server answers.
func openShared(driver, dsn string, n int) (*sql.DB, error) {
	db, err := sql.Open(driver, dsn)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(n)
	db.SetMaxIdleConns(n)
	db.SetConnMaxIdleTime(5 * time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, err
	}
	return db, nil
}

// Close closes the shared pools; TestMain calls it before checking for leaked goroutines.
func Close() {
	if pgxPool != nil {
		pgxPool.Close()
	}
	if stdDB != nil {
		_ = stdDB.Close()
	}
	if mysqlDB != nil {
		_ = mysqlDB.Close()
	}
}

// Eventually polls cond every 10ms until it holds or timeout passes.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// LeakCheck reports goroutines still running after the tests, waiting up to 20s for those
// that end by themselves (an advisory-mode delivery left in work at shutdown waits, at most
// its CloseTimeout, for a late settlement to refuse). Goroutines that Watermill's universal suite itself leaves
// behind (its fan-in of many subscribers blocks on a channel nobody reads once a test ends;
// TestReconnect leaves its collector) are not the library's and are ignored.
func LeakCheck() error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		err := goleak.Find(
			goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func2"),
			goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/internal/subscriber.(*multiplier).Subscribe.func3"),
			goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/pubsub/tests.TestReconnect.func2"),
		)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Receive reads one message from ch, failing t when ch is closed or nothing comes within
// timeout.
func Receive(t testing.TB, ch <-chan *message.Message, timeout time.Duration) *message.Message {
	t.Helper()
	select {
	case m, ok := <-ch:
		if !ok {
			t.Fatal("channel closed")
		}
		return m
	case <-time.After(timeout):
		t.Fatalf("no message within %s", timeout)
		return nil
	}
}

// Topic returns a unique topic name for t and drops its tables when t ends.
func Topic(t testing.TB, schema string) string {
	t.Helper()
	topic := "t_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:20]
	t.Cleanup(func() { DropTopic(t, schema, topic) })
	return topic
}

// DropTopic drops the tables of topic.
func DropTopic(t testing.TB, schema, topic string) {
	tables := offsets.NewTables(schema, "sqlbroker_", topic)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := Pgx(t).Exec(ctx, tables.DropSQL()); err != nil {
		t.Errorf("dropping tables of %s: %v", topic, err)
	}
}

// Main runs a package's tests, closes the shared pools and runs closers, and fails the run
// when goroutines are left behind: call it from TestMain.
func Main(m *testing.M, closers ...func()) {
	code := m.Run()
	Close()
	for _, c := range closers {
		c()
	}
	if code == 0 {
		if err := LeakCheck(); err != nil {
			os.Stderr.WriteString("goroutines leaked: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}
