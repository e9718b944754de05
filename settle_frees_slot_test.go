package sqlbroker_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A settled message frees its handler's place when its ack is queued, in both claim modes: a
// message claimed ahead goes to a handler while the acks before it wait for their statement
// (here, behind a table lock on the claims). The places among the claims held are not freed
// early in advisory mode: the subscription claims nothing more meanwhile.
func TestSubscriber_ackFreesHandlerPlaceBeforeItsStatement(t *testing.T) {
	t.Parallel()
	for _, mode := range []sqlbroker.ClaimMode{sqlbroker.ClaimLease, sqlbroker.ClaimAdvisoryLock} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			db := pgxDB(t)
			pub := newPublisher(t, db)
			publish(t, pub, topic, "1", "2", "3", "4", "5")
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ClaimMode: mode, InitializeSchema: true,
				MaxInFlight: 2, BatchSize: 2, PollInterval: 20 * time.Millisecond, RetryInterval: 50 * time.Millisecond}, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			m1, m2 := receive(t, msgs, 10*time.Second), receive(t, msgs, 10*time.Second)
			testdb.Eventually(t, 10*time.Second, "two in handlers and two claimed ahead", func() bool { return sub.Stats().InFlight == 4 })

			tx, err := testdb.Pgx(t).Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, "LOCK TABLE "+tables(topic).Claims+" IN EXCLUSIVE MODE")
			require.NoError(t, err)
			m1.Ack()
			m2.Ack()
			m3 := receive(t, msgs, 10*time.Second) // the acks wait behind the lock meanwhile
			assert.Equal(t, int64(0), sub.Stats().Acked, "an ack applied through the table lock")
			assert.Equal(t, 4, sub.Stats().InFlight, "claimed more while the acks waited")
			require.NoError(t, tx.Rollback(ctx))

			m3.Ack()
			receive(t, msgs, 10*time.Second).Ack()
			receive(t, msgs, 10*time.Second).Ack()
			testdb.Eventually(t, 10*time.Second, "every ack applied", func() bool { return sub.Stats().Acked == 5 })
		})
	}
}
