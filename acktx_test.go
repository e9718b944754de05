package sqlbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// takeAway takes the claim of the delivery at offset from it while its handler runs, and
// waits (up to 5 s) until another consumer of the group holds it: in lease mode its lease is
// made to run out; in advisory mode the lock connection holding it is terminated, found by
// the lock's whole key (key1 of the topic and group g, and the offset): the offset alone is
// also the key2 of other tests' locks, whose connections it must not end. Its
// statements run on a pool of their own: the handlers that call it hold transactions on the
// package's pool, and when they hold all of its connections, a wait for one of them would never
// end.
func takeAway(t *testing.T, mode sqlbroker.ClaimMode, topic string, offset int64) {
	ctx := context.Background()
	claims := tables(topic).Claims
	pool := takeAwayPool(t)
	var token int64
	if err := pool.QueryRow(ctx, `SELECT "token" FROM `+claims+` WHERE "offsets" @> ARRAY[$1::bigint]`, offset).Scan(&token); err != nil {
		return // settled meanwhile
	}
	if mode == sqlbroker.ClaimLease {
		// The claim leaves its row for one of its own, due at once: the lease of this claim
		// alone ran out.
		_, _ = pool.Exec(ctx, `WITH u AS (
	UPDATE `+claims+` SET "offsets" = array_remove("offsets", $1::bigint)
	WHERE "offsets" @> ARRAY[$1::bigint] AND "token" = $2 AND cardinality("offsets") > 1
	RETURNING "group_id", "attempts"
), alone AS (
	UPDATE `+claims+` SET "visible_at" = now() - interval '1 second'
	WHERE "offsets" = ARRAY[$1::bigint] AND "token" = $2
)
INSERT INTO `+claims+` ("group_id", "token", "attempts", "visible_at", "offsets")
SELECT "group_id", -1 - $1::bigint, "attempts", now() - interval '1 second', ARRAY[$1::bigint] FROM u`, offset, token)
	} else {
		key1 := advisory.Key1(tables(topic).Messages, "g")
		_, _ = pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_locks
			WHERE locktype = 'advisory' AND objsubid = 2 AND objid = $1::int4::oid AND classid = $2::int4::oid`, advisory.Key2(offset), key1)
	}
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		var now int64
		err := pool.QueryRow(ctx, `SELECT "token" FROM `+claims+` WHERE "offsets" @> ARRAY[$1::bigint]`, offset).Scan(&now)
		if err != nil || now != token && now > 0 {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

var (
	takeAwayOnce sync.Once
	takeAwayP    *pgxpool.Pool
	takeAwayErr  error
)

// takeAwayPool is the pool of takeAway's statements, shared by the tests of the package.
func takeAwayPool(t *testing.T) *pgxpool.Pool {
	takeAwayOnce.Do(func() {
		cfg, err := pgxpool.ParseConfig(testdb.URL())
		if err != nil {
			takeAwayErr = err
			return
		}
		cfg.MaxConns = 4
		cfg.MaxConnIdleTime = 5 * time.Second
		takeAwayP, takeAwayErr = pgxpool.NewWithConfig(context.Background(), cfg)
	})
	require.NoError(t, takeAwayErr)
	return takeAwayP
}

// closeTakeAwayPool closes takeAwayPool's pool, if it was made (TestMain).
func closeTakeAwayPool() {
	if takeAwayP != nil {
		takeAwayP.Close()
	}
}

// 1,000 messages whose handler inserts a row into a table of its own and acks in the same
// transaction (PgxTxHandler, StdTxHandler), while some claims are taken away mid-handling (a
// lease run out, a lock connection terminated): every message has exactly one row at the end,
// in both claim modes and on both drivers.
func TestAckInTx_exactlyOneRowPerMessage(t *testing.T) {
	t.Parallel()
	for _, drv := range []string{"pgx", "libpq"} {
		for _, mode := range claimModes {
			t.Run(drv+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				topic := testdb.Topic(t, "")
				claims := tables(topic).Claims
				handled := `"handled_` + watermill.NewShortUUID() + `"`
				pool := testdb.Pgx(t)
				_, err := pool.Exec(ctx, `CREATE TABLE `+handled+` (uuid text NOT NULL, by_sub int NOT NULL)`)
				require.NoError(t, err)
				t.Cleanup(func() { _, _ = testdb.Pgx(t).Exec(context.Background(), `DROP TABLE `+handled) })

				var db sqlbroker.DB
				var stdPool *sql.DB
				if drv == "pgx" {
					db = sqlbroker.Pgx(pool)
				} else {
					stdPool = testdb.Std(t)
					db = sqlbroker.StdSQL(stdPool)
				}
				pub := newPublisher(t, db)
				const n = 1000
				require.NoError(t, pub.Publish(topic, numberedMessages(n)...))

				router, err := message.NewRouter(message.RouterConfig{}, nil)
				require.NoError(t, err)
				var takenAway, lostAcks atomic.Int64
				var subs []*sqlbroker.Subscriber
				for i := range 2 {
					sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
						ConsumerGroup: "g", ClaimMode: mode, InitializeSchema: true, MaxInFlight: 16,
						PollInterval: 50 * time.Millisecond, NackBackoff: sqlbroker.NoBackoff,
						LockCheckInterval: 100 * time.Millisecond,
					}, nil)
					require.NoError(t, err)
					t.Cleanup(func() { _ = sub.Close() })
					subs = append(subs, sub)
					work := func(ctx context.Context, exec func(string, ...any) error, msg *message.Message) error {
						num, _ := strconv.Atoi(string(msg.Payload))
						attempt, _ := sqlbroker.AttemptFromContext(ctx)
						if num%25 == 0 && attempt == 1 {
							off, ok := sqlbroker.OffsetFromContext(ctx)
							require.True(t, ok)
							takenAway.Add(1)
							takeAway(t, mode, topic, off)
						}
						return exec(`INSERT INTO `+handled+` (uuid, by_sub) VALUES ($1, $2)`, msg.UUID, i)
					}
					var h message.NoPublishHandlerFunc
					if drv == "pgx" {
						h = sqlbroker.PgxTxHandler(pool, func(ctx context.Context, tx pgx.Tx, msg *message.Message) error {
							return work(ctx, func(q string, args ...any) error { _, err := tx.Exec(ctx, q, args...); return err }, msg)
						})
					} else {
						h = sqlbroker.StdTxHandler(stdPool, func(ctx context.Context, tx *sql.Tx, msg *message.Message) error {
							return work(ctx, func(q string, args ...any) error { _, err := tx.ExecContext(ctx, q, args...); return err }, msg)
						})
					}
					router.AddNoPublisherHandler(fmt.Sprintf("h%d", i), topic, sub, func(msg *message.Message) error {
						err := h(msg)
						if errors.Is(err, sqlbroker.ErrLeaseLost) {
							lostAcks.Add(1)
						}
						return err
					})
				}
				rctx, cancel := context.WithCancel(ctx)
				defer cancel()
				go func() { _ = router.Run(rctx) }()
				<-router.Running()
				defer router.Close()

				testdb.Eventually(t, 2*time.Minute, "a row for every message", func() bool {
					return queryInt(t, `SELECT count(DISTINCT uuid) FROM `+handled) == n
				})
				testdb.Eventually(t, time.Minute, "every claim settled", func() bool {
					return queryInt(t, `SELECT count(*) FROM `+claims) == 0
				})
				assert.Equal(t, n, queryInt(t, `SELECT count(*) FROM `+handled), "a message has more than one row")
				assert.Zero(t, queryInt(t, `SELECT count(*) FROM (SELECT uuid FROM `+handled+` GROUP BY uuid HAVING count(*) <> 1) x`))
				t.Logf("claims taken away %d, acks in a transaction refused with ErrLeaseLost %d", takenAway.Load(), lostAcks.Load())
				assert.Positive(t, takenAway.Load())
			})
		}
	}
}

func numberedMessages(n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
	}
	return msgs
}

// AckInTx settles the message with the caller's commit: the Router's later Ack is not counted
// as stale, the claims table is empty, and a rollback leaves the message to be delivered again.
func TestAckInTx_commitSettlesRollbackRedelivers(t *testing.T) {
	t.Parallel()
	for _, mode := range claimModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			pool := testdb.Pgx(t)
			pub := newPublisher(t, pgxDB(t))
			sub := newSubscriber(t, sqlbroker.SubscriberConfig{ClaimMode: mode, NackBackoff: sqlbroker.NoBackoff, PollInterval: 20 * time.Millisecond})
			publish(t, pub, topic, "a")
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)

			m := receive(t, msgs, 10*time.Second)
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			require.NoError(t, sqlbroker.AckInTx(ctx, sqlbroker.PgxTx(tx), m))
			require.NoError(t, tx.Rollback(ctx))
			m.Nack() // rolled back: given back as usual
			m = receive(t, msgs, 10*time.Second)
			assert.Equal(t, "2", m.Metadata.Get(sqlbroker.MetadataAttempt))

			tx, err = pool.Begin(ctx)
			require.NoError(t, err)
			require.NoError(t, sqlbroker.AckInTx(ctx, sqlbroker.PgxTx(tx), m))
			require.NoError(t, tx.Commit(ctx))
			assert.Zero(t, queryInt(t, "SELECT count(*) FROM "+tables(topic).Claims))
			m.Ack()
			testdb.Eventually(t, 10*time.Second, "the ack counted", func() bool { return sub.Stats().Acked == 1 })
			st := sub.Stats()
			assert.Zero(t, st.StaleSettlements)
			assert.Zero(t, st.InFlight)
			if mode == sqlbroker.ClaimAdvisoryLock {
				testdb.Eventually(t, 10*time.Second, "the lock dropped", func() bool { return sub.Stats().LocksHeld == 0 })
			}
			noMessage(t, msgs, 300*time.Millisecond)

			err = sqlbroker.AckInTx(ctx, sqlbroker.PgxTx(tx), message.NewMessage(watermill.NewUUID(), nil))
			require.ErrorIs(t, err, sqlbroker.ErrNotDelivered)
			err = sqlbroker.AckInTx(ctx, pgxDB(t), m)
			var cerr *sqlbroker.ConfigError
			require.ErrorAs(t, err, &cerr)
		})
	}
}

// A lease extension of a message that AckInTx acks meanwhile: the extension was sent before
// AckInTx marked the delivery, and waits on the claim's row for the caller's transaction;
// once that commits, the acked message is gone from the row. The extension must not take that
// for a lost lease: no lease is counted lost, the message's context is not cancelled (a
// handler's commit under that context may fail after it was applied), and the other message
// of the row keeps its lease. The test's transaction locks the row before the extension comes,
// so that the extension waits with the acked message in it, as it does when it reaches the
// row just after AckInTx's statement.
func TestAckInTx_L4_extensionBehindItsTransactionLosesNoLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pool := testdb.Pgx(t)
	claims := tables(topic).Claims
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "a", "b")
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{MaxInFlight: 2, BatchSize: 2, LeaseTTL: 10 * time.Second, LeaseRenewInterval: time.Second})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	a, b := receive(t, msgs, 10*time.Second), receive(t, msgs, 10*time.Second)
	require.Equal(t, 1, queryInt(t, "SELECT count(*) FROM "+claims+" WHERE cardinality(offsets) = 2"), "both messages in one claim row")
	visibleAt := func() (at time.Time) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT "visible_at" FROM `+claims).Scan(&at))
		return at
	}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var pid int
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	_, err = tx.Exec(ctx, "SELECT 1 FROM "+claims+" FOR UPDATE")
	require.NoError(t, err)
	before := visibleAt()
	testdb.Eventually(t, 10*time.Second, "an extension waiting for the transaction", func() bool {
		return queryInt(t, "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", pid) > 0
	})
	require.NoError(t, sqlbroker.AckInTx(ctx, sqlbroker.PgxTx(tx), a))
	require.NoError(t, tx.Commit(ctx))
	// The waiting extension writes the row once the transaction is gone; the next one comes a
	// LeaseRenewInterval later, after the extender has dealt with the first one's outcome.
	var first time.Time
	testdb.Eventually(t, 10*time.Second, "the waiting extension applied", func() bool { first = visibleAt(); return first.After(before) })
	testdb.Eventually(t, 10*time.Second, "the next extension applied", func() bool { return visibleAt().After(first) })

	assert.Zero(t, sub.Stats().LeasesLost, "a lease counted lost")
	assert.NoError(t, a.Context().Err(), "the context of the message acked in the transaction")
	assert.NoError(t, b.Context().Err(), "the context of the other message of the row")
	a.Ack()
	b.Ack()
	testdb.Eventually(t, 10*time.Second, "both acks counted", func() bool { return sub.Stats().Acked == 2 })
	assert.Zero(t, sub.Stats().StaleSettlements)
}
