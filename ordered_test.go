package sqlbroker_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
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

// orderCheck records handler starts and ends by key and counts what breaks the order: a
// message that starts before the one before it of its key was acked, or beside another of
// its key.
type orderCheck struct {
	mu         sync.Mutex
	acked      map[string]int  // per key, how many messages were acked (the next to start)
	in         map[string]bool // per key, a handler runs
	violations []string
	running    int
	maxRunning int
	nacks      int
}

func newOrderCheck() *orderCheck {
	return &orderCheck{acked: map[string]int{}, in: map[string]bool{}}
}

// handle runs one delivery of message i of key: it checks the order, works for a random
// time, and acks, or nacks with probability nackP.
func (c *orderCheck) handle(m *message.Message, nackP float64) {
	key, i := parseKeyed(string(m.Payload))
	c.mu.Lock()
	if c.acked[key] != i {
		c.violations = append(c.violations, fmt.Sprintf("key %s: message %d started with %d acked", key, i, c.acked[key]))
	}
	if c.in[key] {
		c.violations = append(c.violations, fmt.Sprintf("key %s: message %d started beside another of its key", key, i))
	}
	c.in[key] = true
	c.running++
	c.maxRunning = max(c.maxRunning, c.running)
	c.mu.Unlock()

	time.Sleep(time.Duration(rand.IntN(4000)) * time.Microsecond)

	c.mu.Lock()
	c.in[key] = false
	c.running--
	nack := rand.Float64() < nackP
	if nack {
		c.nacks++
	} else if c.acked[key] == i {
		c.acked[key] = i + 1
	}
	c.mu.Unlock()
	if nack {
		m.Nack()
	} else {
		m.Ack()
	}
}

func parseKeyed(p string) (string, int) {
	k, n, _ := strings.Cut(p, ":")
	i, _ := strconv.Atoi(n)
	return k, i
}

// orderedDatabases are the databases of the ordered claim: PostgreSQL and SQLite.
var orderedDatabases = []string{"pgx", "sqlite"}

// sameDatabase returns a func that opens a pool of its own on one database each time it is
// called, as processes of their own would: on PostgreSQL the test database, on SQLite one
// file of the test's.
func sameDatabase(t *testing.T, name string) func() sqlbroker.DB {
	if name != "sqlite" {
		return func() sqlbroker.DB { return pgxDB(t) }
	}
	path := testdb.SQLitePath(t)
	return func() sqlbroker.DB {
		db, err := sql.Open("sqlite", "file:"+path)
		require.NoError(t, err)
		t.Cleanup(func() { _ = db.Close() })
		return sqlbroker.SQLite(db)
	}
}

// Four subscribers of one group ordered by key, 64 keys of 40 messages each published
// interleaved, MaxInFlight 32, random handler times and 5% nacks: every message of a key
// starts only once the one before it was acked, never beside another of its key, and many
// keys run at once. On SQLite the subscribers work through pools of their own on one file.
func TestOrderByKey_fourSubscribersKeepOrderPerKey(t *testing.T) {
	t.Parallel()
	for _, name := range orderedDatabases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// One run on SQLite, with more time: its engine, compiled from C to Go, runs about
			// fifteen times slower under the race detector (half a minute to a minute a run on
			// a busy machine, against seconds without it).
			runs, wait := 3, 2*time.Minute
			if name == "sqlite" {
				runs, wait = 1, 5*time.Minute
			}
			for run := range runs {
				t.Run(strconv.Itoa(run), func(t *testing.T) { testFourSubscribersKeepOrder(t, sameDatabase(t, name), wait) })
			}
		})
	}
}

func testFourSubscribersKeepOrder(t *testing.T, open func() sqlbroker.DB, wait time.Duration) {
	const keys, perKey = 64, 40
	ctx, cancel := context.WithTimeout(context.Background(), wait+time.Minute)
	defer cancel()
	topic := testdb.Topic(t, "")
	pub, err := sqlbroker.NewPublisher(open(), sqlbroker.PublisherConfig{InitializeSchema: true,
		OrderKey: func(_ string, m *message.Message) (string, error) {
			k, _ := parseKeyed(string(m.Payload))
			return k, nil
		}}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	msgs := make([]*message.Message, 0, keys*perKey)
	for i := range perKey {
		for k := range keys {
			msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("k%d:%d", k, i))))
		}
	}
	for chunk := range slicesChunk(msgs, 500) {
		require.NoError(t, pub.Publish(topic, chunk...))
	}
	assert.Empty(t, msgs[0].Metadata.Get(sqlbroker.MetadataOrderKey), "the caller's message was changed")

	check := newOrderCheck()
	var wg sync.WaitGroup
	for range 4 {
		sub := newSubscriberOn(t, open(), sqlbroker.SubscriberConfig{ConsumerGroup: "g", OrderByKey: true, MaxInFlight: 32,
			NackBackoff: sqlbroker.NoBackoff, PollInterval: 20 * time.Millisecond})
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			var hw sync.WaitGroup
			for m := range ch {
				hw.Add(1)
				go func() { defer hw.Done(); check.handle(m, 0.05) }()
			}
			hw.Wait()
		}()
	}
	// An order broken ends the wait: the messages acked out of order are never counted.
	testdb.Eventually(t, wait, "every message acked", func() bool {
		check.mu.Lock()
		defer check.mu.Unlock()
		done := 0
		for _, n := range check.acked {
			done += n
		}
		return done == keys*perKey || len(check.violations) > 0
	})
	cancel()
	wg.Wait()
	check.mu.Lock()
	defer check.mu.Unlock()
	assert.Empty(t, check.violations)
	assert.GreaterOrEqual(t, check.maxRunning, 8, "too few messages in handlers at once")
	t.Logf("most in handlers at once: %d, nacks: %d", check.maxRunning, check.nacks)
}

// slicesChunk yields s in pieces of at most n.
func slicesChunk[T any](s []T, n int) func(func([]T) bool) {
	return func(yield func([]T) bool) {
		for len(s) > 0 {
			k := min(n, len(s))
			if !yield(s[:k]) {
				return
			}
			s = s[k:]
		}
	}
}

// OrderByKey where it cannot hold is refused with a ConfigError naming the field: in the
// advisory-lock mode. SQLite, which has the lease mode only, takes it.
func TestOrderByKey_refusedWhereItCannotHold(t *testing.T) {
	t.Parallel()
	_, err := sqlbroker.NewSubscriber(pgxDB(t), sqlbroker.SubscriberConfig{OrderByKey: true, ClaimMode: sqlbroker.ClaimAdvisoryLock}, nil)
	var cerr *sqlbroker.ConfigError
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, "OrderByKey", cerr.Field)
	assert.Contains(t, err.Error(), "lease mode")

	sub, err := sqlbroker.NewSubscriber(sqliteDB(t), sqlbroker.SubscriberConfig{OrderByKey: true, InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer sub.Close()
	_, err = sub.Subscribe(context.Background(), "t")
	require.NoError(t, err)
}

// A key computed by PublisherConfig.OrderKey is stored with the message, and an error of
// OrderKey fails the publish naming the message; a key already in the metadata is kept.
func TestPublisher_orderKeyStoredWithTheMessage(t *testing.T) {
	t.Parallel()
	topic := testdb.Topic(t, "")
	pub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{InitializeSchema: true,
		OrderKey: func(_ string, m *message.Message) (string, error) {
			if string(m.Payload) == "bad" {
				return "", fmt.Errorf("no key for this one")
			}
			return "computed", nil
		}}, nil)
	require.NoError(t, err)
	defer pub.Close()
	given := message.NewMessage(watermill.NewUUID(), []byte("given"))
	given.Metadata.Set(sqlbroker.MetadataOrderKey, "mine")
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("x")), given))
	bad := message.NewMessage(watermill.NewUUID(), []byte("bad"))
	err = pub.Publish(topic, bad)
	var perr *sqlbroker.PublishError
	require.ErrorAs(t, err, &perr)
	assert.Equal(t, bad.UUID, perr.UUID)
	assert.Contains(t, err.Error(), "no key for this one")

	sub := newSubscriber(t, sqlbroker.SubscriberConfig{OrderByKey: true})
	msgs, err := sub.Subscribe(context.Background(), topic)
	require.NoError(t, err)
	keys := map[string]string{}
	for range 2 {
		m := receive(t, msgs, 10*time.Second)
		keys[string(m.Payload)] = m.Metadata.Get(sqlbroker.MetadataOrderKey)
		m.Ack()
	}
	assert.Equal(t, map[string]string{"x": "computed", "given": "mine"}, keys)
}

// Messages parked behind their key are counted by Inspect (and so by the command and the
// collector), apart from the nacked ones, and listed as parked among the claims.
func TestOrderByKey_inspectCountsParked(t *testing.T) {
	t.Parallel()
	for _, name := range orderedDatabases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			db := sameDatabase(t, name)()
			pub := newPublisher(t, db)
			var ms []*message.Message
			for i := range 3 {
				ms = append(ms, keyed(strconv.Itoa(i), "A"))
			}
			require.NoError(t, pub.Publish(topic, ms...))
			sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{OrderByKey: true})
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			first := receive(t, msgs, 10*time.Second)
			assert.Equal(t, "0", string(first.Payload))
			noMessage(t, msgs, 300*time.Millisecond)

			a, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{})
			require.NoError(t, err)
			ins, err := a.Inspect(ctx, sqlbroker.InspectOptions{Topics: []string{topic}, Claims: 10})
			require.NoError(t, err)
			require.Len(t, ins.Topics, 1)
			require.Len(t, ins.Topics[0].Groups, 1)
			g := ins.Topics[0].Groups[0]
			assert.Equal(t, int64(2), g.Parked)
			assert.Equal(t, int64(1), g.InWork)
			assert.Equal(t, int64(0), g.Waiting)
			assert.Equal(t, int64(0), g.Due)
			var parked, held int
			for _, c := range ins.Topics[0].Claims {
				switch {
				case c.Parked && !c.Advisory && !c.Waiting && c.Deadline.IsZero():
					parked++
				case !c.Parked && !c.Advisory && !c.Waiting && c.Deadline.After(time.Now()):
					held++
				default:
					t.Errorf("claim listed as %+v", c)
				}
			}
			assert.Equal(t, 2, parked, "the claims listed as parked")
			assert.Equal(t, 1, held, "the claims listed as leased")

			first.Ack()
			second := receive(t, msgs, 10*time.Second)
			assert.Equal(t, "1", string(second.Payload))
			second.Ack()
			assert.Equal(t, "2", string(receive(t, msgs, 10*time.Second).Payload))
		})
	}
}

// keyed is a message of payload with the order key key.
func keyed(payload, key string) *message.Message {
	m := message.NewMessage(watermill.NewUUID(), []byte(payload))
	m.Metadata.Set(sqlbroker.MetadataOrderKey, key)
	return m
}

// A delayed message holds its key's later messages back until it has come and been acked;
// a message of another key goes at once. The delay leaves the first claim time to come before
// it on PostgreSQL, where a claim sees a message only once every transaction older than it
// has ended (other tests' on a shared server held it back for seconds).
func TestOrderByKey_delayedMessageHoldsItsKey(t *testing.T) {
	t.Parallel()
	for _, name := range orderedDatabases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			db := sameDatabase(t, name)()
			pub := newPublisher(t, db)
			late := keyed("A1", "A")
			delay.Message(late, delay.For(4*time.Second))
			published := time.Now()
			require.NoError(t, pub.Publish(topic, late, keyed("A2", "A"), keyed("B1", "B")))

			sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{OrderByKey: true, PollInterval: 20 * time.Millisecond})
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			first := receive(t, msgs, 10*time.Second)
			assert.Equal(t, "B1", string(first.Payload), "the other key goes at once")
			first.Ack()
			second := receive(t, msgs, 10*time.Second)
			assert.Equal(t, "A1", string(second.Payload), "A2 went before the delayed A1")
			assert.GreaterOrEqual(t, time.Since(published), 4*time.Second)
			noMessage(t, msgs, 300*time.Millisecond) // A2 waits for A1's ack
			second.Ack()
			assert.Equal(t, "A2", string(receive(t, msgs, 10*time.Second).Payload))
		})
	}
}

// A nacked message holds its key's later messages back through its backoff, comes again
// first of its key, and the next one goes only once it is acked; a message of another key
// goes meanwhile. Two subscribers of the group, so that neither the one that nacked nor the
// other takes the key's next message early.
func TestOrderByKey_nackHoldsItsKey(t *testing.T) {
	t.Parallel()
	// Long enough for B1 to be published and handled within it under the race detector with
	// the package's other tests running (700 ms was not, once).
	const nackHold = 2 * time.Second
	for _, name := range orderedDatabases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			open := sameDatabase(t, name)
			pub := newPublisher(t, open())
			require.NoError(t, pub.Publish(topic, keyed("A1", "A"), keyed("A2", "A")))

			got := make(chan *message.Message, 16)
			for range 2 {
				sub := newSubscriberOn(t, open(), sqlbroker.SubscriberConfig{ConsumerGroup: "g", OrderByKey: true,
					NackBackoff: nackHold, PollInterval: 20 * time.Millisecond})
				msgs, err := sub.Subscribe(ctx, topic)
				require.NoError(t, err)
				go func() {
					for m := range msgs {
						got <- m
					}
				}()
			}
			first := receive(t, got, 10*time.Second)
			require.Equal(t, "A1", string(first.Payload))
			first.Nack()
			nacked := time.Now()
			require.NoError(t, pub.Publish(topic, keyed("B1", "B")))
			other := receive(t, got, 10*time.Second)
			assert.Equal(t, "B1", string(other.Payload), "the other key goes during the backoff")
			other.Ack()
			again := receive(t, got, 10*time.Second)
			require.Equal(t, "A1", string(again.Payload), "A2 went before the nacked A1")
			assert.Equal(t, "2", again.Metadata.Get(sqlbroker.MetadataAttempt))
			assert.GreaterOrEqual(t, time.Since(nacked), nackHold)
			noMessage(t, got, 300*time.Millisecond) // A2 waits for A1's ack
			again.Ack()
			assert.Equal(t, "A2", string(receive(t, got, 10*time.Second).Payload))
		})
	}
}

// SQLite tables written before order by key came to SQLite lack the claims table's order_key
// column: without InitializeSchema, Subscribe says how to upgrade them; with it, the column
// is added in place, the messages and the group's position kept, and the group orders by key.
func TestSchema_sqliteClaimsWithoutOrderKeyUpgraded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := "t"
	tb := tables(topic).OnSQLite()
	raw := testdb.SQLite(t)
	db := sqlbroker.SQLite(raw)
	pub := newPublisher(t, db)
	publish(t, pub, topic, "old")
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g"})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	receive(t, msgs, 10*time.Second).Ack()
	require.NoError(t, sub.Close())
	_, err = raw.ExecContext(ctx, `DROP INDEX "sqlbroker_t_c_key"; ALTER TABLE `+tb.Claims+` DROP COLUMN "order_key"`)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, keyed("A1", "A"), keyed("A2", "A")))

	plain, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", OrderByKey: true}, nil)
	require.NoError(t, err)
	defer plain.Close()
	_, err = plain.Subscribe(ctx, topic)
	var verr *sqlbroker.SchemaVersionError
	require.ErrorAs(t, err, &verr)
	assert.Contains(t, err.Error(), "order_key")
	assert.Contains(t, err.Error(), "set InitializeSchema: true")

	upgraded := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", OrderByKey: true, PollInterval: 20 * time.Millisecond})
	msgs, err = upgraded.Subscribe(ctx, topic)
	require.NoError(t, err)
	first := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "A1", string(first.Payload), "the group's position was kept")
	noMessage(t, msgs, 300*time.Millisecond) // A2 waits for A1's ack
	first.Ack()
	assert.Equal(t, "A2", string(receive(t, msgs, 10*time.Second).Payload))
	ddl, err := sqlbroker.SQLiteSchemaSQL(topic, "")
	require.NoError(t, err)
	_, err = raw.ExecContext(ctx, ddl)
	require.NoError(t, err, "the DDL runs on the upgraded tables")
}

// On PostgreSQL the ack of a key's message claims the key's next one in the same statement
// and hands it to this subscriber: a key with many messages waiting goes one after another
// without a claim between them, in order.
func TestOrderByKey_ackHandsOverTheKeysNextMessage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	db := sameDatabase(t, "pgx")()
	pub := newPublisher(t, db)
	const n = 200
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = keyed(strconv.Itoa(i), "A")
	}
	require.NoError(t, pub.Publish(topic, msgs...))

	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{OrderByKey: true})
	out, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for i := range n {
		m := receive(t, out, 10*time.Second)
		require.Equal(t, strconv.Itoa(i), string(m.Payload), "out of order")
		m.Ack()
	}
	noMessage(t, out, 200*time.Millisecond)
	st := sub.Stats()
	assert.Equal(t, int64(n), st.Acked)
	// Every message but the first can be handed over; the few taken by a claim are those not
	// yet parked when the message before them was acked.
	assert.GreaterOrEqual(t, st.HandedOver, int64(n/2), "messages handed over by their predecessor's ack")
	t.Logf("handed over: %d of %d", st.HandedOver, n)
}

// A message of a key acked in the caller's transaction (AckInTx) frees its key as an ack
// does: the subscription claims the key's next message at once, not at its next poll.
func TestOrderByKey_ackInTxFreesTheKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pool := testdb.Pgx(t)
	pub := newPublisher(t, pgxDB(t))
	const poll = 30 * time.Second
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", OrderByKey: true,
		PollInterval: poll, IdlePollInterval: poll})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	// Published once subscribed, so that the NOTIFY wakes the subscription: a claim that
	// finds the messages still held back by another test's transaction (the xmin horizon)
	// is then tried again within milliseconds, not at the next poll.
	require.NoError(t, pub.Publish(topic, keyed("A1", "A"), keyed("A2", "A")))

	first := receive(t, msgs, 10*time.Second)
	require.Equal(t, "A1", string(first.Payload))
	noMessage(t, msgs, 300*time.Millisecond) // A2 is parked behind it
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.NoError(t, sqlbroker.AckInTx(ctx, sqlbroker.PgxTx(tx), first))
	require.NoError(t, tx.Commit(ctx))
	first.Ack()
	// Well within the polls: only the ack's own wake-up brings A2 this soon.
	assert.Equal(t, "A2", string(receive(t, msgs, poll/3).Payload))
}
