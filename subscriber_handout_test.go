package sqlbroker_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// L4 at hand-out: a claim offered to the handlers while none takes it (the Router is busy, the
// process is frozen) whose lease runs out meanwhile may be another consumer's already. It is
// dropped while it waits, never handed out late: the first message a handler then gets comes
// from a claim made after the lease ran out, its context live.
func TestSubscriber_L4_leaseRunsOutWhileOffered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	start := time.Now()
	sub, msgs, claims, logger := offeredClaim(t, sqlbroker.SubscriberConfig{MaxInFlight: 2, LeaseTTL: 500 * time.Millisecond})

	// Nothing reads msgs, and no extension gets through: the lease runs out while the
	// message is offered.
	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, lockTableSQL(claims))
	require.NoError(t, err)
	testdb.Eventually(t, 10*time.Second, "the lease ran out in the database", func() bool {
		var n int
		require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM "+claims+" WHERE visible_at <= clock_timestamp()").Scan(&n))
		return n == 1
	})
	testdb.Eventually(t, 5*time.Second, "the offered claim dropped", func() bool {
		return slices.ContainsFunc(logger.since(start), func(e string) bool {
			return strings.Contains(e, "Claim held ahead lost before it was handed out")
		})
	})
	require.NoError(t, tx.Rollback(ctx))

	m := receive(t, msgs, 10*time.Second)
	require.NoError(t, m.Context().Err(), "handed out with its lease already run out")
	// A claim made while the lock was held waited on it longer than the lease, and is dropped
	// as well: the message comes with attempt 2 or later, never with the claim of attempt 1.
	require.NotEqual(t, "1", m.Metadata.Get(sqlbroker.MetadataAttempt), "the first claim was handed out after its lease ran out")
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "ack applied", func() bool { return sub.Stats().Acked == 1 })
}

// L4 at hand-out, a claim taken over: a claim offered to the handlers while none takes it,
// whose extension the database refuses (another consumer holds its row now), is dropped as
// soon as the refusal is known, not when its local deadline passes: its lease here is 20 s,
// and the drop comes within the few extensions after the takeover.
func TestSubscriber_L4_claimTakenOverWhileOffered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, claims, logger := offeredClaim(t, sqlbroker.SubscriberConfig{
		MaxInFlight: 2, LeaseTTL: 20 * time.Second, LeaseRenewInterval: 100 * time.Millisecond,
	})

	start := time.Now()
	_, err := testdb.Pgx(t).Exec(ctx, "UPDATE "+claims+" SET token = token + 1 WHERE token > 0")
	require.NoError(t, err)
	testdb.Eventually(t, 10*time.Second, "the offered claim dropped", func() bool {
		return slices.ContainsFunc(logger.since(start), func(e string) bool {
			return strings.Contains(e, "Claim held ahead lost before it was handed out")
		})
	})
	require.Less(t, time.Since(start), 10*time.Second, "dropped only when its local deadline passed")
}

// offeredClaim publishes one message to a fresh topic and subscribes to it with cfg; nothing
// reads the messages, so once it returns the message is claimed and offered to handlers that
// never come. It returns the subscription's channel and the topic's claims table.
func offeredClaim(t *testing.T, cfg sqlbroker.SubscriberConfig) (*sqlbroker.Subscriber, <-chan *message.Message, string, *recLogger) {
	t.Helper()
	topic := testdb.Topic(t, "")
	publish(t, newPublisher(t, pgxDB(t)), topic, "offered")
	logger := newRecLogger()
	sub, err := sqlbroker.NewSubscriber(pgxDB(t), cfg, logger)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	claims := tables(topic).Claims
	testdb.Eventually(t, 10*time.Second, "the message claimed", func() bool {
		return queryInt(t, "SELECT count(*) FROM "+claims+" WHERE token > 0") == 1
	})
	return sub, msgs, claims, logger
}
