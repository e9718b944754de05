package sqlbroker_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// L3: a settlement batch whose first statement applies and whose next one fails is not run
// again whole: what was applied is counted as applied, never as stale, and only the rest is
// retried. Here a batch of two nacks, one of them at its last attempt: the plain nack is
// applied, then the move to the dead-letter topic fails (a trigger refuses the copy) and is
// retried until the trigger goes.
func TestSubscriber_L3_partlyAppliedBatchNotCountedStale(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	dead := "dead-" + topic
	t.Cleanup(func() { testdb.DropTopic(t, "", dead) })
	db, raw := database{name: "pgx", open: pgxDB}.openSQL(t)
	deadSub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "ops"})
	require.NoError(t, deadSub.SubscribeInitialize(dead))
	deadMessages := tables(dead).Messages
	const refusal = "dead-letter copy refused"
	fn := `"refuse_` + topic + `"`
	raw.exec(t, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION '`+refusal+`'; END $$`)
	t.Cleanup(func() { raw.exec(t, `DROP FUNCTION IF EXISTS `+fn+`() CASCADE`) })
	raw.exec(t, `CREATE TRIGGER "refuse" BEFORE INSERT ON `+deadMessages+` FOR EACH ROW EXECUTE FUNCTION `+fn+`()`)

	pub := newPublisher(t, db)
	publish(t, pub, topic, "last", "plain", "decoy")
	log := newRecLogger()
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{MaxAttempts: 2, DeadLetterTopic: dead, MaxInFlight: 3,
		NackBackoff: sqlbroker.NoBackoff, RetryInterval: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond}, log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	got := map[string]*message.Message{}
	for range 3 {
		m := receive(t, msgs, 10*time.Second)
		got[string(m.Payload)] = m
	}
	got["last"].Nack() // back at once, at its second and last attempt
	last := receive(t, msgs, 10*time.Second)
	require.Equal(t, "last", string(last.Payload))
	require.Equal(t, "2", last.Metadata.Get(sqlbroker.MetadataAttempt))
	testdb.Eventually(t, 10*time.Second, "the first nack applied", func() bool { return sub.Stats().Nacked == 1 })

	// The decoy's nack waits on a lock of the claims table; the two nacks behind it queue up
	// and go into the next batch together.
	claims := tables(topic).Claims
	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, lockTableSQL(claims))
	require.NoError(t, err)
	got["decoy"].Nack()
	testdb.Eventually(t, 10*time.Second, "the decoy's nack waiting on the lock", func() bool {
		return queryInt(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE '/* sqlbroker nack */%' AND query LIKE '%'||$1||'%'`, claims) == 1
	})
	got["plain"].Nack()
	testdb.Eventually(t, 10*time.Second, "the plain nack queued", func() bool { return sqlbroker.SettleQueued(sub) == 1 })
	last.Nack() // after the plain one: the batch runs the plain nack's statement first
	testdb.Eventually(t, 10*time.Second, "two nacks queued", func() bool { return sqlbroker.SettleQueued(sub) == 2 })
	require.NoError(t, tx.Rollback(ctx))

	// The batch of two: the plain nack applied, the move refused, and retried.
	testdb.Eventually(t, 10*time.Second, "the move retried", func() bool {
		n := 0
		for _, e := range log.since(time.Time{}) {
			if strings.Contains(e, refusal) {
				n++
			}
		}
		return n >= 2
	})
	st := sub.Stats()
	assert.Zero(t, st.StaleSettlements, "a nack applied before the batch failed was run again and counted stale")
	assert.EqualValues(t, 3, st.Nacked, "the first nack, the decoy's and the plain one")

	raw.exec(t, `DROP TRIGGER "refuse" ON `+deadMessages)
	testdb.Eventually(t, 10*time.Second, "moved to the dead-letter topic", func() bool { return sub.Stats().DeadLettered == 1 })
	// The plain and decoy messages come back (attempt 2) once their nacks are applied.
	for range 2 {
		m := receive(t, msgs, 10*time.Second)
		assert.True(t, slices.Contains([]string{"plain", "decoy"}, string(m.Payload)), "%s", m.Payload)
		m.Ack()
	}
	testdb.Eventually(t, 10*time.Second, "acks applied", func() bool { return sub.Stats().Acked == 2 })
	assert.Zero(t, sub.Stats().StaleSettlements)
}
