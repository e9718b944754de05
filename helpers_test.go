package sqlbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func pgxDB(t *testing.T) sqlbroker.DB { return sqlbroker.Pgx(testdb.Pgx(t)) }
func stdDB(t *testing.T) sqlbroker.DB { return sqlbroker.StdSQL(testdb.Std(t)) }

// sqliteDB is a DB on a SQLite file of the test's own: every call opens another file, so a
// test calls it once and hands the DB to its publishers and subscribers.
func sqliteDB(t *testing.T) sqlbroker.DB { return sqlbroker.SQLite(testdb.SQLite(t)) }

// database is a database the lease mode's tests run on.
type database struct {
	name string
	open func(*testing.T) sqlbroker.DB
}

// leaseDatabases are the databases of the lease mode: PostgreSQL (through pgx) and SQLite.
var leaseDatabases = []database{{"pgx", pgxDB}, {"sqlite", sqliteDB}}

// openSQL is open, with a handle that runs SQL text on the same database.
func (d database) openSQL(t *testing.T) (sqlbroker.DB, rawSQL) {
	if d.name == "sqlite" {
		h := testdb.SQLite(t)
		return sqlbroker.SQLite(h), rawSQL{lite: h}
	}
	return d.open(t), rawSQL{pg: testdb.Pgx(t)}
}

// rawSQL runs SQL text on a test's database, for tests that read or change its tables
// directly. Parameters are written $1, $2, ... in order, which both databases take.
type rawSQL struct {
	pg   *pgxpool.Pool
	lite *sql.DB
}

// claimed counts the claims in table claims that match where (a condition on the columns
// token and visible_at, "true" for all; a held claim has a token above 0). On PostgreSQL a
// claim row holds the offsets of one claim statement; on SQLite, one.
func (r rawSQL) claimed(t *testing.T, claims, where string) int {
	t.Helper()
	if r.lite != nil {
		return r.count(t, "SELECT count(*) FROM "+claims+" WHERE "+where)
	}
	return r.count(t, "SELECT coalesce(sum(cardinality(offsets)), 0) FROM "+claims+" WHERE "+where)
}

// claimedPG is rawSQL.claimed on the test database of PostgreSQL.
func claimedPG(t *testing.T, claims, where string) int {
	t.Helper()
	return rawSQL{pg: testdb.Pgx(t)}.claimed(t, claims, where)
}

// count runs a query of one integer.
func (r rawSQL) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if r.lite != nil {
		// A process killed with the file open leaves its WAL index to be recovered by the next
		// connection; another one that reads meanwhile gets SQLITE_BUSY_RECOVERY (261), which
		// the busy timeout does not wait out.
		deadline := time.Now().Add(10 * time.Second)
		for {
			err := r.lite.QueryRow(query, args...).Scan(&n)
			var coded interface{ Code() int }
			if errors.As(err, &coded) && coded.Code() == 261 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
				continue
			}
			require.NoError(t, err)
			break
		}
	} else {
		require.NoError(t, r.pg.QueryRow(context.Background(), query, args...).Scan(&n))
	}
	return n
}

// exec runs a statement.
func (r rawSQL) exec(t *testing.T, query string, args ...any) {
	t.Helper()
	var err error
	if r.lite != nil {
		_, err = r.lite.Exec(query, args...)
	} else {
		_, err = r.pg.Exec(context.Background(), query, args...)
	}
	require.NoError(t, err)
}

// holdWriteLock takes the write lock of the SQLite file at path on a connection of its own
// (BEGIN IMMEDIATE), as a writer of another process would, until release is called or the
// test ends.
func holdWriteLock(t *testing.T, path string) (release func()) {
	t.Helper()
	ctx := context.Background()
	other, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close() })
	hold, err := other.Conn(ctx)
	require.NoError(t, err)
	_, err = hold.ExecContext(ctx, "BEGIN IMMEDIATE")
	require.NoError(t, err)
	return onceCleanup(t, func() {
		_, _ = hold.ExecContext(ctx, "ROLLBACK")
		_ = hold.Close()
	})
}

// writeLockFree asserts that no connection holds SQLite's write lock: another one takes it at
// once, without waiting.
func (r rawSQL) writeLockFree(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	c, err := r.lite.Conn(ctx)
	require.NoError(t, err)
	defer c.Close()
	_, err = c.ExecContext(ctx, "PRAGMA busy_timeout = 0")
	require.NoError(t, err)
	_, err = c.ExecContext(ctx, "BEGIN IMMEDIATE")
	require.NoError(t, err, "the write lock is held")
	_, err = c.ExecContext(ctx, "ROLLBACK")
	require.NoError(t, err)
}

// takeAway makes the lease of the claim of offset run out, as takeAway does on PostgreSQL,
// and waits until a claim took it again.
func (r rawSQL) takeAway(t *testing.T, topic string, offset int64) {
	t.Helper()
	if r.lite == nil {
		takeAway(t, sqlbroker.ClaimLease, topic, offset)
		return
	}
	claims := tables(topic).Claims
	var token int64
	if err := r.lite.QueryRow(`SELECT "token" FROM `+claims+` WHERE "offset" = $1`, offset).Scan(&token); err != nil {
		return // settled meanwhile
	}
	_, _ = r.lite.Exec(`UPDATE `+claims+` SET "visible_at" = 0 WHERE "offset" = $1 AND "token" = $2`, offset, token)
	testdb.Eventually(t, 5*time.Second, "the claim taken again", func() bool {
		var now int64
		err := r.lite.QueryRow(`SELECT "token" FROM `+claims+` WHERE "offset" = $1`, offset).Scan(&now)
		return err != nil || now != token && now != 0
	})
}

// modes are the claim modes the database runs: SQLite has the lease mode only.
func (d database) modes() []sqlbroker.ClaimMode {
	if d.name == "sqlite" {
		return []sqlbroker.ClaimMode{sqlbroker.ClaimLease}
	}
	return claimModes
}

func newPublisher(t *testing.T, db sqlbroker.DB) *sqlbroker.Publisher {
	t.Helper()
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func newSubscriber(t *testing.T, cfg sqlbroker.SubscriberConfig) *sqlbroker.Subscriber {
	t.Helper()
	return newSubscriberOn(t, pgxDB(t), cfg)
}

// newSubscriberOn is newSubscriber on db.
func newSubscriberOn(t *testing.T, db sqlbroker.DB, cfg sqlbroker.SubscriberConfig) *sqlbroker.Subscriber {
	t.Helper()
	cfg.InitializeSchema = true
	sub, err := sqlbroker.NewSubscriber(db, cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func publish(t *testing.T, pub message.Publisher, topic string, payloads ...string) []*message.Message {
	t.Helper()
	msgs := make([]*message.Message, len(payloads))
	for i, p := range payloads {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(p))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	return msgs
}

// numbered returns the payloads "0" to n-1, as strings.
func numbered(n int) []string {
	ps := make([]string, n)
	for i := range ps {
		ps[i] = strconv.Itoa(i)
	}
	return ps
}

// receive reads one message from ch within timeout.
var receive = testdb.Receive

// noMessage asserts that nothing arrives for d: it checks that something is held back, not
// how fast anything is.
func noMessage(t *testing.T, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case m, ok := <-ch:
		if ok {
			t.Fatalf("unexpected message %s (payload %q)", m.UUID, m.Payload)
		}
	case <-time.After(d):
	}
}

func tables(topic string) offsets.Tables { return offsets.NewTables("", "sqlbroker_", topic) }

// smallPartitions creates the tables of topic, still without messages, with k partitions of
// size offsets from the first, so that retention drops a partition for a few messages (one
// message a partition with size 1).
func smallPartitions(t *testing.T, topic string, size, k int) {
	t.Helper()
	require.NoError(t, tables(topic).Create(context.Background(), dbx.NewPgxPool(testdb.Pgx(t))))
	testdb.SmallPartitions(t, tables(topic), size, k)
}

func queryInt(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// lockTableSQL is the statement with which a test's own transaction holds table against the
// library's statements, as a migration's lock would: EXCLUSIVE MODE, which every statement that
// writes the table (and every FOR UPDATE) waits on, but plain reads do not. A migration takes
// ACCESS EXCLUSIVE, which also stops reads, but PostgreSQL gives the transaction that takes it
// a transaction ID (the lock is logged for standbys), and a transaction ID held for seconds
// holds the xmin horizon back: no claim of any other test running beside this one would take
// a message published meanwhile (a claim takes only messages older than every running
// transaction), and their 10 s read windows ran out. EXCLUSIVE takes no transaction ID.
func lockTableSQL(table string) string { return "LOCK TABLE " + table + " IN EXCLUSIVE MODE" }
