package sqlbroker_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A reset past the newest message places the group after every message kept: it receives the
// next message published, and ResetGroup returned that message's offset (nothing else was
// published meanwhile), not the offset asked for.
func TestAdmin_resetPastTheEndReturnsTheNextMessagesOffset(t *testing.T) {
	t.Parallel()
	for _, d := range []database{{"pgx", pgxDB}, {"libpq", stdDB}} {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			db := d.open(t)
			pub := newPublisher(t, db)
			publish(t, pub, topic, numbered(3)...)
			cfg := sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond}
			sub := newSubscriberOn(t, db, cfg)
			_, err := sub.Subscribe(ctx, topic) // creates the group
			require.NoError(t, err)
			_, err = sub.Shutdown(ctx)
			require.NoError(t, err)

			next, err := newAdmin(t, db).ResetGroup(ctx, topic, "g", 100)
			require.NoError(t, err)

			sub = newSubscriberOn(t, db, cfg)
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			noMessage(t, msgs, 200*time.Millisecond)
			publish(t, pub, topic, "next")
			m := receive(t, msgs, 10*time.Second)
			m.Ack()
			assert.Equal(t, "next", string(m.Payload))
			assert.Equal(t, strconv.FormatInt(next, 10), m.Metadata.Get(sqlbroker.MetadataOffset),
				"ResetGroup returned %d, the group received offset %s", next, m.Metadata.Get(sqlbroker.MetadataOffset))
		})
	}
}
