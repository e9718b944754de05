package sqlbroker_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// Subscribe after Close is refused with ErrClosed, on both drivers and on SQLite, whether or
// not the subscriber ever subscribed, and nothing is written: no consumer group row appears.
func TestSubscriber_subscribeAfterCloseRefused(t *testing.T) {
	t.Parallel()
	for _, d := range append(leaseDatabases, database{"libpq", stdDB}) {
		t.Run(d.name, func(t *testing.T) {
			topic := testdb.Topic(t, "")
			db, raw := d.openSQL(t)
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", InitializeSchema: true}, nil)
			require.NoError(t, err)
			require.NoError(t, sub.SubscribeInitialize(topic))
			require.NoError(t, sub.Close())
			msgs, err := sub.Subscribe(context.Background(), topic)
			assert.ErrorIs(t, err, sqlbroker.ErrClosed)
			assert.Nil(t, msgs)
			assert.Equal(t, 0, raw.count(t, "SELECT count(*) FROM "+tables(topic).Groups), "a group row was written after Close")
			require.NoError(t, sub.Close(), "Close is idempotent")
		})
	}
}

// A context already cancelled makes Subscribe fail with that context's error before it starts
// anything: no channel, no consumer group row, no claim.
func TestSubscriber_subscribeWithCancelledContext(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testSubscribeWithCancelledContext(t, d)
		})
	}
}

func testSubscribeWithCancelledContext(t *testing.T, d database) {
	topic := testdb.Topic(t, "")
	db, raw := d.openSQL(t)
	pub := newPublisher(t, db)
	publish(t, pub, topic, "x")
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g"})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	require.Error(t, err)
	assert.ErrorIs(t, err, context.Canceled)
	assert.Contains(t, err.Error(), topic, "the error names the topic")
	assert.Nil(t, msgs)
	assert.Equal(t, 0, raw.count(t, "SELECT count(*) FROM "+tables(topic).Groups))
	assert.Equal(t, 0, raw.count(t, "SELECT count(*) FROM "+tables(topic).Claims))
	assert.Zero(t, sub.Stats().Claimed)

	// The subscriber is still usable with a live context.
	live, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	receive(t, live, 10*time.Second).Ack()
}

// Lease mode, Ack after Close: a delivery still in work at Close keeps its lease, which runs
// out (S4). An ack after Close is not applied, whether it comes while the lease holds or
// after: nothing of the subscriber waits for it any more (S11), the message goes to another
// consumer of the group with its attempt count raised, and the late ack changes nothing in
// the database and counts as no ack.
func TestSubscriber_ackAfterCloseAndLease(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testAckAfterCloseAndLease(t, d)
		})
	}
}

func testAckAfterCloseAndLease(t *testing.T, d database) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	db, raw := d.openSQL(t)
	queryInt := raw.count
	pub := newPublisher(t, db)
	sent := publish(t, pub, topic, "late")
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", LeaseTTL: time.Second, LeaseRenewInterval: 200 * time.Millisecond})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	require.NoError(t, sub.Close())
	assert.ErrorIs(t, context.Cause(m.Context()), sqlbroker.ErrClosed)
	m.Ack() // after Close, within the lease: not applied
	holds(t, 500*time.Millisecond, "the ack after Close not applied", func() bool {
		return queryInt(t, "SELECT count(*) FROM "+tables(topic).Claims+" WHERE token <> 0") == 1
	})

	// Another consumer takes the message once the lease ran out.
	next := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
	again, err := next.Subscribe(ctx, topic)
	require.NoError(t, err)
	m2 := receive(t, again, 10*time.Second)
	assert.Equal(t, sent[0].UUID, m2.UUID)
	assert.Equal(t, "2", m2.Metadata.Get(sqlbroker.MetadataAttempt))

	noMessage(t, again, 300*time.Millisecond)
	assert.Equal(t, int64(0), sub.Stats().Acked, "an ack after the lease ran out was applied")
	assert.Equal(t, 1, queryInt(t, "SELECT count(*) FROM "+tables(topic).Claims), "the late ack settled the new holder's claim")

	m2.Ack()
	testdb.Eventually(t, 10*time.Second, "the new holder's ack", func() bool { return next.Stats().Acked == 1 })
	assert.Equal(t, 0, queryInt(t, "SELECT count(*) FROM "+tables(topic).Claims))
}

// A Broker config with nonsense values is refused by Open, naming the field and the value, for
// PostgreSQL and SQLite URLs alike.
func TestBrokerConfig_nonsenseRefused(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) { testBrokerConfigNonsense(t, testdb.URL()) })
	t.Run("sqlite", func(t *testing.T) { testBrokerConfigNonsense(t, testdb.SQLiteURL(t)) })
}

func testBrokerConfigNonsense(t *testing.T, url string) {
	cases := []struct {
		cfg  sqlbroker.BrokerConfig
		want string
	}{
		{sqlbroker.BrokerConfig{ConnectTimeout: -time.Second}, "ConnectTimeout (-1s) must not be negative"},
		{sqlbroker.BrokerConfig{CloseTimeout: -time.Millisecond}, "CloseTimeout (-1ms) must not be negative"},
		{sqlbroker.BrokerConfig{MaxConns: -1}, "MaxConns (-1) must not be negative"},
	}
	for _, c := range cases {
		b, err := sqlbroker.Open(url, c.cfg, nil)
		require.Error(t, err, c.want)
		assert.Nil(t, b)
		var cerr *sqlbroker.ConfigError
		assert.True(t, errors.As(err, &cerr), "%T", err)
		assert.Contains(t, err.Error(), c.want)
	}
	// Subscriber configs of a broker are checked like any other.
	b, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	defer b.Close()
	_, err = b.NewSubscriber(sqlbroker.SubscriberConfig{LeaseTTL: time.Second, LeaseRenewInterval: 2 * time.Second})
	assert.ErrorContains(t, err, "LeaseRenewInterval (2s) must be shorter than LeaseTTL (1s)")
	_, err = b.NewSubscriber(sqlbroker.SubscriberConfig{LeaseTTL: time.Millisecond})
	assert.ErrorContains(t, err, "LeaseTTL (1ms) must be at least 100ms")
	_, err = b.NewSubscriber(sqlbroker.SubscriberConfig{RetryInterval: -time.Second})
	assert.ErrorContains(t, err, "RetryInterval")
	_, err = b.NewSubscriber(sqlbroker.SubscriberConfig{CloseTimeout: -time.Second})
	assert.ErrorContains(t, err, "CloseTimeout")
}

// Tables created by another schema version are refused by publishers too, with and without
// InitializeSchema (which must not try to "fix" them), and nothing is written.
func TestPublisher_schemaVersionMismatchWritesNothing(t *testing.T) {
	t.Parallel()
	t.Run("postgres", testSchemaVersionMismatchPostgres)
	t.Run("sqlite", testSchemaVersionMismatchSQLite)
}

func testSchemaVersionMismatchPostgres(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{})
	require.NoError(t, sub.SubscribeInitialize(topic))
	_, err := testdb.Pgx(t).Exec(context.Background(), "COMMENT ON TABLE "+tables(topic).Messages+" IS 'sqlbroker schema v99'")
	require.NoError(t, err)
	for _, initialize := range []bool{false, true} {
		for name, db := range map[string]sqlbroker.DB{"pgx": pgxDB(t), "libpq": sqlbroker.StdSQL(testdb.Std(t))} {
			pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: initialize}, nil)
			require.NoError(t, err)
			err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x")))
			var verr *sqlbroker.SchemaVersionError
			require.ErrorAs(t, err, &verr, "%s, InitializeSchema %v", name, initialize)
			assert.Contains(t, err.Error(), `"sqlbroker schema v99"`)
			assert.Contains(t, err.Error(), "v5")
			assert.Contains(t, err.Error(), tables(topic).Messages)
			require.NoError(t, pub.Close())
		}
	}
	// A subscriber with InitializeSchema is refused too.
	fresh, err := sqlbroker.NewSubscriber(pgxDB(t), sqlbroker.SubscriberConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer fresh.Close()
	_, err = fresh.Subscribe(context.Background(), topic)
	var verr *sqlbroker.SchemaVersionError
	require.ErrorAs(t, err, &verr)
	assert.Equal(t, 0, countMessages(t, topic))
	assert.Equal(t, 0, queryInt(t, "SELECT count(*) FROM "+tables(topic).Groups))
}

// On SQLite the version is written in a comment of the messages table's DDL.
func testSchemaVersionMismatchSQLite(t *testing.T) {
	t.Parallel()
	topic := "t"
	db, raw := database{name: "sqlite"}.openSQL(t)
	raw.exec(t, strings.Replace(tables(topic).OnSQLite().SchemaSQL(), "sqlbroker schema v2", "sqlbroker schema v99", 1))
	for _, initialize := range []bool{false, true} {
		pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: initialize}, nil)
		require.NoError(t, err)
		err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x")))
		var verr *sqlbroker.SchemaVersionError
		require.ErrorAs(t, err, &verr, "InitializeSchema %v", initialize)
		assert.Contains(t, err.Error(), `"sqlbroker schema v99"`)
		assert.Contains(t, err.Error(), "v2")
		assert.Contains(t, err.Error(), tables(topic).Messages)
		require.NoError(t, pub.Close())
	}
	fresh, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer fresh.Close()
	_, err = fresh.Subscribe(context.Background(), topic)
	var verr *sqlbroker.SchemaVersionError
	require.ErrorAs(t, err, &verr)
	assert.Equal(t, 0, raw.count(t, "SELECT count(*) FROM "+tables(topic).Messages))
	assert.Equal(t, 0, raw.count(t, "SELECT count(*) FROM "+tables(topic).Groups))
}

// Topic and consumer group names may hold $, as in watermill-sql, on PostgreSQL and SQLite:
// even a topic that spells the dollar-quote tag of the PostgreSQL schema SQL is created,
// upgraded from schema version 1, published to and consumed.
func TestNames_dollarSignAccepted(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "") + "$sqlbroker$x"
			t.Cleanup(func() { testdb.DropTopic(t, "", topic) })
			db, raw := d.openSQL(t)
			pub := newPublisher(t, db)
			sent := publish(t, pub, topic, "a")
			if d.name != "sqlite" {
				// Back to schema version 1: InitializeSchema's upgrade runs the dollar-quoted block.
				raw.exec(t, `ALTER TABLE `+tables(topic).Messages+` DROP COLUMN "deliver_at"; COMMENT ON TABLE `+tables(topic).Messages+` IS 'sqlbroker schema v1'`)
			}
			sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g$1", PollInterval: 20 * time.Millisecond})
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			m := receive(t, msgs, 10*time.Second)
			assert.Equal(t, sent[0].UUID, m.UUID)
			m.Ack()
			testdb.Eventually(t, 10*time.Second, "the ack", func() bool { return sub.Stats().Acked == 1 })
			assert.Equal(t, 1, raw.count(t, `SELECT count(*) FROM `+tables(topic).Groups+` WHERE "consumer_group" = 'g$1'`))
		})
	}
}
