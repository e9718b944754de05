package sqlbroker_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// An ack that races its own lease's extension is applied (L3): the extension loop runs every
// 20 ms while handlers ack after 0-60 ms, so many acks meet an extension of the same claim
// row. A settlement is refused only when the claim is no longer the delivery's, which never
// happens here: 0 stale settlements, 0 leases lost, every message delivered exactly once.
func TestSubscriber_L3_ackRacingExtensionIsApplied(t *testing.T) {
	t.Parallel()
	const n = 10000
	for _, mode := range []sqlbroker.ClaimMode{sqlbroker.ClaimLease, sqlbroker.ClaimAdvisoryLock} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, pgxDB(t))
			msgs := make([]*message.Message, n)
			for i := range msgs {
				msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("x"))
			}
			require.NoError(t, pub.Publish(topic, msgs...))

			sub := newSubscriber(t, sqlbroker.SubscriberConfig{
				ClaimMode:          mode,
				LeaseTTL:           5 * time.Second,
				LeaseRenewInterval: 20 * time.Millisecond,
				MaxInFlight:        256,
			})
			out, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)

			var mu sync.Mutex
			seen := make(map[string]int, n)
			var wg sync.WaitGroup
			for range n {
				m := receive(t, out, 30*time.Second)
				mu.Lock()
				seen[m.UUID]++
				mu.Unlock()
				wg.Add(1)
				go func() {
					defer wg.Done()
					time.Sleep(time.Duration(rand.IntN(60)) * time.Millisecond) // the handler's work
					m.Ack()
				}()
			}
			wg.Wait()
			testdb.Eventually(t, 30*time.Second, "every ack settled", func() bool {
				st := sub.Stats()
				return st.Acked+st.StaleSettlements == n
			})
			noMessage(t, out, 200*time.Millisecond)

			st := sub.Stats()
			assert.Equal(t, int64(0), st.StaleSettlements, "valid acks refused as stale")
			assert.Equal(t, int64(0), st.LeasesLost)
			assert.Equal(t, int64(n), st.Acked)
			dups := 0
			for _, c := range seen {
				dups += c - 1
			}
			assert.Equal(t, n, len(seen))
			assert.Equal(t, 0, dups, "messages delivered more than once")
			assert.Equal(t, 0, claimedPG(t, tables(topic).Claims, "true"), "claims left")
		})
	}
}

// A claim that waited on a table lock longer than the lease (a migration's LOCK TABLE) writes
// a lease counted from when it wrote the claim, not from when the statement began, and the
// subscriber confirms it by an extension as the claim returns: the claim that waited hands
// the message out (attempt 1), the group's other consumer does not take the message again
// while its handler works, and the message is handled once (C1, L1).
func TestSubscriber_C1_claimBlockedLongerThanLeaseKeepsItsLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pool := testdb.Pgx(t)
	pub := newPublisher(t, pgxDB(t))
	// The lease is short, for the lock to outlast it, but leaves a loaded machine (a race
	// build, the package's other tests in parallel) more than a second of failed extensions.
	const lease = 2 * time.Second
	cfg := sqlbroker.SubscriberConfig{ConsumerGroup: "g", LeaseTTL: lease, LeaseRenewInterval: 300 * time.Millisecond,
		PollInterval: 50 * time.Millisecond}
	var outs []<-chan *message.Message
	for range 2 {
		sub := newSubscriber(t, cfg)
		out, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		outs = append(outs, out)
	}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, lockTableSQL(tables(topic).Claims))
	require.NoError(t, err)
	publish(t, pub, topic, "blocked")
	testdb.Eventually(t, 10*time.Second, "a claim waiting on the table lock", func() bool {
		return queryInt(t, "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = $1::regclass", tables(topic).Claims) > 0
	})
	time.Sleep(lease + time.Second) // longer than the lease: what is tested is the wait
	require.NoError(t, tx.Commit(ctx))

	var mu sync.Mutex
	var got []*message.Message
	done := make(chan struct{})
	var wg sync.WaitGroup
	for _, out := range outs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case m, ok := <-out:
					if !ok {
						return
					}
					mu.Lock()
					got = append(got, m)
					mu.Unlock()
				case <-done:
					return
				}
			}
		}()
	}
	testdb.Eventually(t, 10*time.Second, "the message delivered", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) > 0
	})
	time.Sleep(lease + time.Second) // the handler works past the lease; it is extended meanwhile
	close(done)
	wg.Wait()
	for _, m := range got {
		t.Logf("attempt %s offset %s", m.Metadata.Get(sqlbroker.MetadataAttempt), m.Metadata.Get(sqlbroker.MetadataOffset))
	}
	t.Logf("claims: %v", claimedPG(t, tables(topic).Claims, "visible_at < now()"))
	require.Len(t, got, 1, "the message was taken again while its handler worked")
	assert.Equal(t, "1", got[0].Metadata.Get(sqlbroker.MetadataAttempt), "the claim that waited on the lock handed the message out")
	got[0].Ack()
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool {
		return claimedPG(t, tables(topic).Claims, "true") == 0
	})
}
