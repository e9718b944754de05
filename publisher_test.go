package sqlbroker_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// unreachableDB is a pool that would fail on first use: nothing listens on port 1.
func unreachableDB(t *testing.T) sqlbroker.DB {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return sqlbroker.Pgx(pool)
}

func countMessages(t *testing.T, topic string) int {
	return queryInt(t, "SELECT count(*) FROM "+tables(topic).Messages)
}

// Messages published in the caller's transaction are visible exactly when it commits (P2),
// with both drivers.
func TestPublisher_P2_insideCallerTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{PollInterval: 20 * time.Millisecond})
	require.NoError(t, sub.SubscribeInitialize(topic))
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	// pgx: rolled back, never delivered.
	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	pub, err := sqlbroker.NewPublisher(sqlbroker.PgxTx(tx), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	publish(t, pub, topic, "rolled back")
	require.NoError(t, tx.Rollback(ctx))

	// pgx: committed.
	tx, err = testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	pub, err = sqlbroker.NewPublisher(sqlbroker.PgxTx(tx), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	pgxMsg := publish(t, pub, topic, "pgx")[0]
	noMessage(t, msgs, 300*time.Millisecond)
	require.NoError(t, tx.Commit(ctx))
	m := receive(t, msgs, 10*time.Second)
	assert.Equal(t, pgxMsg.UUID, m.UUID)
	m.Ack()

	// database/sql (lib/pq).
	stx, err := testdb.Std(t).BeginTx(ctx, &sql.TxOptions{})
	require.NoError(t, err)
	pub, err = sqlbroker.NewPublisher(sqlbroker.StdTx(stx), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	stdMsg := publish(t, pub, topic, "std")[0]
	noMessage(t, msgs, 300*time.Millisecond)
	require.NoError(t, stx.Commit())
	m = receive(t, msgs, 10*time.Second)
	assert.Equal(t, stdMsg.UUID, m.UUID)
	m.Ack()
	assert.Equal(t, 2, queryInt(t, "SELECT count(*) FROM "+tables(topic).Messages+" WHERE payload <> 'rolled back'::bytea"))
}

// After Close, Publish returns ErrClosed and writes nothing (P3).
func TestPublisher_P3_closedRefuses(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "before")
	require.NoError(t, pub.Close())
	require.NoError(t, pub.Close(), "Close is idempotent")
	err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("after")))
	assert.ErrorIs(t, err, sqlbroker.ErrClosed)
	assert.Equal(t, 1, countMessages(t, topic))
}

// One Publish call is all or none (P1): a bad message anywhere writes nothing.
func TestPublisher_P1_badInputWritesNothing(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{InitializeSchema: true, MaxPayloadBytes: 16}, nil)
	require.NoError(t, err)
	defer pub.Close()
	good := func() *message.Message { return message.NewMessage(watermill.NewUUID(), []byte("ok")) }
	dup := good()
	badMeta := good()
	badMeta.Metadata.Set("k", "\xff\xfe")
	nulMeta := good()
	nulMeta.Metadata.Set("k", "a\x00b")
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	cancelledMsg := good()
	cancelledMsg.SetContext(cancelled)

	cases := []struct {
		name string
		msgs []*message.Message
		want string
	}{
		{"nil message", []*message.Message{good(), nil}, "message 1 (uuid \"\"): message is nil"},
		{"empty uuid", []*message.Message{message.NewMessage("", nil)}, "UUID is empty"},
		{"duplicate uuid", []*message.Message{dup, good(), dup}, "the same as message 0's"},
		{"payload over limit", []*message.Message{good(), message.NewMessage(watermill.NewUUID(), []byte(strings.Repeat("x", 17)))}, "payload is 17 bytes, MaxPayloadBytes is 16"},
		{"metadata not utf-8", []*message.Message{good(), badMeta}, "metadata value of key \"k\" is not valid UTF-8"},
		{"metadata with NUL", []*message.Message{nulMeta}, "metadata value of key \"k\""},
		{"cancelled context", []*message.Message{cancelledMsg}, "context canceled"},
	}
	require.NoError(t, pub.Publish(topic, good())) // creates the tables
	for _, c := range cases {
		err := pub.Publish(topic, c.msgs...)
		require.Error(t, err, c.name)
		assert.Contains(t, err.Error(), c.want, c.name)
		assert.Contains(t, err.Error(), "nothing was written", c.name)
	}
	assert.Equal(t, 1, countMessages(t, topic))
}

// A publish of more messages than one statement holds is still all or none, and ordered.
func TestPublisher_P1_largeBatch(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	msgs := make([]*message.Message, 12000)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte("x"))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	assert.Equal(t, 12000, countMessages(t, topic))
	var first, last string
	require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(),
		`SELECT (SELECT uuid FROM `+tables(topic).Messages+` ORDER BY "offset" LIMIT 1), (SELECT uuid FROM `+tables(topic).Messages+` ORDER BY "offset" DESC LIMIT 1)`).Scan(&first, &last))
	assert.Equal(t, msgs[0].UUID, first)
	assert.Equal(t, msgs[len(msgs)-1].UUID, last)
}
