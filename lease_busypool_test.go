package sqlbroker_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A lease holds while the pool it is extended on is busy with other work: twenty goroutines
// take turns on a pool of three connections (the subscription's LISTEN connection is one of
// its own, outside the pool), each holding one for 100 ms, so that a connection comes about a second after
// it is asked for, more than LeaseRenewInterval (200 ms) and less than what is left of the
// lease (2 s). The extension waits in the pool's line instead of giving up at each renew
// interval and queueing again at its end: the message in the handler keeps its lease for 4 s
// and its ack applies.
func TestSubscriber_leaseHoldsOnABusyPool(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := ownPgxPool(t, "", 3)
	db := sqlbroker.Pgx(pool)
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, db)
	publish(t, pub, topic, "held")
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{InitializeSchema: true, MaxInFlight: 1,
		LeaseTTL: 2 * time.Second, LeaseRenewInterval: 200 * time.Millisecond,
		PollInterval: 50 * time.Millisecond, RetryInterval: 50 * time.Millisecond}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)

	busy, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for busy.Err() == nil {
				c, err := pool.Acquire(busy)
				if err != nil {
					return
				}
				time.Sleep(100 * time.Millisecond)
				c.Release()
			}
		}()
	}
	select {
	case <-m.Context().Done():
		t.Fatalf("the lease was lost while the pool was busy: %v", context.Cause(m.Context()))
	case <-time.After(4 * time.Second):
	}
	stop()
	wg.Wait()
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool { return sub.Stats().Acked == 1 })
	assert.Zero(t, sub.Stats().LeasesLost)
	assert.Zero(t, sub.Stats().StaleSettlements)
}

// A claim that waited for a connection counts its lease from when it had one, not from when
// it asked: the database writes the lease after that. On a pool of one connection, the test
// holds the connection while a claim waits for it for 1.2 s (less than half the 3 s lease, so
// no confirming extension runs), then takes it again right after the claim, until 3.6 s after
// the claim began to wait. Counted from the claim's start, the lease would run out locally at
// 3 s, while the extension still waited in the pool's line; counted from when the claim had
// its connection, it runs until 4.2 s, and the extension that gets the connection at 3.6 s
// keeps it.
func TestSubscriber_claimThatWaitedForAConnectionKeepsItsLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := ownPgxPool(t, "", 1)
	db := sqlbroker.Pgx(pool)
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t)) // a pool of its own
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{InitializeSchema: true, MaxInFlight: 1,
		LeaseTTL: 3 * time.Second, LeaseRenewInterval: 300 * time.Millisecond,
		PollInterval: 50 * time.Millisecond, RetryInterval: 50 * time.Millisecond}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	testdb.Eventually(t, 10*time.Second, "the subscriber idle", func() bool {
		return sqlbroker.SubscriberRunning(sub) == 0 && sqlbroker.SubscriberAcquiring(sub) == 0
	})

	first, err := pool.Acquire(ctx)
	require.NoError(t, err)
	publish(t, pub, topic, "waited")
	testdb.Eventually(t, 10*time.Second, "the claim waiting for the connection", func() bool {
		return sqlbroker.SubscriberAcquiring(sub) > 0
	})
	began := time.Now()
	// The pool hands its connection out in the order asked: this take waits behind the claim.
	second := make(chan *pgxpool.Conn, 1)
	go func() {
		c, err := pool.Acquire(ctx)
		if err != nil {
			close(second)
			return
		}
		second <- c
	}()
	time.Sleep(time.Until(began.Add(1200 * time.Millisecond)))
	first.Release()
	m := receive(t, msgs, 10*time.Second)
	c, ok := <-second
	require.True(t, ok, "the test's second take of the connection failed")
	time.Sleep(time.Until(began.Add(3600 * time.Millisecond)))
	c.Release()

	select {
	case <-m.Context().Done():
		t.Fatalf("the lease was lost while its extension waited for the connection: %v", context.Cause(m.Context()))
	case <-time.After(time.Until(began.Add(5 * time.Second))):
	}
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool { return sub.Stats().Acked == 1 })
	assert.Zero(t, sub.Stats().LeasesLost)
	assert.Zero(t, sub.Stats().StaleSettlements)
}
