package sqlbroker_test

import (
	"context"
	"database/sql"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// What MySQL cannot do is refused with a ConfigError that names the field and says why; a
// pool of one database given to another's wrapper is refused too.
func TestMySQL_badInputRefused(t *testing.T) {
	t.Parallel()
	db := sqlbroker.MySQL(testdb.MySQL(t))

	_, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ClaimMode: sqlbroker.ClaimAdvisoryLock}, nil)
	requireConfigError(t, err, "ClaimMode", "advisory", "ClaimLease", "MySQL")
	_, err = sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{OrderByKey: true}, nil)
	requireConfigError(t, err, "OrderByKey", "MySQL")
	_, err = sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{Schema: "app"}, nil)
	requireConfigError(t, err, "Schema", "MySQL")

	_, err = sqlbroker.NewPublisher(sqlbroker.StdSQL(testdb.MySQL(t)), sqlbroker.PublisherConfig{}, nil)
	requireConfigError(t, err, "db", "sqlbroker.MySQL")
	_, err = sqlbroker.NewPublisher(sqlbroker.MySQL(testdb.Std(t)), sqlbroker.PublisherConfig{}, nil)
	requireConfigError(t, err, "db", "not MySQL's")

	_, err = sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{}, nil)
	require.NoError(t, err)
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	err = pub.Publish("mysql_missing_topic", message.NewMessage(watermill.NewUUID(), nil))
	var missing *sqlbroker.MissingTableError
	require.ErrorAs(t, err, &missing)
	assert.Contains(t, err.Error(), "sqlbroker.MySQLSchemaSQL")
	require.NoError(t, pub.Close())
	s, err := sqlbroker.MySQLSchemaSQL("Orders", "")
	require.NoError(t, err)
	assert.Contains(t, s, "CREATE TABLE IF NOT EXISTS `sqlbroker_Orders#")
	_, err = sqlbroker.MySQLSchemaSQL("bad topic", "")
	assert.Error(t, err)
}

// A message published in a caller's transaction is delivered once the caller commits, not
// before; AckInTx settles a message in the caller's transaction: rolled back, the message is
// delivered again at its next attempt; committed, it is settled, and the Ack that follows
// changes nothing.
func TestMySQL_transactions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw := testdb.MySQL(t)
	db := sqlbroker.MySQL(raw)
	topic := "mysql_tx_" + strings.ToLower(watermill.NewShortUUID())
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish(topic)) // creates the tables
	t.Cleanup(func() { dropMySQLTopic(t, raw, topic) })
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
		InitializeSchema: true, NackBackoff: sqlbroker.NoBackoff, PollInterval: 20 * time.Millisecond,
	}, nil)
	require.NoError(t, err)
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	tx, err := raw.BeginTx(ctx, nil)
	require.NoError(t, err)
	txPub, err := sqlbroker.NewPublisher(sqlbroker.MySQLTx(tx), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	require.NoError(t, txPub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("a"))))
	select {
	case m := <-msgs:
		t.Fatalf("delivered before the commit: %s", m.Payload)
	case <-time.After(300 * time.Millisecond):
	}
	require.NoError(t, tx.Commit())

	m := testdb.Receive(t, msgs, 10*time.Second)
	require.Equal(t, "a", string(m.Payload))
	tx, err = raw.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, sqlbroker.AckInTx(ctx, sqlbroker.MySQLTx(tx), m))
	require.NoError(t, tx.Rollback())
	m.Nack()
	m = testdb.Receive(t, msgs, 10*time.Second)
	assert.Equal(t, "2", m.Metadata.Get(sqlbroker.MetadataAttempt))

	tx, err = raw.BeginTx(ctx, nil)
	require.NoError(t, err)
	require.NoError(t, sqlbroker.AckInTx(ctx, sqlbroker.MySQLTx(tx), m))
	require.NoError(t, tx.Commit())
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack counted", func() bool { return sub.Stats().Acked == 1 })
	assert.Zero(t, sub.Stats().StaleSettlements)
	var claims int
	require.NoError(t, raw.QueryRow("SELECT count(*) FROM `sqlbroker_"+topic+"_claims`").Scan(&claims))
	assert.Zero(t, claims)
	select {
	case m := <-msgs:
		t.Fatalf("delivered again after AckInTx committed: %s", m.Payload)
	case <-time.After(300 * time.Millisecond):
	}
}

// Shutdown of a subscriber whose handler holds a message leaves the message's lease to run
// out and reports it; the next subscriber of the group gets the message then, at its second
// attempt. Nothing of the subscriber runs after Shutdown returned (the package's leak check).
func TestMySQL_shutdownLeavesLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw := testdb.MySQL(t)
	db := sqlbroker.MySQL(raw)
	topic := "mysql_close_" + strings.ToLower(watermill.NewShortUUID())
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("a"))))
	t.Cleanup(func() { dropMySQLTopic(t, raw, topic) })
	cfg := sqlbroker.SubscriberConfig{InitializeSchema: true, PollInterval: 20 * time.Millisecond, LeaseTTL: time.Second, CloseTimeout: 100 * time.Millisecond}
	first, err := sqlbroker.NewSubscriber(db, cfg, nil)
	require.NoError(t, err)
	msgs, err := first.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := testdb.Receive(t, msgs, 10*time.Second)
	sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	rep, _ := first.Shutdown(sctx)
	assert.Equal(t, 1, rep.DeliveriesInWork, "the report counts the message in work")
	assert.Equal(t, 1, rep.LeasesLeft, "the report counts the lease left to run out")
	<-m.Context().Done()

	second, err := sqlbroker.NewSubscriber(db, cfg, nil)
	require.NoError(t, err)
	defer second.Close()
	msgs, err = second.Subscribe(ctx, topic)
	require.NoError(t, err)
	m = testdb.Receive(t, msgs, 10*time.Second)
	assert.Equal(t, "a", string(m.Payload))
	assert.Equal(t, "2", m.Metadata.Get(sqlbroker.MetadataAttempt))
	m.Ack()
}

func dropMySQLTopic(t *testing.T, db *sql.DB, topic string) {
	t.Helper()
	s, err := sqlbroker.MySQLDropSQL(topic, "")
	require.NoError(t, err)
	_, err = db.Exec(s)
	assert.NoError(t, err)
}

// Open takes a mysql:// URL: a malformed one is refused without showing its password, and a
// broker built on one names its database without the password and works.
func TestMySQL_open(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"mysql://u:secret@/test", "mysql://u:secret@127.0.0.1/", "mysql://u:secret@127.0.0.1/a/b"} {
		_, err := sqlbroker.Open(bad, sqlbroker.BrokerConfig{}, nil)
		requireConfigError(t, err, "url", "mysql://user[:password]@host[:port]/database")
		assert.NotContains(t, err.Error(), "secret")
	}
	_, err := sqlbroker.Open("mysql://u:secret@127.0.0.1/test", sqlbroker.BrokerConfig{PrepareStatements: true}, nil)
	assert.Error(t, err)

	b, err := sqlbroker.Open("mysql://u:secret@127.0.0.1:1/test", sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	assert.Equal(t, "sqlbroker.Broker(mysql mysql://u:xxxxx@127.0.0.1:1/test)", b.String())
	require.NoError(t, b.Close())

	b, err = sqlbroker.Open(testdb.MySQLURL(t), sqlbroker.BrokerConfig{}, nil)
	require.NoError(t, err)
	defer b.Close()
	ctx := context.Background()
	topic := "mysql_open_" + strings.ToLower(watermill.NewShortUUID())
	require.NoError(t, b.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
	t.Cleanup(func() { dropMySQLTopic(t, testdb.MySQL(t), topic) })
	pub, err := b.NewPublisher(sqlbroker.PublisherConfig{})
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("a"))))
	sub, err := b.NewSubscriber(sqlbroker.SubscriberConfig{PollInterval: 20 * time.Millisecond})
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := testdb.Receive(t, msgs, 10*time.Second)
	assert.Equal(t, "a", string(m.Payload))
	m.Ack()
	rep, err := b.Shutdown(ctx)
	require.NoError(t, err)
	assert.Equal(t, 1, rep.Subscriptions)
}

// The Admin reads a MySQL topic as it reads a PostgreSQL one: its groups' positions, lag and
// claims (one line per message of a claims row), and moves and deletes a group.
func TestMySQL_admin(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw := testdb.MySQL(t)
	db := sqlbroker.MySQL(raw)
	prefix := "sqlbroker_adm" + strings.ToLower(watermill.NewShortUUID()[:6]) + "_"
	topic := "orders"
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true, TablePrefix: prefix}, nil)
	require.NoError(t, err)
	defer pub.Close()
	for i := range 5 {
		require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte{byte('a' + i)})))
	}
	t.Cleanup(func() {
		s, err := sqlbroker.MySQLDropSQL(topic, prefix)
		require.NoError(t, err)
		_, err = raw.Exec(s)
		assert.NoError(t, err)
	})
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "billing", TablePrefix: prefix, BatchSize: 2, MaxInFlight: 2, PollInterval: 20 * time.Millisecond}, nil)
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m1 := testdb.Receive(t, msgs, 10*time.Second)
	m2 := testdb.Receive(t, msgs, 10*time.Second)

	admin, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{TablePrefix: prefix})
	require.NoError(t, err)
	topics, more, err := admin.Topics(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{topic}, topics)
	assert.False(t, more)
	var ins sqlbroker.Inspection
	testdb.Eventually(t, 10*time.Second, "the claims ahead written", func() bool {
		ins, err = admin.Inspect(ctx, sqlbroker.InspectOptions{Claims: 10})
		require.NoError(t, err)
		require.Len(t, ins.Topics, 1)
		return len(ins.Topics[0].Groups) == 1 && ins.Topics[0].Groups[0].InWork >= 2
	})
	// The subscription holds what it handed out and what it claimed ahead: every message
	// before its position is in work, each a line of the claims listed.
	g := ins.Topics[0].Groups[0]
	assert.Equal(t, "billing", g.Group)
	assert.Equal(t, g.Offset, g.InWork)
	assert.Equal(t, 5-g.Offset, g.Lag)
	assert.Greater(t, g.OldestUnsettled, time.Duration(0))
	require.Len(t, ins.Topics[0].Claims, int(g.InWork))
	for i, c := range ins.Topics[0].Claims {
		assert.Equal(t, int64(i+1), c.Offset)
		assert.Equal(t, int64(1), c.Attempts)
		assert.WithinDuration(t, time.Now().Add(sqlbroker.DefaultLeaseTTL), c.Deadline, 5*time.Second)
	}
	assert.True(t, ins.Horizon.NotApplicable)
	require.NoError(t, sub.Close())
	<-m1.Context().Done()
	<-m2.Context().Done()

	next, err := admin.ResetGroup(ctx, topic, "billing", 4)
	require.NoError(t, err)
	assert.Equal(t, int64(4), next)
	ins, err = admin.Inspect(ctx, sqlbroker.InspectOptions{Topics: []string{topic}})
	require.NoError(t, err)
	g = ins.Topics[0].Groups[0]
	assert.Equal(t, int64(3), g.Offset)
	assert.Equal(t, int64(0), g.InWork+g.Due+g.Waiting, "the reset dropped the group's claims")
	dropped, err := admin.DeleteGroup(ctx, topic, "billing")
	require.NoError(t, err)
	assert.Zero(t, dropped)
	_, err = admin.DeleteGroup(ctx, topic, "billing")
	assert.ErrorIs(t, err, sqlbroker.ErrNoGroup)
}

// Shutdown cancels on the server a claim that waits for a row lock (another transaction holds
// the group's row), with KILL QUERY, and returns once the statement has ended: the claim is
// rolled back and its message handed out later at its first attempt.
func TestMySQL_shutdownCancelsClaimInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw := testdb.MySQL(t)
	db := sqlbroker.MySQL(raw)
	topic := "mysql_cancel_" + strings.ToLower(watermill.NewShortUUID())
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish(topic))
	t.Cleanup(func() { dropMySQLTopic(t, raw, topic) })
	cfg := sqlbroker.SubscriberConfig{InitializeSchema: true, PollInterval: 20 * time.Millisecond}
	sub, err := sqlbroker.NewSubscriber(db, cfg, nil)
	require.NoError(t, err)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	hold, err := raw.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer hold.Rollback()
	var id int
	require.NoError(t, hold.QueryRow("SELECT `group_id` FROM `sqlbroker_"+topic+"_groups` WHERE `consumer_group` = 'default' FOR UPDATE").Scan(&id))
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("a"))))
	testdb.Eventually(t, 10*time.Second, "the claim to wait for the group's row", func() bool {
		var n int
		require.NoError(t, raw.QueryRow("SELECT count(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE 'SELECT `last_offset`%' AND INFO LIKE ?", "%"+topic+"%").Scan(&n))
		return n == 1
	})
	sctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	rep, _ := sub.Shutdown(sctx)
	assert.Less(t, time.Since(start), 5*time.Second, "Shutdown waited for the lock instead of cancelling the claim")
	assert.Equal(t, 1, rep.ClaimStatementsCancelled, "the report counts the claim cancelled")
	select {
	case m, ok := <-msgs:
		if ok {
			t.Fatalf("delivered after a cancelled claim: %s", m.Payload)
		}
	default:
	}
	require.NoError(t, hold.Rollback())

	next, err := sqlbroker.NewSubscriber(db, cfg, nil)
	require.NoError(t, err)
	defer next.Close()
	msgs, err = next.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := testdb.Receive(t, msgs, 10*time.Second)
	assert.Equal(t, "a", string(m.Payload))
	assert.Equal(t, "1", m.Metadata.Get(sqlbroker.MetadataAttempt))
	m.Ack()
}

// A message nacked at its MaxAttempts-th attempt moves to the dead-letter topic with where it
// came from in its metadata, and a delayed message is handed out no earlier than its time.
func TestMySQL_deadLetterAndDelay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw := testdb.MySQL(t)
	db := sqlbroker.MySQL(raw)
	topic := "mysql_dl_" + strings.ToLower(watermill.NewShortUUID())
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	t.Cleanup(func() {
		dropMySQLTopic(t, raw, topic)
		dropMySQLTopic(t, raw, topic+sqlbroker.DefaultDeadLetterSuffix)
	})
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
		InitializeSchema: true, MaxAttempts: 2, NackBackoff: sqlbroker.NoBackoff, PollInterval: 20 * time.Millisecond,
	}, nil)
	require.NoError(t, err)
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, message.NewMessage("bad", []byte("x"))))
	for attempt := 1; attempt <= 2; attempt++ {
		m := testdb.Receive(t, msgs, 10*time.Second)
		assert.Equal(t, strconv.Itoa(attempt), m.Metadata.Get(sqlbroker.MetadataAttempt))
		m.Nack()
	}
	dead, err := sub.Subscribe(ctx, topic+sqlbroker.DefaultDeadLetterSuffix)
	require.NoError(t, err)
	m := testdb.Receive(t, dead, 10*time.Second)
	assert.Equal(t, "bad", m.UUID)
	assert.Equal(t, topic, m.Metadata.Get(sqlbroker.MetadataDeadLetterTopic))
	assert.Equal(t, "2", m.Metadata.Get(sqlbroker.MetadataDeadLetterAttempts))
	m.Ack()

	later := message.NewMessage("later", nil)
	at := time.Now().Add(800 * time.Millisecond)
	delay.Message(later, delay.Until(at))
	require.NoError(t, pub.Publish(topic, later))
	m = testdb.Receive(t, msgs, 10*time.Second)
	assert.Equal(t, "later", m.UUID)
	assert.False(t, time.Now().Before(at), "handed out before its time")
	m.Ack()
}
