package sqlbroker_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A publish of 10,000 messages with some of them delayed (4 bind parameters a row) is split
// into statements that each stay under the database's limit of bind parameters (SQLite's
// 32,766, PostgreSQL's 65,535): in one call without grouping, in a grouped statement of
// MaxGroupRows 10,000, and in a caller's transaction. Every message is received once.
func TestPublisher_largeDelayedBatchUnderParameterLimit(t *testing.T) {
	t.Parallel()
	databases := []database{{"pgx", pgxDB}, {"lib/pq", stdDB}, {"sqlite", sqliteDB}}
	paths := []struct {
		name string
		cfg  sqlbroker.PublisherConfig
		tx   bool
	}{
		{"single", sqlbroker.PublisherConfig{DisableGroupInsert: true}, false},
		{"grouped", sqlbroker.PublisherConfig{MaxGroupRows: 10000}, false},
		{"tx", sqlbroker.PublisherConfig{}, true},
	}
	for _, d := range databases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			for _, path := range paths {
				for _, allDelayed := range []bool{false, true} {
					t.Run(fmt.Sprintf("%s/allDelayed=%v", path.name, allDelayed), func(t *testing.T) {
						largeDelayedBatch(t, d, path.cfg, path.tx, allDelayed)
					})
				}
			}
		})
	}
}

func largeDelayedBatch(t *testing.T, d database, cfg sqlbroker.PublisherConfig, inTx, allDelayed bool) {
	const n = 10000
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	db, raw := d.openSQL(t)
	cfg.InitializeSchema = true
	msgs := make([]*message.Message, n)
	want := make(map[string]bool, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("x"))
		if allDelayed || i == n/2 {
			delay.Message(msgs[i], delay.For(200*time.Millisecond))
		}
		want[msgs[i].UUID] = true
	}
	if inTx {
		publishInTx(t, d, raw, cfg, topic, msgs)
	} else {
		pub, err := sqlbroker.NewPublisher(db, cfg, nil)
		require.NoError(t, err)
		defer pub.Close()
		require.NoError(t, pub.Publish(topic, msgs...))
	}
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", BatchSize: 500, MaxInFlight: 500})
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for range n {
		m := receive(t, ch, 30*time.Second)
		require.True(t, want[m.UUID], "message %s received twice, or not sent", m.UUID)
		delete(want, m.UUID)
		m.Ack()
	}
	noMessage(t, ch, 300*time.Millisecond)
}

// publishInTx publishes msgs to topic with a publisher inside a transaction of d's database
// (raw's, on SQLite), and commits.
func publishInTx(t *testing.T, d database, raw rawSQL, cfg sqlbroker.PublisherConfig, topic string, msgs []*message.Message) {
	t.Helper()
	ctx := context.Background()
	var txDB sqlbroker.DB
	var commit func() error
	switch d.name {
	case "pgx":
		tx, err := testdb.Pgx(t).Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx)
		txDB, commit = sqlbroker.PgxTx(tx), func() error { return tx.Commit(ctx) }
	case "lib/pq":
		tx, err := testdb.Std(t).BeginTx(ctx, nil)
		require.NoError(t, err)
		defer tx.Rollback()
		txDB, commit = sqlbroker.StdTx(tx), tx.Commit
	default:
		tx, err := raw.lite.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer tx.Rollback()
		txDB, commit = sqlbroker.SQLiteTx(tx), tx.Commit
	}
	pub, err := sqlbroker.NewPublisher(txDB, cfg, nil)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, msgs...))
	require.NoError(t, commit())
	require.NoError(t, pub.Close())
}
