package sqlbroker_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// An idle subscription does not poll by itself every PollInterval (here an hour); a message
// written without NOTIFY by another process (the insert statement run directly, through
// another driver) is found by the process's shared poll, every IdlePollInterval.
func TestIdle_sharedPollFindsUnannouncedMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{PollInterval: time.Hour, IdlePollInterval: 100 * time.Millisecond})
	require.NoError(t, sub.SubscribeInitialize(topic))
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	noMessage(t, msgs, 300*time.Millisecond) // the first claim found nothing: it is parked

	store := offsets.NewStore(offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic), false)
	other := dbx.NewStdPool(testdb.Std(t))
	require.NoError(t, store.Insert(ctx, other, []offsets.Row{{UUID: "unannounced", Payload: []byte("x"), Metadata: "{}"}}, ""))

	m := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "unannounced", m.UUID)
	m.Ack()
}

// A lease of another consumer that runs out while this subscription is parked (it cannot know
// when) is found by the shared poll, and the message is redelivered to it (L5).
func TestIdle_L5_leaseRunOutFoundBySharedPoll(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	dying := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", LeaseTTL: 2 * time.Second, LeaseRenewInterval: 200 * time.Millisecond})
	publish(t, pub, topic, "x")
	msgs, err := dying.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	rep, err := dying.Shutdown(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, rep.LeasesLeft) // its lease runs out within 2 s

	other := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: time.Hour, IdlePollInterval: 100 * time.Millisecond})
	again, err := other.Subscribe(ctx, topic)
	require.NoError(t, err)
	m2 := receive(t, again, 10*time.Second)
	assert.Equal(t, m.UUID, m2.UUID)
	assert.Equal(t, "2", m2.Metadata.Get(sqlbroker.MetadataAttempt))
	m2.Ack()
}

// Advisory mode: a claim whose lock went with its connection is an orphan; the parked
// subscription takes it over once its delivery is settled (refused), through the shared poll,
// although on pgx it never polls by itself (A2, A3).
func TestIdle_A2_orphanFoundBySharedPoll(t *testing.T) {
	t.Parallel()
	for name, db := range map[string]func(*testing.T) sqlbroker.DB{"pgx": pgxDB, "libpq": stdDB} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, pgxDB(t))
			// database/sql cannot listen: its shared poll runs every PollInterval (and writes
			// the lock counts into its text).
			poll := time.Hour
			if name == "libpq" {
				poll = 200 * time.Millisecond
			}
			sub, err := sqlbroker.NewSubscriber(db(t), sqlbroker.SubscriberConfig{
				ConsumerGroup: "g", ClaimMode: sqlbroker.ClaimAdvisoryLock, InitializeSchema: true,
				PollInterval: poll, IdlePollInterval: 100 * time.Millisecond, LockCheckInterval: 100 * time.Millisecond,
			}, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			require.NoError(t, sub.SubscribeInitialize(topic))
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			publish(t, pub, topic, "x")
			m := receive(t, msgs, 10*time.Second)

			key1 := advisory.Key1(tables(topic).Messages, "g")
			pid := queryInt(t, `SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND classid = $1::int4::oid`, key1)
			queryInt(t, `SELECT count(*) FROM (SELECT pg_terminate_backend($1)) x`, pid)
			select {
			case <-m.Context().Done():
			case <-time.After(10 * time.Second):
				t.Fatal("the delivery was not told that its lock was lost")
			}
			m.Ack() // refused: the lock is gone

			m2 := receive(t, msgs, 10*time.Second)
			assert.Equal(t, m.UUID, m2.UUID)
			assert.Equal(t, "2", m2.Metadata.Get(sqlbroker.MetadataAttempt))
			m2.Ack()
			testdb.Eventually(t, 10*time.Second, "the redelivery acked", func() bool { return sub.Stats().Acked == 1 })
		})
	}
}

// A thousand subscriptions of one Subscriber (a service with many handlers over many topics),
// one message delivered to each; Shutdown leaves nothing: no claim, no lock, no connection of
// the subscriptions, no goroutine (TestMain checks the goroutines of the whole package). The
// advisory mode holds a connection per subscription and runs with fewer.
func TestIdle_thousandSubscriptions(t *testing.T) {
	if testing.Short() {
		t.Skip("creates 3,000 tables")
	}
	for _, tc := range []struct {
		mode sqlbroker.ClaimMode
		n    int
	}{{sqlbroker.ClaimLease, 1000}, {sqlbroker.ClaimAdvisoryLock, 20}} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			ctx := context.Background()
			// A pool of the test's own, whose backends carry an application_name of their own:
			// those beyond the pool's connections are the subscriptions' own.
			app := "sqlbroker_" + strings.ToLower(watermill.NewShortUUID())
			pool := ownPgxPool(t, app, 30)
			db := sqlbroker.Pgx(pool)
			logs := &levelLogger{}
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", ClaimMode: tc.mode}, logs)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			topics := make([]string, tc.n)
			for i := range topics {
				topics[i] = testdb.Topic(t, "")
			}
			var next atomic.Int64
			var wg sync.WaitGroup
			for range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := int(next.Add(1)) - 1; i < len(topics); i = int(next.Add(1)) - 1 {
						assert.NoError(t, sub.SubscribeInitialize(topics[i]))
					}
				}()
			}
			wg.Wait()
			require.False(t, t.Failed())

			got := make(chan string, tc.n)
			for _, topic := range topics {
				msgs, err := sub.Subscribe(ctx, topic)
				require.NoError(t, err)
				go func() {
					for m := range msgs {
						got <- m.UUID
						m.Ack()
					}
				}()
			}
			pub := newPublisher(t, db)
			want := map[string]bool{}
			for _, topic := range topics {
				m := message.NewMessage(watermill.NewUUID(), []byte(topic))
				want[m.UUID] = true
				require.NoError(t, pub.Publish(topic, m))
			}
			for range tc.n {
				select {
				case id := <-got:
					require.True(t, want[id], "unexpected or repeated message %s", id)
					delete(want, id)
				case <-time.After(30 * time.Second):
					t.Fatalf("%d of %d messages not delivered", len(want), tc.n)
				}
			}
			testdb.Eventually(t, 30*time.Second, "every ack applied", func() bool { return sub.Stats().Acked == int64(tc.n) })

			// The subscriptions' own connections (the lock connections, the LISTEN connection):
			// the backends of app beyond the pool's connections.
			own := func() int {
				return queryInt(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app) - int(pool.Stat().TotalConns())
			}
			before := own()
			rep, err := sub.Shutdown(ctx)
			require.NoError(t, err)
			// What Shutdown closed, as the server saw it: each of them is gone, and the report
			// counts each. A lock connection lost before Shutdown (logged) and not open again
			// is not in before.
			testdb.Eventually(t, 10*time.Second, "the subscriptions' own connections closed", func() bool { return own() == 0 })
			assert.GreaterOrEqual(t, rep.ConnectionsClosed, before, "connections closed, against the server's count")
			if tc.mode == sqlbroker.ClaimAdvisoryLock {
				assert.GreaterOrEqual(t, before, tc.n-logs.count(watermill.ErrorLogLevel, "Lock connection failed"),
					"a lock connection per subscription")
			}
			if t.Failed() {
				for _, e := range logs.at(watermill.ErrorLogLevel) {
					t.Log(e)
				}
			}
			assert.Equal(t, tc.n, rep.Subscriptions)
			assert.Zero(t, rep.LeasesLeft)
			st := sub.Stats()
			assert.Zero(t, st.InFlight)
			assert.Zero(t, st.LocksHeld)
			claims := 0
			for _, topic := range topics[:min(len(topics), 50)] {
				claims += queryInt(t, fmt.Sprintf(`SELECT count(*) FROM %s`, tables(topic).Claims))
			}
			assert.Zero(t, claims, "claims left")
			key1s := make([]int64, len(topics))
			for i, topic := range topics {
				key1s[i] = int64(advisory.Key1(tables(topic).Messages, "g"))
			}
			assert.Zero(t, queryInt(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
				AND classid::bigint = ANY ($1::bigint[])`, key1s), "advisory locks left")
		})
	}
}
