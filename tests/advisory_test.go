package tests

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A1: a message in work is held by one advisory lock in the library's namespace; ack settles
// it and drops the lock.
func TestAdvisory_A1_deliveryHeldByLock(t *testing.T) {
	t.Parallel()
	for _, d := range drivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			db := d.db(t)
			topic, group := advTopic("adv_a1"), "g"
			key1 := lockKey1(topic, group)
			ids := publishN(t, db, topic, 3)
			sub := advSubscriber(t, db, group, nil)
			ch, err := sub.Subscribe(context.Background(), topic)
			require.NoError(t, err)

			var msgs = receiveAll(t, ch, 3)
			for i, m := range msgs {
				assert.Equal(t, ids[i], m.UUID)
				assert.Equal(t, "1", m.Metadata.Get(sqlbroker.MetadataAttempt))
			}
			assert.Equal(t, 3, advisoryLocks(t, key1))
			assert.Equal(t, 3, sub.Stats().LocksHeld)
			for _, m := range msgs {
				m.Ack()
			}
			testdb.Eventually(t, 5*time.Second, "acks applied", func() bool { return sub.Stats().Acked == 3 })
			assert.Equal(t, 0, advisoryLocks(t, key1))
			assert.Equal(t, 0, sub.Stats().LocksHeld)

			rep, err := sub.Shutdown(context.Background())
			require.NoError(t, err)
			assert.Equal(t, 0, rep.LocksReleased)
			assert.Equal(t, 1, rep.ConnectionsClosed)
			requireNoLocksLeft(t, key1)
		})
	}
}

func receiveAll(t testing.TB, ch <-chan *message.Message, n int) []*message.Message {
	t.Helper()
	out := make([]*message.Message, 0, n)
	for range n {
		out = append(out, receive(t, ch, 10*time.Second))
	}
	return out
}
