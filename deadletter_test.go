package sqlbroker_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// With MaxAttempts 3 and a handler that always fails, each message is handled 3 times, then
// appears once on the dead-letter topic with its metadata, and never again on its topic: in
// both claim modes on PostgreSQL, and on SQLite.
func TestDeadLetter_afterMaxAttempts(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		for _, mode := range d.modes() {
			t.Run(d.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				ctx := context.Background()
				topic := testdb.Topic(t, "")
				dead := topic + sqlbroker.DefaultDeadLetterSuffix
				t.Cleanup(func() { testdb.DropTopic(t, "", dead) })
				db, raw := d.openSQL(t)
				pub := newPublisher(t, db)
				const n = 10
				sent := publish(t, pub, topic, numbered(n)...)
				sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", ClaimMode: mode, MaxAttempts: 3,
					NackBackoff: 10 * time.Millisecond, MaxNackBackoff: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond})
				deadSub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "ops"})

				var mu sync.Mutex
				handled := map[string]int{}
				router, err := message.NewRouter(message.RouterConfig{}, nil)
				require.NoError(t, err)
				router.AddNoPublisherHandler("fail", topic, sub, func(msg *message.Message) error {
					mu.Lock()
					handled[msg.UUID]++
					mu.Unlock()
					return errors.New("always fails")
				})
				rctx, cancel := context.WithCancel(ctx)
				defer cancel()
				go func() { _ = router.Run(rctx) }()
				<-router.Running()
				defer router.Close()

				deadMsgs, err := deadSub.Subscribe(ctx, dead)
				require.NoError(t, err)
				got := map[string]*message.Message{}
				for range n {
					m := receive(t, deadMsgs, 30*time.Second)
					require.NotContains(t, got, m.UUID, "moved twice")
					got[m.UUID] = m
					m.Ack()
				}
				for _, s := range sent {
					m := got[s.UUID]
					require.NotNil(t, m, "message %s not moved", s.UUID)
					assert.Equal(t, s.Payload, m.Payload)
					assert.Equal(t, topic, m.Metadata.Get(sqlbroker.MetadataDeadLetterTopic))
					assert.Equal(t, "g", m.Metadata.Get(sqlbroker.MetadataDeadLetterGroup))
					assert.Equal(t, "3", m.Metadata.Get(sqlbroker.MetadataDeadLetterAttempts))
					assert.NotEmpty(t, m.Metadata.Get(sqlbroker.MetadataDeadLetterOffset))
					assert.Equal(t, "1", m.Metadata.Get(sqlbroker.MetadataAttempt), "the dead-letter delivery's own attempt")
				}
				noMessage(t, deadMsgs, 300*time.Millisecond)
				assert.Zero(t, raw.claimed(t, tables(topic).Claims, "true"), "a moved message is still claimable on its topic")
				mu.Lock()
				for _, s := range sent {
					assert.Equal(t, 3, handled[s.UUID], "message %s", s.Payload)
				}
				mu.Unlock()
				assert.EqualValues(t, n, sub.Stats().DeadLettered)
			})
		}
	}
}

// A message whose claims were lost MaxAttempts times (its handlers never settled it) is moved
// when it is claimed again, without being handed to a handler.
func TestDeadLetter_lostClaimsCount(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testDeadLetterLostClaimsCount(t, d)
		})
	}
}

func testDeadLetterLostClaimsCount(t *testing.T, d database) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	dead := "dead-" + topic
	t.Cleanup(func() { testdb.DropTopic(t, "", dead) })
	db, raw := d.openSQL(t)
	pub := newPublisher(t, db)
	sent := publish(t, pub, topic, "x")
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{MaxAttempts: 2, DeadLetterTopic: dead, PollInterval: 20 * time.Millisecond})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for attempt := 1; attempt <= 2; attempt++ {
		m := receive(t, msgs, 10*time.Second)
		require.Equal(t, strconv.Itoa(attempt), m.Metadata.Get(sqlbroker.MetadataAttempt))
		off, _ := sqlbroker.OffsetFromContext(m.Context())
		raw.takeAway(t, topic, off) // its lease runs out; this subscription takes it again
	}
	deadSub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{})
	deadMsgs, err := deadSub.Subscribe(ctx, dead)
	require.NoError(t, err)
	m := receive(t, deadMsgs, 10*time.Second)
	assert.Equal(t, sent[0].UUID, m.UUID)
	assert.Equal(t, "3", m.Metadata.Get(sqlbroker.MetadataDeadLetterAttempts))
	m.Ack()
	noMessage(t, msgs, 300*time.Millisecond)
	testdb.Eventually(t, 10*time.Second, "the claim gone", func() bool { return raw.count(t, "SELECT count(*) FROM "+tables(topic).Claims) == 0 })
}

// The move to the dead-letter topic is all or nothing: while the dead-letter table refuses the
// copy (a trigger), the claim stays on its topic and the move is retried; once it is
// accepted, the message is moved once.
func TestDeadLetter_moveIsAllOrNothing(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testDeadLetterAllOrNothing(t, d)
		})
	}
}

func testDeadLetterAllOrNothing(t *testing.T, d database) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	dead := "dead-" + topic
	t.Cleanup(func() { testdb.DropTopic(t, "", dead) })
	db, raw := d.openSQL(t)
	deadSub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "ops"})
	require.NoError(t, deadSub.SubscribeInitialize(dead))
	deadMessages := tables(dead).Messages
	const refusal = "dead-letter copy refused"
	if d.name == "sqlite" {
		raw.exec(t, `CREATE TRIGGER "refuse" BEFORE INSERT ON `+deadMessages+` BEGIN SELECT RAISE(ABORT, '`+refusal+`'); END`)
	} else {
		fn := `"refuse_` + topic + `"`
		raw.exec(t, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION '`+refusal+`'; END $$`)
		t.Cleanup(func() { raw.exec(t, `DROP FUNCTION IF EXISTS `+fn+`() CASCADE`) })
		raw.exec(t, `CREATE TRIGGER "refuse" BEFORE INSERT ON `+deadMessages+` FOR EACH ROW EXECUTE FUNCTION `+fn+`()`)
	}

	pub := newPublisher(t, db)
	sent := publish(t, pub, topic, "x")
	log := newRecLogger()
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{MaxAttempts: 1, DeadLetterTopic: dead, InitializeSchema: true,
		RetryInterval: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond}, log)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	receive(t, msgs, 10*time.Second).Nack()

	testdb.Eventually(t, 10*time.Second, "the refused move to be logged", func() bool {
		return slices.ContainsFunc(log.since(time.Time{}), func(e string) bool { return strings.Contains(e, refusal) })
	})
	claims := tables(topic).Claims
	assert.Equal(t, 1, raw.count(t, "SELECT count(*) FROM "+claims), "the claim went without its copy")
	assert.Zero(t, raw.count(t, "SELECT count(*) FROM "+deadMessages), "a copy was written without the claim's settlement")

	raw.exec(t, `DROP TRIGGER "refuse"`+map[bool]string{true: "", false: " ON " + deadMessages}[d.name == "sqlite"])
	deadMsgs, err := deadSub.Subscribe(ctx, dead)
	require.NoError(t, err)
	m := receive(t, deadMsgs, 10*time.Second)
	assert.Equal(t, sent[0].UUID, m.UUID)
	m.Ack()
	noMessage(t, deadMsgs, 300*time.Millisecond)
	testdb.Eventually(t, 10*time.Second, "the claim gone", func() bool { return raw.count(t, "SELECT count(*) FROM "+claims) == 0 })
	assert.Equal(t, 1, raw.count(t, "SELECT count(*) FROM "+deadMessages), "moved more than once")
}

// A dead-letter topic name that is not a valid topic is refused, naming the field, before
// anything is written; so is a derived one.
func TestDeadLetter_invalidNameRefused(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			db := d.open(t)
			_, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{MaxAttempts: 3, DeadLetterTopic: "a b"}, nil)
			var nerr *sqlbroker.NameError
			require.ErrorAs(t, err, &nerr)
			assert.Contains(t, err.Error(), "DeadLetterTopic")
			_, err = sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{MaxAttempts: -1}, nil)
			var cerr *sqlbroker.ConfigError
			require.ErrorAs(t, err, &cerr)

			topic := testdb.Topic(t, "")
			sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{MaxAttempts: 3, DeadLetterTopic: topic})
			_, err = sub.Subscribe(context.Background(), topic)
			require.ErrorAs(t, err, &cerr)
			assert.Contains(t, err.Error(), "must not be the subscribed topic")
		})
	}
}

// Without MaxAttempts, Watermill's PoisonQueue middleware works as before: the failing message
// is published to the poison topic and acked on its own.
func TestDeadLetter_poisonQueueStillWorks(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testPoisonQueueStillWorks(t, d)
		})
	}
}

func testPoisonQueueStillWorks(t *testing.T, d database) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	poison := "poison-" + topic
	t.Cleanup(func() { testdb.DropTopic(t, "", poison) })
	db := d.open(t)
	pub := newPublisher(t, db)
	sent := publish(t, pub, topic, "x")
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{})
	pq, err := middleware.PoisonQueue(pub, poison)
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	router.AddMiddleware(pq)
	router.AddNoPublisherHandler("fail", topic, sub, func(*message.Message) error { return errors.New("poison") })
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = router.Run(rctx) }()
	<-router.Running()
	defer router.Close()

	psub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{})
	pmsgs, err := psub.Subscribe(ctx, poison)
	require.NoError(t, err)
	m := receive(t, pmsgs, 10*time.Second)
	assert.Equal(t, sent[0].UUID, m.UUID)
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "acked on its topic", func() bool { return sub.Stats().Acked == 1 })
}
