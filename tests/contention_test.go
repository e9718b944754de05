package tests

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The advisory-lock mode under contention: a table lock held by someone else (a migration's
// ALTER TABLE, a CREATE INDEX without CONCURRENTLY, a VACUUM FULL) while deliveries are in
// work and while the subscriber shuts down.

// appURL is the test database's URL with an application_name of its own, so that the
// backends of one test can be found in pg_stat_activity.
func appURL() (string, string) {
	app := "sqlbroker_c_" + strings.ToLower(watermill.NewShortUUID())
	u := testdb.URL()
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return u + sep + "application_name=" + app, app
}

// appDB is a pool of driver name ("pgx" or "libpq") whose connections carry an
// application_name of the test's own, closed when the test ends.
func appDB(t *testing.T, name string) (sqlbroker.DB, string) {
	t.Helper()
	u, app := appURL()
	if name == "libpq" {
		db, err := sql.Open("postgres", u)
		require.NoError(t, err)
		db.SetMaxOpenConns(10)
		t.Cleanup(func() { _ = db.Close() })
		return sqlbroker.StdSQL(db), app
	}
	cfg, err := pgxpool.ParseConfig(u)
	require.NoError(t, err)
	cfg.MaxConns = 10
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return sqlbroker.Pgx(pool), app
}

// lockTopicTables takes ACCESS EXCLUSIVE locks on the topic's three tables, as a migration
// would, and returns the function that commits them away. The topic's tables must exist.
func lockTopicTables(t *testing.T, topic string) func() {
	t.Helper()
	ctx := context.Background()
	tb := offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic)
	// Taking three locks one after another can meet a statement of the library that holds one
	// of them and waits for another: the server's deadlock detector then ends one of the two,
	// and this lock is taken again, in a transaction of its own.
	for try := 1; ; try++ {
		tx, err := testdb.Pgx(t).Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, "LOCK TABLE "+tb.Messages+", "+tb.Groups+", "+tb.Claims+" IN ACCESS EXCLUSIVE MODE")
		if err != nil {
			_ = tx.Rollback(ctx)
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "40P01" && try < 5 {
				continue
			}
			require.NoError(t, err)
		}
		done := false
		release := func() {
			if !done {
				done = true
				require.NoError(t, tx.Commit(ctx))
			}
		}
		t.Cleanup(release)
		return release
	}
}

// waitingOnLock lists the backends of app that wait on a lock now, with the start of the
// statement each is running.
func waitingOnLock(t *testing.T, app string, queryHas ...string) map[int]time.Time {
	t.Helper()
	has := ""
	if len(queryHas) > 0 {
		has = queryHas[0]
	}
	rows, err := testdb.Pgx(t).Query(context.Background(), `SELECT pid, query_start FROM pg_stat_activity
		WHERE application_name = $1 AND wait_event_type = 'Lock' AND strpos(query, $2) > 0`, app, has)
	require.NoError(t, err)
	out := map[int]time.Time{}
	for rows.Next() {
		var pid int
		var at time.Time
		require.NoError(t, rows.Scan(&pid, &at))
		out[pid] = at
	}
	require.NoError(t, rows.Err())
	return out
}

// ungrantedLocks counts the lock requests of app's backends that wait.
func ungrantedLocks(t *testing.T, app string) int {
	t.Helper()
	var n int
	require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(), `SELECT count(*) FROM pg_locks l
		JOIN pg_stat_activity a USING (pid) WHERE a.application_name = $1 AND NOT l.granted`, app).Scan(&n))
	return n
}

// C1: a table lock of 7 s (longer than any client-side timeout of the library) while four
// deliveries are in work costs nothing, in both claim modes: the claims blocked behind it give
// up on the server and are retried; in advisory mode the lock connection stays and the four
// keep their locks, in lease mode their leases are extended once the lock goes (the default
// lease, 30 s, outlasts it); their acks, made while the tables are locked, are applied once
// the lock goes. No lease lost, no redelivery.
//
// An ACCESS EXCLUSIVE lock is WAL-logged, so the transaction holding it has a transaction id
// and holds every message written after it back from delivery, in every topic of the server,
// for the 7 s of the lock (a message is delivered only once every transaction older than it
// has ended). The test therefore runs alone, not beside the package's parallel tests, and every
// case has received its messages before the first lock is taken.
func TestAdvisory_C1_tableLockKeepsLocks(t *testing.T) {
	const n = 4
	const hold = 7 * time.Second
	type c1Case struct {
		name   string
		app    string
		topic  string
		key1   int32
		sub    *sqlbroker.Subscriber
		ch     <-chan *message.Message
		inWork []*message.Message
		locks  int // advisory locks held by the deliveries in work
	}
	var cases []c1Case
	for _, mode := range []sqlbroker.ClaimMode{sqlbroker.ClaimAdvisoryLock, sqlbroker.ClaimLease} {
		for _, d := range []string{"pgx", "libpq"} {
			c := c1Case{name: mode.String() + "/" + d, topic: advTopic("adv_c1")}
			var db sqlbroker.DB
			db, c.app = appDB(t, d)
			c.key1 = lockKey1(c.topic, "g")
			publishN(t, db, c.topic, n)
			c.sub = advSubscriber(t, db, "g", func(cfg *sqlbroker.SubscriberConfig) {
				cfg.PollInterval = 50 * time.Millisecond
				cfg.ClaimMode = mode
			})
			t.Cleanup(func() { _ = c.sub.Close() }) // a failing case still stops it
			var err error
			c.ch, err = c.sub.Subscribe(context.Background(), c.topic)
			require.NoError(t, err)
			c.inWork = receiveAll(t, c.ch, n)
			if mode == sqlbroker.ClaimAdvisoryLock {
				c.locks = n
			}
			require.Equal(t, c.locks, advisoryLocks(t, c.key1), c.name)
			cases = append(cases, c)
		}
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			release := lockTopicTables(t, c.topic)
			lockedAt := time.Now()
			testdb.Eventually(t, 10*time.Second, "a claim waiting on the table lock", func() bool {
				return len(waitingOnLock(t, c.app)) > 0
			})
			for _, m := range c.inWork {
				m.Ack() // blocked behind the table lock too
			}
			// The fault itself is the time the lock is held; meanwhile the claims stay.
			for time.Since(lockedAt) < hold {
				require.Equal(t, c.locks, advisoryLocks(t, c.key1), "advisory locks of the deliveries in work, %s into the table lock", time.Since(lockedAt).Round(time.Millisecond))
				for _, m := range c.inWork {
					require.NoError(t, m.Context().Err(), "a delivery's context ended under the table lock")
				}
				time.Sleep(100 * time.Millisecond)
			}
			release()

			testdb.Eventually(t, 15*time.Second, "the acks applied after the table lock", func() bool { return c.sub.Stats().Acked == n })
			st := c.sub.Stats()
			assert.EqualValues(t, 0, st.LeasesLost)
			assert.EqualValues(t, 0, st.StaleSettlements)
			assert.Equal(t, 0, claimRows(t, c.topic))
			testdb.Eventually(t, 5*time.Second, "no lock left", func() bool { return advisoryLocks(t, c.key1) == 0 })
			select {
			case m := <-c.ch:
				t.Fatalf("message %s delivered again (attempt %s)", m.UUID, m.Metadata.Get(sqlbroker.MetadataAttempt))
			case <-time.After(500 * time.Millisecond):
			}
			_, err := c.sub.Shutdown(context.Background())
			require.NoError(t, err)
			requireNoLocksLeft(t, c.key1)
		})
	}
}

// C2: Stats does not wait for a claim statement in flight: with the claim blocked on a table
// lock, Stats returns while that very statement (same backend, same start) still waits.
func TestAdvisory_C2_statsDuringBlockedClaim(t *testing.T) {
	t.Parallel()
	db, app := appDB(t, "pgx")
	topic, group := advTopic("adv_c2"), "g"
	publishN(t, db, topic, 1)
	sub := advSubscriber(t, db, group, func(c *sqlbroker.SubscriberConfig) {
		c.PollInterval = 20 * time.Millisecond
		c.LockWaitTimeout = time.Minute // the claim stays blocked for the whole test
	})
	ch, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)

	release := lockTopicTables(t, topic)
	var before map[int]time.Time
	testdb.Eventually(t, 10*time.Second, "a claim waiting on the table lock", func() bool {
		before = waitingOnLock(t, app)
		return len(before) == 1
	})
	got := make(chan sqlbroker.Stats, 1)
	go func() { got <- sub.Stats() }()
	var st sqlbroker.Stats
	select {
	case st = <-got:
	case <-time.After(time.Minute):
		t.Fatal("Stats did not return")
	}
	after := waitingOnLock(t, app)
	assert.Equal(t, before, after, "Stats returned only once the blocked claim had ended")
	assert.Equal(t, 1, st.LocksHeld)
	assert.Equal(t, 1, st.InFlight)

	release()
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool { return sub.Stats().Acked == 1 })
	_, err = sub.Shutdown(context.Background())
	require.NoError(t, err)
}

// S11, S3: a claim blocked on a table lock when Shutdown runs is cancelled on the server and
// awaited; Shutdown returns within its deadline, counts the cancel, never opens the lock
// connection again, and leaves no backend of the library waiting on the lock.
func TestShutdown_S11_advisoryClaimBlockedOnTableLock(t *testing.T) {
	t.Parallel()
	for _, d := range []string{"pgx", "libpq"} {
		for _, bound := range []time.Duration{0, time.Second} {
			name := d + "/generous"
			if bound > 0 {
				name = d + "/bounded_" + bound.String()
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				db, app := appDB(t, d)
				topic, group := advTopic("adv_s11"), "g"
				key1 := lockKey1(topic, group)
				publishN(t, db, topic, 1)
				logger := watermill.NewCaptureLogger()
				sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
					ConsumerGroup:     group,
					ClaimMode:         sqlbroker.ClaimAdvisoryLock,
					InitializeSchema:  true,
					PollInterval:      20 * time.Millisecond,
					RetryInterval:     100 * time.Millisecond,
					LockCheckInterval: 50 * time.Millisecond,
					LockWaitTimeout:   time.Minute, // the claim is still blocked when Shutdown runs
					CloseTimeout:      time.Second, // how long a settlement after Shutdown is waited for, to be refused
				}, logger)
				require.NoError(t, err)
				t.Cleanup(func() { _ = sub.Close() }) // a failing run still stops it
				ch, err := sub.Subscribe(context.Background(), topic)
				require.NoError(t, err)
				receive(t, ch, 10*time.Second) // in work: its lock is held

				lockTopicTables(t, topic)
				testdb.Eventually(t, 10*time.Second, "a statement of the library waiting on the table lock", func() bool {
					return len(waitingOnLock(t, app)) == 1
				})
				// The subscription's own claim, or, while the subscription is parked, the pool's
				// shared idle poll, which is bounded to a second and not the subscription's to
				// count (its claims start with their due step).
				claimWaiting := len(waitingOnLock(t, app, "due AS (")) == 1

				ctx := context.Background()
				if bound > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, bound)
					defer cancel()
				}
				start := time.Now()
				rep, err := sub.Shutdown(ctx)
				elapsed := time.Since(start)
				// Checked at once: nothing may be left for the server to end later.
				waiting := waitingOnLock(t, app)
				ungranted := ungrantedLocks(t, app)
				locks := advisoryLocks(t, key1)

				require.NoError(t, err)
				t.Logf("Shutdown took %s: %+v", elapsed, rep)
				if bound > 0 {
					assert.Less(t, elapsed, bound, "Shutdown overran its deadline")
				}
				if claimWaiting {
					assert.Equal(t, 1, rep.QueriesCancelled)
				}
				assert.Equal(t, 1, rep.LocksReleased)
				assert.Empty(t, waiting, "a backend of the library still waits on the table lock")
				assert.Equal(t, 0, ungranted, "a lock request of the library is still waiting")
				assert.Equal(t, 0, locks, "advisory locks left")
				for _, m := range logger.Captured()[watermill.InfoLogLevel] {
					assert.NotContains(t, m.Msg, "opened again", "the lock connection was opened again while shutting down")
				}
			})
		}
	}
}

// The lock connection of a pgx pool is set up as the pool's own connections are: with
// Schema "" its statements find the topic's tables through the search_path that the pool's
// AfterConnect sets, as every other statement does.
func TestAdvisory_lockConnectionRunsAfterConnect(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := "sp_" + strings.ToLower(watermill.NewShortUUID())
	admin := testdb.Pgx(t)
	_, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	})
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	cfg.MaxConns = 5
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET search_path TO "+pgx.Identifier{schema}.Sanitize())
		return err
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	db := sqlbroker.Pgx(pool)

	topic := advTopic("adv_sp")
	ids := publishN(t, db, topic, 1)
	sub := advSubscriber(t, db, "g", nil)
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, ch, 10*time.Second)
	assert.Equal(t, ids[0], m.UUID)
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool { return sub.Stats().Acked == 1 })
	_, err = sub.Shutdown(ctx)
	require.NoError(t, err)
}

// C4: on a *sql.DB bounded by SetMaxOpenConns, every advisory-mode subscription keeps one
// connection of the pool for its locks. Subscribe takes one only while the pool keeps room
// for everything else, and otherwise fails at once with an error that says how many
// connections are needed; the subscriptions it let in deliver and settle.
func TestAdvisory_C4_boundedStdPoolRefusesClearly(t *testing.T) {
	t.Parallel()
	sqlDB, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	sqlDB.SetMaxOpenConns(4)
	t.Cleanup(func() { _ = sqlDB.Close() })
	db := sqlbroker.StdSQL(sqlDB)

	sub := advSubscriber(t, db, "g", nil)
	var topics []string
	for range 2 {
		topic := advTopic("adv_c4")
		publishN(t, db, topic, 1)
		topics = append(topics, topic)
	}
	var chans []<-chan *message.Message
	for _, topic := range topics {
		ch, err := sub.Subscribe(context.Background(), topic)
		require.NoError(t, err)
		chans = append(chans, ch)
	}
	third := advTopic("adv_c4")
	require.NoError(t, sub.SubscribeInitialize(third))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = sub.Subscribe(ctx, third)
	require.Error(t, err, "a third lock connection would leave the pool no room for settlements")
	require.NoError(t, ctx.Err(), "Subscribe waited for a connection instead of refusing")
	assert.ErrorIs(t, err, advisory.ErrPoolTooSmall)
	assert.Contains(t, err.Error(), "SetMaxOpenConns")
	assert.Contains(t, err.Error(), "at least 5")
	t.Log(err)

	for _, ch := range chans {
		m := receive(t, ch, 10*time.Second)
		m.Ack()
	}
	testdb.Eventually(t, 10*time.Second, "the acks applied", func() bool { return sub.Stats().Acked == 2 })
	_, err = sub.Shutdown(context.Background())
	require.NoError(t, err)
}
