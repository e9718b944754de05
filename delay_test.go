package sqlbroker_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/components/requeuer"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

var claimModes = []sqlbroker.ClaimMode{sqlbroker.ClaimLease, sqlbroker.ClaimAdvisoryLock}

// delayPoll is the PollInterval of the delay tests: the tolerance of a delayed message's time.
const delayPoll = 50 * time.Millisecond

// lateness bounds, generously for a shared machine, how late a delayed message may come in
// these tests: they check that it is held back until its time and then delivered, not how
// fast (the figures are logged).
const lateness = 5 * time.Second

// A message delayed by 3 s is not delivered before 3 s; one published right after it without
// delay is delivered before it, without waiting for it: in both claim modes, on both drivers,
// and for two consumer groups each.
func TestDelay_heldUntilItsTimeWithoutHoldingBackOthers(t *testing.T) {
	t.Parallel()
	for _, d := range []struct {
		name string
		db   func(*testing.T) sqlbroker.DB
	}{{"pgx", pgxDB}, {"libpq", stdDB}, {"sqlite", sqliteDB}} {
		for _, mode := range (database{name: d.name}).modes() {
			t.Run(d.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				topic := testdb.Topic(t, "")
				db := d.db(t)
				pub := newPublisher(t, db)
				var chans []<-chan *message.Message
				for _, g := range []string{"a", "b"} {
					sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: g, ClaimMode: mode, InitializeSchema: true, PollInterval: delayPoll}, nil)
					require.NoError(t, err)
					t.Cleanup(func() { _ = sub.Close() })
					ch, err := sub.Subscribe(context.Background(), topic)
					require.NoError(t, err)
					chans = append(chans, ch)
				}
				late := message.NewMessage(watermill.NewUUID(), []byte("late"))
				delay.Message(late, delay.For(3*time.Second))
				published := time.Now()
				require.NoError(t, pub.Publish(topic, late))
				publish(t, pub, topic, "now")
				// On PostgreSQL a transaction of another test that is still running holds
				// every message committed after it begins back from delivery (the xmin
				// horizon, by design): if it holds "now" past the delayed message's time, the
				// order says nothing about the delay, and only the times are checked.
				checkOrder := d.name == "sqlite" || horizonPassedWithin(t, topic, 2500*time.Millisecond)
				if !checkOrder {
					t.Logf("another transaction held the xmin horizon for 2.5s: order not checked")
				}
				if !checkOrder {
					for _, ch := range chans {
						got := map[string]bool{}
						for range 2 {
							m := receive(t, ch, 3*time.Second+lateness)
							if string(m.Payload) == "late" {
								assert.GreaterOrEqual(t, time.Since(published), 3*time.Second, "delivered before its time")
							}
							got[string(m.Payload)] = true
							m.Ack()
						}
						assert.Equal(t, map[string]bool{"now": true, "late": true}, got)
					}
					return
				}
				for _, ch := range chans {
					first := receive(t, ch, 10*time.Second)
					assert.Equal(t, "now", string(first.Payload), "the undelayed message waited for the delayed one")
					assert.Less(t, time.Since(published), 3*time.Second, "the undelayed message was held back")
					first.Ack()
				}
				for _, ch := range chans {
					m := receive(t, ch, 3*time.Second+lateness)
					took := time.Since(published)
					require.Equal(t, "late", string(m.Payload))
					assert.GreaterOrEqual(t, took, 3*time.Second, "delivered before its time")
					t.Logf("delayed 3s, delivered after %v", took)
					assert.Equal(t, "1", m.Metadata.Get(sqlbroker.MetadataAttempt))
					m.Ack()
				}
			})
		}
	}
}

// 100 messages with random delays within 10 s come out in the order of their times, each no
// earlier than its time, and out of order only within the tolerance of the polls.
func TestDelay_randomDelaysComeOutInOrder(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		for _, mode := range d.modes() {
			t.Run(d.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				topic := testdb.Topic(t, "")
				db := d.open(t)
				pub := newPublisher(t, db)
				sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ClaimMode: mode, PollInterval: delayPoll})
				msgs, err := sub.Subscribe(context.Background(), topic)
				require.NoError(t, err)

				const n = 100
				at := map[string]time.Time{}
				batch := make([]*message.Message, n)
				for i := range batch {
					m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
					d := time.Duration(rand.Int64N(int64(10 * time.Second)))
					delay.Message(m, delay.For(d))
					at[m.UUID] = time.Now().Add(d)
					batch[i] = m
				}
				require.NoError(t, pub.Publish(topic, batch...))

				type got struct {
					due, arrived time.Time
				}
				var seen []got
				for range n {
					m := receive(t, msgs, 10*time.Second+lateness)
					now := time.Now()
					due, ok := at[m.UUID]
					require.True(t, ok)
					delete(at, m.UUID)
					require.False(t, now.Before(due), "message due at %v came %v early", due, due.Sub(now))
					seen = append(seen, got{due, now})
					m.Ack()
				}
				var worstLate, worstInversion time.Duration
				for i, g := range seen {
					worstLate = max(worstLate, g.arrived.Sub(g.due))
					if i > 0 {
						worstInversion = max(worstInversion, seen[i-1].due.Sub(g.due))
					}
				}
				t.Logf("latest delivery %v after its time; largest inversion %v", worstLate, worstInversion)
				assert.Less(t, worstInversion, lateness, "out of order by more than the tolerance")
				sorted := sort.SliceIsSorted(seen, func(i, j int) bool { return seen[i].due.Before(seen[j].due) })
				t.Logf("in exact order: %v", sorted)
			})
		}
	}
}

// delay.NewPublisher over this library's Publisher, with the delay in the message's context,
// just works.
func TestDelay_throughDelayPublisher(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		for _, mode := range d.modes() {
			t.Run(d.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				topic := testdb.Topic(t, "")
				db := d.open(t)
				pub, err := delay.NewPublisher(newPublisher(t, db), delay.PublisherConfig{})
				require.NoError(t, err)
				sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ClaimMode: mode, PollInterval: delayPoll})
				msgs, err := sub.Subscribe(context.Background(), topic)
				require.NoError(t, err)

				m := message.NewMessage(watermill.NewUUID(), []byte("x"))
				m.SetContext(delay.WithContext(context.Background(), delay.For(2*time.Second)))
				published := time.Now()
				require.NoError(t, pub.Publish(topic, m))
				got := receive(t, msgs, 2*time.Second+lateness)
				assert.GreaterOrEqual(t, time.Since(published), 2*time.Second, "delivered before its time")
				assert.Equal(t, m.UUID, got.UUID)
				got.Ack()
			})
		}
	}
}

// middleware.DelayOnError with this Subscriber: the failed message comes back no earlier than
// the delay the middleware set, rather than after the nack backoff.
func TestDelay_delayOnErrorRequeuesLater(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		for _, mode := range d.modes() {
			t.Run(d.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				topic := testdb.Topic(t, "")
				db := d.open(t)
				pub := newPublisher(t, db)
				sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ClaimMode: mode, PollInterval: delayPoll, NackBackoff: sqlbroker.NoBackoff})
				router, err := message.NewRouter(message.RouterConfig{}, nil)
				require.NoError(t, err)
				router.AddMiddleware((&middleware.DelayOnError{InitialInterval: 2 * time.Second, MaxInterval: 8 * time.Second, Multiplier: 2}).Middleware)
				type attempt struct {
					n  string
					at time.Time
				}
				attempts := make(chan attempt, 10)
				router.AddNoPublisherHandler("h", topic, sub, func(msg *message.Message) error {
					attempts <- attempt{msg.Metadata.Get(sqlbroker.MetadataAttempt), time.Now()}
					if msg.Metadata.Get(sqlbroker.MetadataAttempt) == "1" {
						return errors.New("fails the first time")
					}
					return nil
				})
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				go func() { _ = router.Run(ctx) }()
				<-router.Running()
				defer router.Close()
				publish(t, pub, topic, "x")

				var first attempt
				select {
				case first = <-attempts:
				case <-time.After(10 * time.Second):
					t.Fatal("no first attempt")
				}
				require.Equal(t, "1", first.n)
				select {
				case second := <-attempts:
					require.Equal(t, "2", second.n)
					assert.GreaterOrEqual(t, second.at.Sub(first.at), 2*time.Second, "redelivered before the middleware's delay")
					t.Logf("redelivered after %v", second.at.Sub(first.at))
				case <-time.After(2*time.Second + lateness):
					t.Fatal("not redelivered")
				}
				testdb.Eventually(t, 10*time.Second, "the ack", func() bool { return sub.Stats().Acked == 1 })
			})
		}
	}
}

// A message whose delay metadata cannot be read is refused, naming the key; nothing is written.
func TestDelay_unreadableTimeRefused(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, d.open(t))
			m := message.NewMessage(watermill.NewUUID(), []byte("x"))
			m.Metadata.Set(delay.DelayedUntilKey, "tomorrow")
			err := pub.Publish(topic, m)
			var perr *sqlbroker.PublishError
			require.ErrorAs(t, err, &perr)
			assert.Contains(t, err.Error(), fmt.Sprintf("metadata %s %q is not an RFC 3339 time", delay.DelayedUntilKey, "tomorrow"))
		})
	}
}

// Tables of schema version 1 (before delayed messages) are upgraded in place by
// InitializeSchema, keeping their messages and groups; without it Subscribe says how to
// upgrade them.
func TestSchema_version1TablesUpgraded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "old")
	plainMessages(t, topic, 1)

	plain, err := sqlbroker.NewSubscriber(pgxDB(t), sqlbroker.SubscriberConfig{}, nil)
	require.NoError(t, err)
	defer plain.Close()
	_, err = plain.Subscribe(ctx, topic)
	var verr *sqlbroker.SchemaVersionError
	require.ErrorAs(t, err, &verr)
	assert.Contains(t, err.Error(), "set InitializeSchema: true, or run the SQL of sqlbroker.SchemaSQL")

	sub := newSubscriber(t, sqlbroker.SubscriberConfig{PollInterval: delayPoll})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "old", string(m.Payload))
	m.Ack()

	late := message.NewMessage(watermill.NewUUID(), []byte("late"))
	delay.Message(late, delay.For(time.Second))
	published := time.Now()
	require.NoError(t, pub.Publish(topic, late))
	m = receive(t, msgs, time.Second+lateness)
	assert.GreaterOrEqual(t, time.Since(published), time.Second)
	m.Ack()
}

// SQLite tables written before delayed messages came to SQLite carry schema version 2 without
// the deliver_at column: InitializeSchema adds it in place, keeping their messages and
// groups; without it Subscribe says how to upgrade them.
func TestSchema_sqliteTablesWithoutDeliverAtUpgraded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := "t"
	tb := tables(topic)
	raw := testdb.SQLite(t)
	db := sqlbroker.SQLite(raw)
	pub := newPublisher(t, db)
	publish(t, pub, topic, "old")
	_, err := raw.ExecContext(ctx, `ALTER TABLE `+tb.Messages+` DROP COLUMN "deliver_at"`)
	require.NoError(t, err)

	plain, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{}, nil)
	require.NoError(t, err)
	defer plain.Close()
	_, err = plain.Subscribe(ctx, topic)
	var verr *sqlbroker.SchemaVersionError
	require.ErrorAs(t, err, &verr)
	assert.Contains(t, err.Error(), "without its deliver_at column")
	assert.Contains(t, err.Error(), "set InitializeSchema: true")

	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{PollInterval: delayPoll})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "old", string(m.Payload))
	m.Ack()

	late := message.NewMessage(watermill.NewUUID(), []byte("late"))
	delay.Message(late, delay.For(time.Second))
	published := time.Now()
	require.NoError(t, pub.Publish(topic, late))
	m = receive(t, msgs, time.Second+lateness)
	assert.GreaterOrEqual(t, time.Since(published), time.Second)
	m.Ack()
}

// The requeuer: DelayOnError marks the failed message, PoisonQueue moves it to a requeue
// topic, the requeuer publishes it back through this library's Publisher, and the message is
// delivered again on its topic no earlier than the delay.
func TestDelay_requeuerRepublishesDelayed(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			testRequeuerRepublishesDelayed(t, d)
		})
	}
}

func testRequeuerRepublishesDelayed(t *testing.T, d database) {
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	requeue := "requeue-" + topic
	if d.name != "sqlite" {
		t.Cleanup(func() { testdb.DropTopic(t, "", requeue) })
	}
	db := d.open(t)
	pub := newPublisher(t, db)
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{PollInterval: delayPoll})
	requeueSub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "requeuer", PollInterval: delayPoll})

	router, err := message.NewRouter(message.RouterConfig{}, nil)
	require.NoError(t, err)
	pq, err := middleware.PoisonQueue(pub, requeue)
	require.NoError(t, err)
	router.AddMiddleware(pq, (&middleware.DelayOnError{InitialInterval: 2 * time.Second, MaxInterval: 8 * time.Second, Multiplier: 2}).Middleware)
	handled := make(chan time.Time, 10)
	router.AddNoPublisherHandler("h", topic, sub, func(msg *message.Message) error {
		handled <- time.Now()
		if msg.Metadata.Get(requeuer.RetriesKey) == "" {
			return errors.New("fails until requeued")
		}
		return nil
	})
	_, err = requeuer.NewRequeuer(requeuer.Config{
		Subscriber: requeueSub, SubscribeTopic: requeue, Publisher: pub, Router: router,
		GeneratePublishTopic: func(p requeuer.GeneratePublishTopicParams) (string, error) {
			return p.Message.Metadata.Get(middleware.PoisonedTopicKey), nil
		},
	}, watermill.NopLogger{})
	require.NoError(t, err)
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = router.Run(rctx) }()
	<-router.Running()
	defer router.Close()

	publish(t, pub, topic, "x")
	var first time.Time
	select {
	case first = <-handled:
	case <-time.After(10 * time.Second):
		t.Fatal("not handled")
	}
	select {
	case again := <-handled:
		assert.GreaterOrEqual(t, again.Sub(first), 2*time.Second, "requeued before its delay")
		t.Logf("requeued and handled again after %v", again.Sub(first))
	case <-time.After(2*time.Second + lateness):
		t.Fatal("not requeued")
	}
}

// The time recovered from the delay metadata is never before the time the delay was set for,
// however late the message is published after delay.Message, and at most a second after it.
func TestDelay_metadataTimeNeverEarly(t *testing.T) {
	t.Parallel()
	base := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, frac := range []time.Duration{0, 100 * time.Millisecond, 900 * time.Millisecond, 999 * time.Millisecond} {
		for _, lag := range []time.Duration{0, 10 * time.Millisecond, 150 * time.Millisecond, 950 * time.Millisecond, 5 * time.Second} {
			want := base.Add(frac) // the time the delay was set for
			d := 3 * time.Second   // delay.For(d) at want-d
			md := message.Metadata{}
			md.Set(delay.DelayedUntilKey, want.Format(time.RFC3339))
			md.Set(delay.DelayedForKey, d.String())
			got, later, err := sqlbroker.DelayedUntil(md, want.Add(-d).Add(lag))
			require.NoError(t, err)
			assert.Equal(t, lag < d, later, "frac %v lag %v: still to come", frac, lag)
			assert.False(t, got.Before(want), "frac %v lag %v: %v is before %v", frac, lag, got, want)
			assert.LessOrEqual(t, got.Sub(want), time.Second, "frac %v lag %v", frac, lag)
			if lag < time.Second-frac {
				assert.Equal(t, want.Add(lag), got, "frac %v lag %v: the finer time", frac, lag)
			}
		}
	}
}

// horizonPassedWithin reports whether PostgreSQL's xmin horizon passed every message of
// topic within d: until it does, those messages are not delivered.
func horizonPassedWithin(t *testing.T, topic string, d time.Duration) bool {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		if queryInt(t, `SELECT count(*) FROM `+tables(topic).Messages+` WHERE "xid" >= pg_snapshot_xmin(pg_current_snapshot())`) == 0 {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond) // polling the server's horizon
	}
}

// Tables of schema version 2 kept a claim row per message: InitializeSchema moves their
// claims into rows per claim, keeping each claim's attempts and lease, and the messages
// they hold come back to the group, the acked one does not; without it Subscribe says how
// to upgrade them.
func TestSchema_version2ClaimsMoved(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	tb := tables(topic)
	pool := testdb.Pgx(t)
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "a", "b", "c", "d")
	plainMessages(t, topic, 2)
	old := `"` + strings.Trim(tb.Claims, `"`) + `"`
	_, err := pool.Exec(ctx, `DROP TABLE `+tb.Claims+`;
CREATE TABLE `+old+` (
	"group_id"   integer     NOT NULL,
	"offset"     bigint      NOT NULL,
	"token"      bigint      NOT NULL,
	"visible_at" timestamptz NOT NULL,
	"attempts"   integer     NOT NULL,
	CONSTRAINT "`+strings.TrimSuffix(strings.Trim(tb.Claims, `"`), "_claims")+`_c_pkey" PRIMARY KEY ("group_id", "offset"));
INSERT INTO `+tb.Groups+` ("consumer_group", "last_xid", "last_offset")
	SELECT 'g', "xid", "offset" FROM `+tb.Messages+` ORDER BY "offset" DESC LIMIT 1;
INSERT INTO `+old+` SELECT g."group_id", m."offset",
	CASE WHEN m."uuid" IN (SELECT "uuid" FROM `+tb.Messages+` ORDER BY "offset" LIMIT 2) THEN 7 ELSE 0 END,
	now() - interval '1 second',
	CASE WHEN m."uuid" IN (SELECT "uuid" FROM `+tb.Messages+` ORDER BY "offset" LIMIT 2) THEN 1 ELSE 2 END
	FROM `+tb.Messages+` m, `+tb.Groups+` g WHERE m."offset" < (SELECT max("offset") FROM `+tb.Messages+`);
COMMENT ON TABLE `+tb.Messages+` IS 'sqlbroker schema v2'`)
	require.NoError(t, err)

	assert.Contains(t, refusedSchema(t, pgxDB(t), topic), "stop the consumers and publishers of the older library")

	sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: delayPoll})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	got := map[string]string{}
	for range 3 {
		m := receive(t, msgs, 10*time.Second)
		got[string(m.Payload)] = m.Metadata.Get(sqlbroker.MetadataAttempt)
		m.Ack()
	}
	assert.Equal(t, map[string]string{"a": "2", "b": "2", "c": "3"}, got)
	noMessage(t, msgs, 300*time.Millisecond)
	assert.Equal(t, 0, queryInt(t, `SELECT count(*) FROM pg_class WHERE relname = $1`, strings.Trim(tb.Claims, `"`)+"_v2"), "the old claims table is left")
	testdb.Eventually(t, 10*time.Second, "every claim settled", func() bool { return claimedPG(t, tb.Claims, "true") == 0 })
}
