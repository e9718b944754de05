package sqlbroker_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A publisher that commits after later publishers must not be skipped: the subscriber holds
// the later messages back until the earlier transaction ends, then delivers all of them.
func TestSubscriber_M2_outOfOrderCommitsLoseNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{PollInterval: 20 * time.Millisecond})
	require.NoError(t, sub.SubscribeInitialize(topic))

	tx, err := testdb.Pgx(t).Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	txPub, err := sqlbroker.NewPublisher(sqlbroker.PgxTx(tx), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	early := publish(t, txPub, topic, "early")[0] // takes its offset and xid first, commits last

	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	late := publish(t, pub, topic, "late-1", "late-2")

	// While the early transaction is open, the later messages stay behind the xmin horizon.
	noMessage(t, msgs, 500*time.Millisecond)

	require.NoError(t, tx.Commit(ctx))
	got := map[string]bool{}
	for range 3 {
		m := receive(t, msgs, 10*time.Second)
		got[m.UUID] = true
		m.Ack()
	}
	assert.True(t, got[early.UUID], "the early message was skipped")
	assert.True(t, got[late[0].UUID] && got[late[1].UUID])
}

// A delivery whose lease ran out and whose message was claimed again cannot ack it: the ack is
// refused, counted, and the new holder's ack applies (L3).
func TestSubscriber_L3_staleAckRefusedAndCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	// No extension happens during the test: the lease is made to run out by hand. With one
	// message in flight, the slow subscriber does not claim it back itself.
	slow := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", MaxInFlight: 1, LeaseTTL: time.Hour, LeaseRenewInterval: 30 * time.Minute})
	publish(t, pub, topic, "x")

	first, err := slow.Subscribe(ctx, topic)
	require.NoError(t, err)
	m1 := receive(t, first, 10*time.Second)
	assert.Equal(t, "1", m1.Metadata.Get(sqlbroker.MetadataAttempt))

	// The lease runs out (as if the consumer had stalled past it).
	_, err = testdb.Pgx(t).Exec(ctx, "UPDATE "+tables(topic).Claims+" SET visible_at = now() - interval '1 second'")
	require.NoError(t, err)

	other := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
	second, err := other.Subscribe(ctx, topic)
	require.NoError(t, err)
	m2 := receive(t, second, 10*time.Second)
	assert.Equal(t, m1.UUID, m2.UUID)
	assert.Equal(t, "2", m2.Metadata.Get(sqlbroker.MetadataAttempt))

	m1.Ack() // stale
	testdb.Eventually(t, 10*time.Second, "the stale ack to be refused", func() bool { return slow.Stats().StaleSettlements == 1 })
	assert.Equal(t, int64(0), slow.Stats().Acked)
	assert.Equal(t, 1, claimedPG(t, tables(topic).Claims, "true"), "the stale ack deleted the claim")

	m2.Ack()
	testdb.Eventually(t, 10*time.Second, "the new holder's ack", func() bool { return other.Stats().Acked == 1 })
	assert.Equal(t, 0, claimedPG(t, tables(topic).Claims, "true"))
}

// A lease that cannot be extended is lost: the message's context is cancelled with
// ErrLeaseLost so the handler can stop (L4).
func TestSubscriber_L4_lostLeaseCancelsMessageContext(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	logs := watermill.NewCaptureLogger()
	sub, err := sqlbroker.NewSubscriber(pgxDB(t), sqlbroker.SubscriberConfig{LeaseTTL: 2 * time.Second, LeaseRenewInterval: 100 * time.Millisecond, InitializeSchema: true}, logs)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	publish(t, pub, topic, "x")
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)

	// Another holder took the claim: its token no longer matches this delivery's.
	refusedAt := time.Now()
	_, err = testdb.Pgx(t).Exec(ctx, "UPDATE "+tables(topic).Claims+" SET token = 42")
	require.NoError(t, err)

	select {
	case <-m.Context().Done():
	case <-time.After(10 * time.Second):
		t.Fatal("message context not cancelled after the lease was lost")
	}
	assert.ErrorIs(t, context.Cause(m.Context()), sqlbroker.ErrLeaseLost)
	assert.Equal(t, int64(1), sub.Stats().LeasesLost)
	// The log line says when the lease would have run out: refused, not run out, it had not.
	var lost []watermill.CapturedMessage
	for _, c := range logs.Captured()[watermill.InfoLogLevel] {
		if strings.HasPrefix(c.Msg, "Lease lost") {
			lost = append(lost, c)
		}
	}
	require.Len(t, lost, 1)
	deadline, err := time.Parse(time.RFC3339Nano, fmt.Sprint(lost[0].Fields["lease_deadline"]))
	require.NoError(t, err, "lease_deadline of %v", lost[0].Fields)
	assert.True(t, deadline.After(refusedAt), "the lease refused before it ran out has its deadline %v before the refusal %v", deadline, refusedAt)
	assert.NotContains(t, lost[0].Fields, "extension_error", "the extension ran and was refused")
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack to be refused", func() bool { return sub.Stats().StaleSettlements == 1 })
}

// leftInWork publishes one message to topic, has a subscriber of group "g" with a lease of
// one second take it, and shuts that subscriber down with the message still in its handler:
// the claim stays, and its lease runs out a second later.
func leftInWork(t *testing.T, pub message.Publisher, topic string) *message.Message {
	t.Helper()
	dying := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", LeaseTTL: time.Second, LeaseRenewInterval: 200 * time.Millisecond})
	publish(t, pub, topic, "x")
	msgs, err := dying.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	rep, err := dying.Shutdown(context.Background())
	require.NoError(t, err)
	require.Equal(t, 1, rep.LeasesLeft)
	return m
}

// A consumer that stops extending (it died, or shut down with the delivery in work) leaves a
// lease that runs out; the message then goes to another consumer of the group, with its
// attempt count raised (L5, S4).
func TestSubscriber_L5_deadConsumersMessageReturnsAfterLease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	m := leftInWork(t, pub, topic)
	stopped := time.Now()

	other := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
	again, err := other.Subscribe(ctx, topic)
	require.NoError(t, err)
	m2 := receive(t, again, 10*time.Second)
	assert.Equal(t, m.UUID, m2.UUID)
	assert.Equal(t, "2", m2.Metadata.Get(sqlbroker.MetadataAttempt))
	assert.GreaterOrEqual(t, time.Since(stopped), 500*time.Millisecond, "redelivered before the lease ran out")
	m2.Ack()
}

// A claim whose lease ran out is taken back while a backlog drains, not only once the backlog
// has run out: a subscriber whose claims all come back full still looks for claims due again,
// once a PollInterval (L5).
func TestSubscriber_L5_deadConsumersMessageReturnsDuringBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	x := leftInWork(t, pub, topic)

	const backlog = 5000
	publish(t, pub, topic, numbered(backlog)...)

	// One in flight: every claim asks for one message and gets it while the backlog lasts.
	other := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", MaxInFlight: 1, PollInterval: 20 * time.Millisecond})
	started := time.Now()
	again, err := other.Subscribe(ctx, topic)
	require.NoError(t, err)
	for before := 0; ; before++ {
		m := receive(t, again, 10*time.Second)
		m.Ack()
		if m.UUID == x.UUID {
			assert.Equal(t, "2", m.Metadata.Get(sqlbroker.MetadataAttempt))
			assert.Less(t, before, backlog, "taken back only after the backlog ran out")
			t.Logf("taken back after %d of %d backlog messages, %v after the subscriber started", before, backlog, time.Since(started))
			return
		}
	}
}

// Draining a backlog, in either claim mode and with either driver, meets no database error:
// a claim that fails is retried and its messages still arrive, so only the count shows it.
// Every claim statement variant runs here (the first claim looks for claims due again, the
// following ones do not), with the random 62-bit tokens of real claims.
func TestSubscriber_drainMeetsNoError(t *testing.T) {
	t.Parallel()
	for _, mode := range []sqlbroker.ClaimMode{sqlbroker.ClaimLease, sqlbroker.ClaimAdvisoryLock} {
		for name, db := range map[string]func(*testing.T) sqlbroker.DB{"pgx": pgxDB, "libpq": stdDB} {
			t.Run(mode.String()+"/"+name, func(t *testing.T) {
				ctx := context.Background()
				topic := testdb.Topic(t, "")
				pub := newPublisher(t, db(t))
				const backlog = 2000
				publish(t, pub, topic, numbered(backlog)...)
				sub, err := sqlbroker.NewSubscriber(db(t), sqlbroker.SubscriberConfig{ConsumerGroup: "g", ClaimMode: mode, InitializeSchema: true, BatchSize: 50}, nil)
				require.NoError(t, err)
				t.Cleanup(func() { _ = sub.Close() })
				msgs, err := sub.Subscribe(ctx, topic)
				require.NoError(t, err)
				seen := map[string]bool{}
				for len(seen) < backlog {
					m := receive(t, msgs, 10*time.Second)
					seen[string(m.Payload)] = true
					m.Ack()
				}
				testdb.Eventually(t, 10*time.Second, "every ack", func() bool { return sub.Stats().Acked == backlog })
				assert.Zero(t, sub.Stats().Errors, "database errors")
			})
		}
	}
}

// Nack gives the message back with a backoff; the attempt count travels in the metadata (M4).
func TestSubscriber_M4_nackBackoffAndAttempts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	backoff := 400 * time.Millisecond
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{NackBackoff: backoff, PollInterval: 20 * time.Millisecond})
	publish(t, pub, topic, "x")
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	m := receive(t, msgs, 10*time.Second)
	require.Equal(t, "1", m.Metadata.Get(sqlbroker.MetadataAttempt))
	for attempt := 2; attempt <= 3; attempt++ {
		nacked := time.Now()
		m.Nack()
		m = receive(t, msgs, 10*time.Second)
		assert.GreaterOrEqual(t, time.Since(nacked), backoff-20*time.Millisecond, "redelivered before the backoff passed")
		require.Equal(t, strconv.Itoa(attempt), m.Metadata.Get(sqlbroker.MetadataAttempt))
	}
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack", func() bool { return sub.Stats().Acked == 1 })
	assert.Equal(t, int64(2), sub.Stats().Nacked)
	assert.Equal(t, 0, claimedPG(t, tables(topic).Claims, "true"))
}

// Cancelling the Subscribe context gives back at once every claim not yet handed to a handler
// and closes the channel (M5).
func TestSubscriber_M5_cancelReleasesUndeliveredClaims(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", MaxInFlight: 10})
	publish(t, pub, topic, "0", "1", "2", "3", "4", "5", "6", "7", "8", "9")

	ctx, cancel := context.WithCancel(context.Background())
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	held := receive(t, msgs, 10*time.Second) // handed out; the other nine are claimed, waiting
	testdb.Eventually(t, 10*time.Second, "ten claims", func() bool {
		return claimedPG(t, tables(topic).Claims, "true") == 10
	})
	cancel()
	for range msgs { // closed once the claims are given back
	}
	assert.Equal(t, 9, claimedPG(t, tables(topic).Claims, "token <= 0 AND visible_at <= now()"),
		"undelivered claims not released")
	assert.Equal(t, int64(9), sub.Stats().Released)

	// Another consumer of the group takes them at once, not after a lease.
	other := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
	again, err := other.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	for range 9 {
		m := receive(t, again, 5*time.Second)
		assert.NotEqual(t, held.UUID, m.UUID)
		assert.Equal(t, "1", m.Metadata.Get(sqlbroker.MetadataAttempt), "a release must not count as an attempt")
		m.Ack()
	}
	held.Ack()
}

// Close stops every subscription, releases what was not handed out, and reports it.
func TestSubscriber_M5_closeReleasesAndReports(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{MaxInFlight: 5})
	publish(t, pub, topic, "0", "1", "2", "3", "4")
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	testdb.Eventually(t, 10*time.Second, "five claims", func() bool {
		return claimedPG(t, tables(topic).Claims, "true") == 5
	})

	rep, err := sub.Shutdown(ctx)
	require.NoError(t, err)
	_, open := <-msgs
	assert.False(t, open, "channel not closed by Shutdown")
	assert.Equal(t, 1, rep.Subscriptions)
	assert.Equal(t, 4, rep.ClaimsReleased)
	assert.Equal(t, 1, rep.DeliveriesInWork)
	assert.Equal(t, 1, rep.LeasesLeft)
	assert.ErrorIs(t, context.Cause(m.Context()), sqlbroker.ErrClosed)

	// Close after Shutdown is a no-op; Subscribe is refused.
	require.NoError(t, sub.Close())
	_, err = sub.Subscribe(ctx, topic)
	assert.ErrorIs(t, err, sqlbroker.ErrClosed)
	m.Ack() // within its lease, but after Shutdown: not applied (S4, S11)
	holds(t, 500*time.Millisecond, "the late ack not applied", func() bool {
		return claimedPG(t, tables(topic).Claims, "token > 0") == 1
	})
	assert.Equal(t, int64(0), sub.Stats().Acked)
}

// Each consumer group receives every message (M1).
func TestSubscriber_M1_everyGroupGetsEveryMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	sent := publish(t, pub, topic, "a", "b", "c")
	for _, group := range []string{"billing", "audit"} {
		sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: group})
		msgs, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		for i := range sent {
			m := receive(t, msgs, 10*time.Second)
			assert.Equal(t, sent[i].UUID, m.UUID, "group %s", group)
			m.Ack()
		}
	}
	// A group that starts at the newest sees only what comes after it.
	late := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "late", StartAtNewest: true, PollInterval: 20 * time.Millisecond})
	msgs, err := late.Subscribe(ctx, topic)
	require.NoError(t, err)
	next := publish(t, pub, topic, "d")[0]
	m := receive(t, msgs, 10*time.Second)
	assert.Equal(t, next.UUID, m.UUID)
	m.Ack()
}

// Topic and group names are validated before any SQL runs (M6): against a database that
// cannot be reached, the error is still the name's.
func TestSubscriber_M6_invalidNamesRefusedBeforeSQL(t *testing.T) {
	t.Parallel()
	unreachable := unreachableDB(t)
	for _, bad := range []string{"", "a b", `x"; DROP TABLE users; --`, "é", string(make([]byte, 300))} {
		_, err := sqlbroker.NewSubscriber(unreachable, sqlbroker.SubscriberConfig{ConsumerGroup: bad + "x "}, nil)
		var nameErr *sqlbroker.NameError
		require.ErrorAs(t, err, &nameErr, "group %q", bad)
		assert.Equal(t, "ConsumerGroup", nameErr.Field)

		sub, err := sqlbroker.NewSubscriber(unreachable, sqlbroker.SubscriberConfig{}, nil)
		require.NoError(t, err)
		_, err = sub.Subscribe(context.Background(), bad)
		require.ErrorAs(t, err, &nameErr, "topic %q", bad)
		assert.Equal(t, "topic", nameErr.Field)
		require.NoError(t, sub.Close())

		pub, err := sqlbroker.NewPublisher(unreachable, sqlbroker.PublisherConfig{}, nil)
		require.NoError(t, err)
		err = pub.Publish(bad, message.NewMessage(watermill.NewUUID(), nil))
		require.ErrorAs(t, err, &nameErr, "topic %q", bad)
	}
}

// Without InitializeSchema, a missing table is named, with how to create it (M7).
func TestSubscriber_M7_missingTablesNamed(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	sub, err := sqlbroker.NewSubscriber(pgxDB(t), sqlbroker.SubscriberConfig{}, nil)
	require.NoError(t, err)
	defer sub.Close()
	_, err = sub.Subscribe(context.Background(), topic)
	var missing *sqlbroker.MissingTableError
	require.ErrorAs(t, err, &missing)
	assert.Contains(t, err.Error(), tables(topic).Messages)
	assert.Contains(t, err.Error(), "InitializeSchema")
	assert.Contains(t, err.Error(), "SchemaSQL")

	pub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	err = pub.Publish(topic, message.NewMessage(watermill.NewUUID(), nil))
	require.ErrorAs(t, err, &missing)

	// The exported schema creates what Subscribe needs.
	ddl, err := sqlbroker.SchemaSQL(topic, "", "")
	require.NoError(t, err)
	_, err = testdb.Pgx(t).Exec(context.Background(), ddl)
	require.NoError(t, err)
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	require.NotNil(t, msgs)
}

// Tables created by another schema version are refused with the version named.
func TestSubscriber_schemaVersionMismatch(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{})
	require.NoError(t, sub.SubscribeInitialize(topic))
	_, err := testdb.Pgx(t).Exec(context.Background(), "COMMENT ON TABLE "+tables(topic).Messages+" IS 'sqlbroker schema v0'")
	require.NoError(t, err)
	fresh, err := sqlbroker.NewSubscriber(pgxDB(t), sqlbroker.SubscriberConfig{}, nil)
	require.NoError(t, err)
	defer fresh.Close()
	_, err = fresh.Subscribe(context.Background(), topic)
	var verr *sqlbroker.SchemaVersionError
	require.ErrorAs(t, err, &verr)
	assert.Contains(t, err.Error(), "v0")
}

func TestSubscriberConfig_invalidDurationsNamed(t *testing.T) {
	t.Parallel()
	cases := []struct {
		cfg   sqlbroker.SubscriberConfig
		field string
	}{
		{sqlbroker.SubscriberConfig{LeaseTTL: -time.Second}, "LeaseTTL"},
		{sqlbroker.SubscriberConfig{LeaseTTL: 30 * time.Second, LeaseRenewInterval: 40 * time.Second}, "LeaseRenewInterval (40s) must be shorter than LeaseTTL (30s)"},
		{sqlbroker.SubscriberConfig{PollInterval: -1}, "PollInterval"},
		{sqlbroker.SubscriberConfig{NackBackoff: -time.Minute}, "NackBackoff"},
		{sqlbroker.SubscriberConfig{MaxInFlight: -3}, "MaxInFlight"},
		{sqlbroker.SubscriberConfig{ClaimMode: 7}, "ClaimMode"},
		{sqlbroker.SubscriberConfig{TablePrefix: "Bad-Prefix"}, "TablePrefix"},
		{sqlbroker.SubscriberConfig{Schema: `x"y`}, "Schema"},
	}
	for _, c := range cases {
		_, err := sqlbroker.NewSubscriber(pgxDB(t), c.cfg, nil)
		require.Error(t, err)
		assert.Contains(t, err.Error(), c.field)
		var cerr *sqlbroker.ConfigError
		var nerr *sqlbroker.NameError
		assert.True(t, errors.As(err, &cerr) || errors.As(err, &nerr), "%T", err)
	}
}

// With Retention, messages every group has settled are deleted; those a group has not
// reached, or still claims, are kept. With partitions of one offset each, a message at a time.
func TestSubscriber_retentionDeletesSettledMessages(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	smallPartitions(t, topic, 1, 4)
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "1", "2", "3", "4")
	fast := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "fast", Retention: time.Millisecond})
	slow := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "slow", MaxInFlight: 2})
	fastMsgs, err := fast.Subscribe(ctx, topic)
	require.NoError(t, err)
	slowMsgs, err := slow.Subscribe(ctx, topic)
	require.NoError(t, err)
	for range 4 {
		receive(t, fastMsgs, 10*time.Second).Ack()
	}
	// The slow group has settled the first message and holds the second.
	receive(t, slowMsgs, 10*time.Second).Ack()
	held := receive(t, slowMsgs, 10*time.Second)
	testdb.Eventually(t, 10*time.Second, "the first message to be pruned", func() bool { return countMessages(t, topic) == 3 })
	held.Ack()
	for range 2 {
		receive(t, slowMsgs, 10*time.Second).Ack()
	}
	testdb.Eventually(t, 10*time.Second, "the remaining messages to be pruned", func() bool { return countMessages(t, topic) == 0 })
}

// inHandlersOfBacklog publishes n messages (payloads "0", "1", ...) to a new topic, subscribes
// to it with cfg and receives cfg.MaxInFlight of them, left unsettled as if in handlers.
func inHandlersOfBacklog(t *testing.T, cfg sqlbroker.SubscriberConfig, n int) (string, *sqlbroker.Subscriber, <-chan *message.Message, []*message.Message) {
	t.Helper()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	sub := newSubscriber(t, cfg)
	payloads := make([]string, n)
	for i := range payloads {
		payloads[i] = strconv.Itoa(i)
	}
	publish(t, pub, topic, payloads...)
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	var inHandlers []*message.Message
	for range cfg.MaxInFlight {
		inHandlers = append(inHandlers, receive(t, msgs, 10*time.Second))
	}
	return topic, sub, msgs, inHandlers
}

// MaxInFlight bounds the messages in handlers (M3); in lease mode up to BatchSize more are
// claimed ahead, handed out as handler slots free, and given back at once on Close (M5).
func TestSubscriber_M3_handlersBoundedClaimsAheadGivenBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic, sub, msgs, inHandlers := inHandlersOfBacklog(t, sqlbroker.SubscriberConfig{MaxInFlight: 4}, 20)
	claims := func() int { return claimedPG(t, tables(topic).Claims, "true") }
	testdb.Eventually(t, 10*time.Second, "four claims held ahead", func() bool { return claims() == 8 })
	noMessage(t, msgs, 300*time.Millisecond) // four in handlers: no fifth
	assert.Equal(t, 8, claims(), "more than MaxInFlight + BatchSize claimed")

	// An ack frees a slot: the next message comes from the claims held ahead.
	inHandlers[0].Ack()
	inHandlers = append(inHandlers[1:], receive(t, msgs, 10*time.Second))
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool { return sub.Stats().Acked == 1 })
	held := claims()
	assert.LessOrEqual(t, held, 8)

	rep, err := sub.Shutdown(ctx)
	require.NoError(t, err)
	assert.Equal(t, 4, rep.DeliveriesInWork)
	assert.Equal(t, held-4, rep.ClaimsReleased, "claims held ahead not given back")
	assert.Equal(t, held-4, claimedPG(t, tables(topic).Claims, "token <= 0 AND visible_at <= now()"))
	for _, m := range inHandlers {
		m.Ack() // within their leases, but after Shutdown: not applied (S4, S11)
	}
	holds(t, 500*time.Millisecond, "the late acks not applied", func() bool {
		return claimedPG(t, tables(topic).Claims, "token > 0") == 4
	})
	assert.Equal(t, int64(1), sub.Stats().Acked)
}

// In advisory mode the claims held ahead hold their locks too: with no ack waiting for its
// statement, MaxInFlight + BatchSize locks at most (A6), every one of them a claim row of the
// subscription. Shutdown gives back those
// held ahead and drops their locks, then releases the locks of those in handlers (S5), so
// nothing stays locked, and LocksReleased counts both (S9).
func TestSubscriber_A6_advisoryLocksBoundedClaimsAheadGivenBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg := sqlbroker.SubscriberConfig{ClaimMode: sqlbroker.ClaimAdvisoryLock, MaxInFlight: 4, BatchSize: 3}
	topic, sub, msgs, inHandlers := inHandlersOfBacklog(t, cfg, 20)
	claims := func() int {
		return claimedPG(t, tables(topic).Claims, "visible_at = 'infinity'")
	}
	key1 := advisory.Key1(tables(topic).Messages, sqlbroker.DefaultConsumerGroup)
	locks := func() int {
		return queryInt(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
			AND classid = $1::int4::oid AND granted`, key1)
	}
	testdb.Eventually(t, 10*time.Second, "three claims held ahead", func() bool { return claims() == 7 })
	noMessage(t, msgs, 300*time.Millisecond) // four in handlers: no fifth
	assert.Equal(t, 7, claims(), "more than MaxInFlight + BatchSize claimed")
	assert.Equal(t, 7, locks(), "a claim held without its lock, or a lock without its claim")
	assert.Equal(t, 7, sub.Stats().LocksHeld)

	// An ack frees a slot: the next message comes from the claims held ahead.
	inHandlers[0].Ack()
	inHandlers = append(inHandlers[1:], receive(t, msgs, 10*time.Second))
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool { return sub.Stats().Acked == 1 })
	// Its place is claimed again: three ahead once more, never more.
	testdb.Eventually(t, 10*time.Second, "three claims held ahead again", func() bool { return claims() == 7 })
	noMessage(t, msgs, 100*time.Millisecond)
	assert.Equal(t, 7, locks())

	rep, err := sub.Shutdown(ctx)
	require.NoError(t, err)
	assert.Equal(t, 4, rep.DeliveriesInWork)
	assert.Equal(t, 3, rep.ClaimsReleased, "claims held ahead not given back")
	assert.Equal(t, 7, rep.LocksReleased, "the locks of the claims held ahead and of the deliveries in work")
	assert.Equal(t, 0, locks(), "locks left after Shutdown")
	assert.Equal(t, 3, claimedPG(t, tables(topic).Claims, "token <= 0 AND visible_at <= now()"))
	for _, m := range inHandlers {
		m.Ack() // after Shutdown returned: not applied, and nothing waits for it (S5, S11)
	}
	time.Sleep(300 * time.Millisecond) // what is asserted is that nothing happens
	assert.EqualValues(t, 1, sub.Stats().Acked)
	assert.Equal(t, 4, claims(), "a late ack was applied: its claim row is gone")
}

// A3 with claims held ahead: when the lock connection dies, the claims waiting to be handed
// out lost their locks too. None of them reaches a handler (its context would already be
// cancelled and its ack refused); every message comes back, by the orphan search, under a new
// lock, and nothing stays locked.
func TestSubscriber_A3_lockLostWhileHeldAhead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{ClaimMode: sqlbroker.ClaimAdvisoryLock, MaxInFlight: 2, BatchSize: 2})
	payloads := []string{"0", "1", "2", "3", "4", "5"}
	publish(t, pub, topic, payloads...)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)

	first := []*message.Message{receive(t, msgs, 10*time.Second), receive(t, msgs, 10*time.Second)}
	key1 := advisory.Key1(tables(topic).Messages, sqlbroker.DefaultConsumerGroup)
	locks := func() int {
		return queryInt(t, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
			AND classid = $1::int4::oid AND granted`, key1)
	}
	// Four locks, and four claims committed: a claim takes its locks inside its statement,
	// so the locks show before the claim is committed, and a claim still running when its
	// connection dies takes nothing (its messages come back with attempt 1).
	testdb.Eventually(t, 10*time.Second, "two claims held ahead", func() bool {
		return locks() == 4 && claimedPG(t, tables(topic).Claims, "true") == 4
	})
	pid := queryInt(t, `SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2
		AND classid = $1::int4::oid`, key1)
	require.Equal(t, 1, queryInt(t, `SELECT count(*) FROM (SELECT pg_terminate_backend($1)) x`, pid))

	for _, m := range first {
		select {
		case <-m.Context().Done():
			assert.ErrorIs(t, context.Cause(m.Context()), sqlbroker.ErrLeaseLost)
		case <-time.After(5 * time.Second):
			t.Fatalf("message %s: context not cancelled after its lock connection died", m.Payload)
		}
		m.Ack() // refused: its lock is gone
	}
	testdb.Eventually(t, 5*time.Second, "late acks refused", func() bool { return sub.Stats().StaleSettlements == 2 })
	assert.EqualValues(t, 4, sub.Stats().LeasesLost, "two in handlers, two held ahead")

	// The four claimed before the connection died come back with attempt 2; the other two
	// are claimed for the first time.
	seen := map[string]string{}
	for len(seen) < len(payloads) {
		m := receive(t, msgs, 10*time.Second)
		require.NoError(t, m.Context().Err(), "message %s handed out with its claim already lost", m.Payload)
		_, dup := seen[string(m.Payload)]
		require.False(t, dup, "message %s delivered twice after the connection died", m.Payload)
		seen[string(m.Payload)] = m.Metadata.Get(sqlbroker.MetadataAttempt)
		m.Ack()
	}
	assert.Equal(t, map[string]string{"0": "2", "1": "2", "2": "2", "3": "2", "4": "1", "5": "1"}, seen)
	testdb.Eventually(t, 10*time.Second, "acks applied", func() bool { return sub.Stats().Acked == 6 })
	assert.Equal(t, 0, claimedPG(t, tables(topic).Claims, "true"))
	rep, err := sub.Shutdown(ctx)
	require.NoError(t, err)
	assert.Equal(t, 0, rep.LocksReleased)
	assert.Equal(t, 0, locks())
}

// A claim statement whose connection is cut after part of its result arrived (a restart of
// the server does that) hands out none of its rows and gives them back: whether the server
// committed the claim is not known. The subscription then goes on claiming. With MaxInFlight 1
// it used to keep the place of the row it had read and never claim again.
func TestSubscriber_claimCutMidResultIsGivenBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	proxy, pool := newCutProxy(t)
	// The lease is far longer than the wait for the message: it must come back by its
	// release, not by its lease running out.
	sub, err := sqlbroker.NewSubscriber(sqlbroker.Pgx(pool), sqlbroker.SubscriberConfig{
		ConsumerGroup: "g", MaxInFlight: 1, LeaseTTL: time.Minute, InitializeSchema: true,
		PollInterval: 50 * time.Millisecond, RetryInterval: 100 * time.Millisecond,
	}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	publish(t, pub, topic, "before")
	m := receive(t, msgs, 10*time.Second)
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the first message acked", func() bool { return sub.Stats().Acked == 1 })

	proxy.armed.Store(true)
	cut := publish(t, pub, topic, "cut")[0]
	m = receive(t, msgs, 15*time.Second)
	assert.Equal(t, cut.UUID, m.UUID)
	assert.EqualValues(t, 1, proxy.cuts.Load(), "the claim's connection was not cut")
	m.Ack()

	after := publish(t, pub, topic, "after")[0]
	m = receive(t, msgs, 10*time.Second)
	assert.Equal(t, after.UUID, m.UUID)
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "all acked", func() bool { return sub.Stats().Acked == 3 })
	st := sub.Stats()
	assert.GreaterOrEqual(t, st.Errors, int64(1), "the cut claim was not counted as an error")
	assert.EqualValues(t, 1, st.Released, "the cut claim's row was not given back")
}
