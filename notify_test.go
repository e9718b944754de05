package sqlbroker_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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

// The LISTEN connection of a pgx pool is set up as the pool's own connections are: the pool's
// BeforeConnect hook (here, the one that names the connection's application) runs on it, as
// it would to fetch a password per connection or set a role.
func TestNotify_listenConnectionRunsThePoolsConnectHooks(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	app := "sqlblistenhook" + strings.ToLower(watermill.NewShortUUID())
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	cfg.BeforeConnect = func(_ context.Context, cc *pgx.ConnConfig) error {
		cc.RuntimeParams["application_name"] = app
		return nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	sub, err := sqlbroker.NewSubscriber(sqlbroker.Pgx(pool), sqlbroker.SubscriberConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	_, err = sub.Subscribe(ctx, testdb.Topic(t, ""))
	require.NoError(t, err)
	testdb.Eventually(t, 10*time.Second, "the LISTEN connection named by the pool's hook", func() bool {
		return queryInt(t, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %'", app) == 1
	})
}
