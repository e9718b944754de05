// Package migrate checks the migration from watermill-sql against watermill-sql's own
// publisher, subscriber, schema adapter and offsets adapter. It is a module of its own so
// that the library's module does not depend on watermill-sql.
package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

const (
	oldMessages = 10000
	consumed    = 4000
)

// A watermill-sql topic whose group consumed 4,000 of its 10,000 messages (through a real
// watermill-sql subscriber) is migrated, in two runs of which the first is cut short, while
// publishers keep writing to the new topic: the new group receives exactly the 6,000 the old
// group had not consumed and every new message, each once, the migrated ones in their order
// and with their UUID, payload and metadata.
func TestMigrateWatermillSQL_backlogOnceInOrder(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	pool := testdb.Pgx(t)
	topic := testdb.Topic(t, "") // this library's tables, dropped at the end
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS "watermill_%s", "watermill_offsets_%s"`, topic, topic))
		assert.NoError(t, err)
	})
	schema := wsql.DefaultPostgreSQLSchema{}
	offsetsAdapter := wsql.DefaultPostgreSQLOffsetsAdapter{}
	beginner := wsql.BeginnerFromPgx(pool)

	// The old side: 10,000 messages published by watermill-sql, 100 per transaction.
	oldPub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: schema, AutoInitializeSchema: true}, nil)
	require.NoError(t, err)
	want := make([]*message.Message, oldMessages)
	for i := range want {
		want[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"i": %d}`, i)))
		want[i].Metadata.Set("i", strconv.Itoa(i))
		want[i].Metadata.Set("kind", "old")
	}
	for i := 0; i < oldMessages; i += 100 {
		require.NoError(t, oldPub.Publish(topic, want[i:i+100]...))
	}
	require.NoError(t, oldPub.Close())

	// The old group consumes the first 4,000, acking each; watermill-sql commits its
	// position once per batch of 100, after the batch's last ack.
	oldSub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		ConsumerGroup: "billing", SchemaAdapter: schema, OffsetsAdapter: offsetsAdapter, InitializeSchema: true,
	}, nil)
	require.NoError(t, err)
	subCtx, stopOld := context.WithCancel(ctx)
	oldCh, err := oldSub.Subscribe(subCtx, topic)
	require.NoError(t, err)
	for i := 0; i < consumed; i++ {
		m := testdb.Receive(t, oldCh, 30*time.Second)
		require.Equal(t, strconv.Itoa(i), m.Metadata.Get("i"), "watermill-sql's own order")
		m.Ack()
	}
	lastConsumed := func() string {
		var uuid string
		err := pool.QueryRow(ctx, fmt.Sprintf(`SELECT m.uuid FROM "watermill_offsets_%[1]s" o JOIN "watermill_%[1]s" m
			ON m.transaction_id = o.last_processed_transaction_id AND m."offset" = o.offset_acked
			WHERE o.consumer_group = 'billing'`, topic)).Scan(&uuid)
		if err != nil {
			return ""
		}
		return uuid
	}
	testdb.Eventually(t, 30*time.Second, "watermill-sql to commit the 4,000th ack", func() bool {
		return lastConsumed() == want[consumed-1].UUID
	})
	// The old consumer stops: the batch it was handing out is rolled back, not consumed.
	stopOld()
	require.NoError(t, oldSub.Close())
	require.Equal(t, want[consumed-1].UUID, lastConsumed())

	admin, err := sqlbroker.NewAdmin(sqlbroker.Pgx(pool), sqlbroker.AdminConfig{})
	require.NoError(t, err)
	dry, err := admin.MigrateWatermillSQL(ctx, topic, "billing", sqlbroker.MigrateOptions{DryRun: true})
	require.NoError(t, err)
	assert.Equal(t, int64(oldMessages-consumed), dry.Migrated)

	// The new side: a subscriber in order (one in flight), and publishers writing meanwhile.
	newSub, err := sqlbroker.NewSubscriber(sqlbroker.Pgx(pool), sqlbroker.SubscriberConfig{
		ConsumerGroup: "billing", InitializeSchema: true, MaxInFlight: 1,
	}, nil)
	require.NoError(t, err)
	defer newSub.Close()
	newCh, err := newSub.Subscribe(ctx, topic)
	require.NoError(t, err)
	// Room for 1,000 messages: the migration and the publishers run past it.
	testdb.SmallPartitions(t, offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic), 1000, 1)
	newPub, err := sqlbroker.NewPublisher(sqlbroker.Pgx(pool), sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer newPub.Close()

	var published atomic.Int64
	stopPublishing := make(chan struct{})
	var pubs sync.WaitGroup
	var stopOnce sync.Once
	stop := func() { stopOnce.Do(func() { close(stopPublishing) }); pubs.Wait() }
	defer stop() // before newPub.Close, on a failure too
	for w := 0; w < 4; w++ {
		pubs.Add(1)
		go func() {
			defer pubs.Done()
			for {
				select {
				case <-stopPublishing:
					return
				default:
				}
				m := message.NewMessage(watermill.NewUUID(), []byte(`{"new": true}`))
				m.Metadata.Set("kind", "new")
				if err := newPub.Publish(topic, m); err != nil {
					t.Errorf("publishing to the new topic: %v", err)
					return
				}
				published.Add(1)
				time.Sleep(time.Millisecond) // a steady trickle, not a flood
			}
		}()
	}

	// A first run cut short once it has copied some batches; the second one resumes.
	cutCtx, cut := context.WithCancel(ctx)
	first := make(chan error, 1)
	var firstRes sqlbroker.MigrateResult
	go func() {
		var err error
		firstRes, err = admin.MigrateWatermillSQL(cutCtx, topic, "billing", sqlbroker.MigrateOptions{BatchSize: 300})
		first <- err
	}()
	testdb.Eventually(t, time.Minute, "a first batch to be copied", func() bool {
		var n int64
		_ = pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM sqlbroker_%s_messages WHERE metadata::jsonb->>'kind' = 'old'`, topic)).Scan(&n)
		return n >= 600
	})
	cut()
	firstErr := <-first
	t.Logf("first run: %+v, %v", firstRes, firstErr)
	second, err := admin.MigrateWatermillSQL(ctx, topic, "billing", sqlbroker.MigrateOptions{BatchSize: 300})
	require.NoError(t, err)
	t.Logf("second run: %+v", second)
	again, err := admin.MigrateWatermillSQL(ctx, topic, "billing", sqlbroker.MigrateOptions{})
	require.NoError(t, err)
	assert.Equal(t, int64(0), again.Migrated, "a run after the end copies nothing")
	// A few more new messages after the migration ended, then the publishers stop.
	before := published.Load()
	testdb.Eventually(t, 30*time.Second, "publishing after the migration", func() bool { return published.Load() >= before+20 })
	stop()

	total := int(oldMessages-consumed) + int(published.Load())
	seen := map[string]int{}
	var old []*message.Message
	for len(seen) < total {
		m := testdb.Receive(t, newCh, time.Minute)
		seen[m.UUID]++
		if seen[m.UUID] > 1 {
			t.Fatalf("message %s (%s) received twice", m.UUID, m.Metadata.Get("kind"))
		}
		if m.Metadata.Get("kind") == "old" {
			old = append(old, m)
		}
		m.Ack()
	}
	select {
	case m := <-newCh:
		t.Fatalf("a message beyond the expected ones: %s (%s)", m.UUID, m.Metadata.Get("kind"))
	case <-time.After(500 * time.Millisecond):
	}
	require.Len(t, old, oldMessages-consumed, "exactly the messages the old group had not consumed")
	for j, m := range old {
		w := want[consumed+j]
		require.Equal(t, w.UUID, m.UUID, "migrated message %d out of order", j)
		var got, orig any
		require.NoError(t, json.Unmarshal(m.Payload, &got))
		require.NoError(t, json.Unmarshal(w.Payload, &orig))
		require.Equal(t, orig, got, "payload of %s", w.UUID)
		require.Equal(t, w.Metadata.Get("i"), m.Metadata.Get("i"))
		require.Equal(t, "old", m.Metadata.Get("kind"))
	}
	assert.Equal(t, want[oldMessages-1].UUID, lastConsumed(), "the old group's position is at the end")
}

// watermill-sql's default group is the empty name; a group that never subscribed (a typo) is
// refused, naming the groups there are, and nothing is copied.
func TestMigrateWatermillSQL_defaultGroupAndUnknownGroup(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := testdb.Pgx(t)
	topic := testdb.Topic(t, "")
	t.Cleanup(func() {
		_, err := pool.Exec(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS "watermill_%s", "watermill_offsets_%s"`, topic, topic))
		assert.NoError(t, err)
	})
	beginner := wsql.BeginnerFromPgx(pool)
	schema := wsql.DefaultPostgreSQLSchema{SubscribeBatchSize: 1} // one message per transaction
	oldPub, err := wsql.NewPublisher(beginner, wsql.PublisherConfig{SchemaAdapter: schema, AutoInitializeSchema: true}, nil)
	require.NoError(t, err)
	var uuids []string
	for i := 0; i < 10; i++ {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"i": %d}`, i)))
		uuids = append(uuids, m.UUID)
		require.NoError(t, oldPub.Publish(topic, m))
	}
	oldSub, err := wsql.NewSubscriber(beginner, wsql.SubscriberConfig{
		SchemaAdapter: schema, OffsetsAdapter: wsql.DefaultPostgreSQLOffsetsAdapter{}, InitializeSchema: true,
	}, nil)
	require.NoError(t, err)
	subCtx, stopOld := context.WithCancel(ctx)
	ch, err := oldSub.Subscribe(subCtx, topic)
	require.NoError(t, err)
	for i := 0; i < 3; i++ {
		testdb.Receive(t, ch, 30*time.Second).Ack()
	}
	testdb.Eventually(t, 30*time.Second, "the third ack to be committed", func() bool {
		var uuid string
		_ = pool.QueryRow(ctx, fmt.Sprintf(`SELECT m.uuid FROM "watermill_offsets_%[1]s" o JOIN "watermill_%[1]s" m
			ON m.transaction_id = o.last_processed_transaction_id AND m."offset" = o.offset_acked`, topic)).Scan(&uuid)
		return uuid == uuids[2]
	})
	stopOld()
	require.NoError(t, oldSub.Close())

	admin, err := sqlbroker.NewAdmin(sqlbroker.Pgx(pool), sqlbroker.AdminConfig{})
	require.NoError(t, err)
	_, err = admin.MigrateWatermillSQL(ctx, topic, "bililng", sqlbroker.MigrateOptions{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), `consumer group "bililng" has no row`)
	assert.Contains(t, err.Error(), `groups there: ""`)

	res, err := admin.MigrateWatermillSQL(ctx, topic, "", sqlbroker.MigrateOptions{})
	require.NoError(t, err)
	assert.Equal(t, int64(7), res.Migrated)
	sub, err := sqlbroker.NewSubscriber(sqlbroker.Pgx(pool), sqlbroker.SubscriberConfig{MaxInFlight: 1}, nil)
	require.NoError(t, err)
	defer sub.Close()
	newCh, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for _, want := range uuids[3:] {
		m := testdb.Receive(t, newCh, 30*time.Second)
		require.Equal(t, want, m.UUID)
		m.Ack()
	}
}
