package sqlbroker_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// plainMessages turns the tables of topic back into those of schema version (1 to 3): the
// messages table one plain table with an identity column, holding the messages the topic has
// (with their offsets, the sequence after them), without deliver_at for version 1, and the
// groups table without floor_offset; the messages table carries the version's comment.
func plainMessages(t *testing.T, topic string, version int) {
	t.Helper()
	tb := tables(topic)
	name := strings.Trim(tb.Messages, `"`)
	stem := strings.TrimSuffix(name, "_messages")
	old := ident.Quote(name + "_old")
	sql := fmt.Sprintf(`CREATE TABLE %[1]s (
	"offset"     bigint      GENERATED ALWAYS AS IDENTITY,
	"xid"        xid8        NOT NULL DEFAULT pg_current_xact_id(),
	"uuid"       text        NOT NULL,
	"payload"    bytea       NOT NULL,
	"metadata"   jsonb       NOT NULL DEFAULT '{}',
	"created_at" timestamptz NOT NULL DEFAULT now(),
	"deliver_at" timestamptz);
INSERT INTO %[1]s OVERRIDING SYSTEM VALUE SELECT * FROM %[2]s;
SELECT setval(pg_get_serial_sequence('%[1]s', 'offset'), (SELECT max(s.last_value) FROM pg_sequences s WHERE s.sequencename = '%[3]s_m_seq'));
%[4]s
ALTER TABLE %[1]s RENAME TO %[5]s;
ALTER SEQUENCE %[6]s RENAME TO %[7]s;
ALTER TABLE %[2]s ADD CONSTRAINT %[8]s PRIMARY KEY ("offset");
CREATE INDEX %[9]s ON %[2]s ("xid", "offset");
ALTER TABLE %[10]s DROP COLUMN "floor_offset";
COMMENT ON TABLE %[2]s IS 'sqlbroker schema v%[11]d'`,
		old, tb.Messages, stem, tb.DropSQL()[:strings.Index(tb.DropSQL(), ";")]+";\nDROP FUNCTION "+ident.Quote(stem+"_m_extend")+"(bigint, bigint);",
		ident.Quote(name), ident.Quote(name+"_old_offset_seq"), ident.Quote(stem+"_m_seq"),
		ident.Quote(stem+"_m_pkey"), ident.Quote(stem+"_m_xid"), tb.Groups, version)
	sql = strings.Replace(sql, "DROP TABLE IF EXISTS "+tb.Messages+", "+tb.Groups+", "+tb.Claims, "DROP TABLE "+tb.Messages, 1)
	if version == 1 {
		sql += `;
ALTER TABLE ` + tb.Messages + ` DROP COLUMN "deliver_at"`
	}
	_, err := testdb.Pgx(t).Exec(context.Background(), sql)
	require.NoError(t, err)
	require.Equal(t, "r", queryString(t, `SELECT relkind::text FROM pg_class WHERE oid = $1::regclass`, tb.Messages))
}

func queryString(t *testing.T, sql string, args ...any) string {
	t.Helper()
	var s string
	require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(), sql, args...).Scan(&s))
	return s
}

// refusedSchema subscribes to topic as group g without InitializeSchema, requires a
// SchemaVersionError, and returns its text.
func refusedSchema(t *testing.T, db sqlbroker.DB, topic string) string {
	t.Helper()
	plain, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g"}, nil)
	require.NoError(t, err)
	defer plain.Close()
	_, err = plain.Subscribe(context.Background(), topic)
	var verr *sqlbroker.SchemaVersionError
	require.ErrorAs(t, err, &verr)
	return err.Error()
}

// claimLeftInWork publishes a, b and c to topic; a subscriber of group g (LeaseTTL 1 s) acks a,
// leaves b claimed and not settled, and shuts down. It returns b, whose lease runs out a second
// later.
func claimLeftInWork(t *testing.T, pub message.Publisher, topic string) *message.Message {
	t.Helper()
	ctx := context.Background()
	publish(t, pub, topic, "a", "b", "c")
	first := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond, LeaseTTL: time.Second})
	msgs, err := first.Subscribe(ctx, topic)
	require.NoError(t, err)
	receive(t, msgs, 10*time.Second).Ack()
	held := receive(t, msgs, 10*time.Second)
	_, err = first.Shutdown(ctx)
	require.NoError(t, err)
	return held
}

// A messages table of schema version 3 (one plain table) becomes the first partition of the
// partitioned table under InitializeSchema: its messages, the group's position and its
// claims stay; new messages get offsets after every offset it handed out (a rolled-back
// publish included) and go to new partitions; without InitializeSchema, Subscribe says how to
// upgrade. Once every group has passed it, retention drops it.
func TestSchema_version3MessagesPartitioned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	tb := tables(topic)
	pub := newPublisher(t, pgxDB(t))
	held := claimLeftInWork(t, pub, topic)
	plainMessages(t, topic, 3)
	pool := testdb.Pgx(t)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO `+tb.Messages+` ("uuid", "payload") VALUES ('rolled back', '')`)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	highest := queryInt(t, `SELECT max("offset") FROM `+tb.Messages)

	assert.Contains(t, refusedSchema(t, pgxDB(t), topic), "stop the consumers and publishers of the older library")

	sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond, LeaseTTL: time.Second})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	assert.Equal(t, "p", queryString(t, `SELECT relkind::text FROM pg_class WHERE oid = $1::regclass`, tb.Messages))
	assert.Equal(t, fmt.Sprintf("FOR VALUES FROM (MINVALUE) TO ('%d')", highest+2),
		queryString(t, `SELECT pg_get_expr(relpartbound, oid) FROM pg_class WHERE oid = $1::regclass`, ident.Quote(tb.PartitionName(0))),
		"the old table is the first partition, up to the offset after the rolled-back one")
	publish(t, pub, topic, "d")
	got := map[string]string{}
	for range 3 {
		m := receive(t, msgs, 10*time.Second)
		got[string(m.Payload)] = m.Metadata.Get(sqlbroker.MetadataOffset)
		m.Ack()
	}
	assert.Equal(t, map[string]string{
		string(held.Payload): held.Metadata.Get(sqlbroker.MetadataOffset), // its lease ran out: claimed again
		"c":                  fmt.Sprint(highest),
		"d":                  fmt.Sprint(highest + 2),
	}, got)

	// Every message of the old table passed and settled: retention drops it.
	a := newAdmin(t, pgxDB(t))
	testdb.Eventually(t, 10*time.Second, "the old table dropped", func() bool {
		_, err := a.Prune(ctx, topic, 0)
		require.NoError(t, err)
		return queryInt(t, `SELECT count(*) FROM pg_class WHERE relname = $1`, tb.PartitionName(0)) == 0
	})
	assert.Equal(t, 1, countMessages(t, topic), "d stays: its partition is not full")
}

// Tables of schema version 4 lack the claims table's order_key column (order by key), its
// index of lease deadlines and its index of parked rows: without InitializeSchema, Subscribe
// says how to upgrade them; with it, the column is added, the indexes are built and the
// version written, the messages, the group's position and a claim in work kept: the claim,
// whose lease ran out, is delivered again.
func TestSchema_version4ClaimsLeaseIndexAdded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	tb := tables(topic)
	index := ident.TableName("sqlbroker_", topic, "_c_lease")
	parked := ident.TableName("sqlbroker_", topic, "_c_park")
	pub := newPublisher(t, pgxDB(t))
	held := claimLeftInWork(t, pub, topic)
	_, err := testdb.Pgx(t).Exec(ctx, `DROP INDEX `+ident.Quote(index)+`; DROP INDEX `+ident.Quote(parked)+`;
ALTER TABLE `+tb.Claims+` DROP COLUMN "order_key"; COMMENT ON TABLE `+tb.Messages+` IS 'sqlbroker schema v4'`)
	require.NoError(t, err)

	assert.Contains(t, refusedSchema(t, pgxDB(t), topic), "set InitializeSchema: true")

	sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	assert.Contains(t, queryString(t, `SELECT indexdef FROM pg_indexes WHERE indexname = $1`, index), "WHEN (token > 0) THEN visible_at")
	assert.Contains(t, queryString(t, `SELECT indexdef FROM pg_indexes WHERE indexname = $1`, parked), "(group_id, order_key, token) WHERE (token <= '-4611686018427387904'::bigint)")
	assert.Equal(t, "sqlbroker schema v5", queryString(t, `SELECT obj_description($1::regclass, 'pg_class')`, tb.Messages))
	got := map[string]string{}
	for range 2 {
		m := receive(t, msgs, 10*time.Second)
		got[string(m.Payload)] = m.Metadata.Get(sqlbroker.MetadataAttempt)
		m.Ack()
	}
	assert.Equal(t, map[string]string{string(held.Payload): "2", "c": "1"}, got)
}

// Publishing never fails because no maintenance added partitions: with no subscriber
// running, publishes outside a transaction run past the partitions made ahead, one message at
// a time and in a batch (pgx: one COPY; lib/pq: INSERTs in one transaction), and every message
// is written. In the caller's transaction, the refused statement aborts it: the error says
// so, and the transaction run again succeeds.
func TestPublisher_pastThePartitionsMadeAhead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for name, db := range map[string]sqlbroker.DB{"pgx": pgxDB(t), "libpq": stdDB(t)} {
		t.Run(name, func(t *testing.T) {
			pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{}, nil)
			require.NoError(t, err)
			defer pub.Close()

			one := testdb.Topic(t, "")
			smallPartitions(t, one, 10, 3) // room for 30 messages
			for i := range 40 {
				require.NoError(t, pub.Publish(one, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(i)))))
			}
			assert.Equal(t, 40, countMessages(t, one))

			many := testdb.Topic(t, "")
			smallPartitions(t, many, 10, 3)
			batch := make([]*message.Message, 12_000) // lib/pq: two INSERTs in a transaction
			for i := range batch {
				batch[i] = message.NewMessage(watermill.NewUUID(), nil)
			}
			require.NoError(t, pub.Publish(many, batch...))
			assert.Equal(t, len(batch), countMessages(t, many))
		})
	}

	topic := testdb.Topic(t, "")
	smallPartitions(t, topic, 10, 1)
	pool := testdb.Pgx(t)
	run := func() error {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx)
		pub, err := sqlbroker.NewPublisher(sqlbroker.PgxTx(tx), sqlbroker.PublisherConfig{}, nil)
		require.NoError(t, err)
		batch := make([]*message.Message, 20)
		for i := range batch {
			batch[i] = message.NewMessage(watermill.NewUUID(), nil)
		}
		if err := pub.Publish(topic, batch...); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	err := run()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no partition of "+tables(topic).Messages+" takes the new offsets")
	assert.Contains(t, err.Error(), "run it again once one has")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "outside a transaction") // adds partitions
	require.NoError(t, run())
	assert.Equal(t, 21, countMessages(t, topic))
}

// Moves to a dead-letter topic and a redrive back never fail for want of a partition either:
// past the partitions made ahead, the subscriber's move and the Admin's transaction add them
// and run again.
func TestDeadLetter_pastThePartitionsMadeAhead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic, dead := testdb.Topic(t, ""), testdb.Topic(t, "")
	smallPartitions(t, topic, 1, 3) // room for the 3 messages, none for the redriven copies
	smallPartitions(t, dead, 1, 1)  // room for 1 dead letter
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "a", "b", "c")
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", MaxAttempts: 1, DeadLetterTopic: dead, PollInterval: 20 * time.Millisecond})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for range 3 {
		receive(t, msgs, 10*time.Second).Nack()
	}
	testdb.Eventually(t, 10*time.Second, "three dead letters", func() bool { return sub.Stats().DeadLettered == 3 })
	assert.Zero(t, sub.Stats().Errors)
	assert.Equal(t, 3, countMessages(t, dead))

	res, err := newAdmin(t, pgxDB(t)).Redrive(ctx, dead, sqlbroker.RedriveOptions{})
	require.NoError(t, err)
	assert.EqualValues(t, 3, res.Moved)
	assert.Equal(t, 6, countMessages(t, topic))
}
