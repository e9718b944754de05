package sqlbroker_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A message written by another process (here: the library's insert statement run directly,
// so no in-process wake-up is involved) reaches a subscriber that polls once an hour: the
// NOTIFY of the insert wakes it through the process's LISTEN connection.
func TestNotify_wakesSubscriberWithoutPolling(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{PollInterval: time.Hour})
	require.NoError(t, sub.SubscribeInitialize(topic))
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	noMessage(t, msgs, 300*time.Millisecond) // the first poll found nothing; the next is an hour away

	store := offsets.NewStore(offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic), false)
	other := dbx.NewStdPool(testdb.Std(t)) // another driver, another pool
	require.NoError(t, store.Insert(ctx, other, []offsets.Row{{UUID: "from-elsewhere", Payload: []byte("x"), Metadata: "{}"}}, listen.Channel))

	m := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "from-elsewhere", m.UUID)
	m.Ack()
}
