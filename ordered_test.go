package sqlbroker_test

import (
	"context"
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

// Four subscribers of one group ordered by key, 64 keys of 40 messages each published
// interleaved, MaxInFlight 32, random handler times and 5% nacks: every message of a key
// starts only once the one before it was acked, never beside another of its key, and many
// keys run at once.
func TestOrderByKey_fourSubscribersKeepOrderPerKey(t *testing.T) {
	t.Parallel()
	const keys, perKey = 64, 40
	for run := range 3 {
		t.Run(strconv.Itoa(run), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			topic := testdb.Topic(t, "")
			pub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{InitializeSchema: true,
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
				sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g", OrderByKey: true, MaxInFlight: 32,
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
			testdb.Eventually(t, 2*time.Minute, "every message acked", func() bool {
				check.mu.Lock()
				defer check.mu.Unlock()
				done := 0
				for _, n := range check.acked {
					done += n
				}
				return done == keys*perKey
			})
			cancel()
			wg.Wait()
			check.mu.Lock()
			defer check.mu.Unlock()
			assert.Empty(t, check.violations)
			assert.GreaterOrEqual(t, check.maxRunning, 8, "too few messages in handlers at once")
			t.Logf("most in handlers at once: %d, nacks: %d", check.maxRunning, check.nacks)
		})
	}
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
// advisory-lock mode, and on SQLite.
func TestOrderByKey_refusedWhereItCannotHold(t *testing.T) {
	t.Parallel()
	_, err := sqlbroker.NewSubscriber(pgxDB(t), sqlbroker.SubscriberConfig{OrderByKey: true, ClaimMode: sqlbroker.ClaimAdvisoryLock}, nil)
	var cerr *sqlbroker.ConfigError
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, "OrderByKey", cerr.Field)
	assert.Contains(t, err.Error(), "lease mode")

	sub, err := sqlbroker.NewSubscriber(sqlbroker.SQLite(testdb.SQLite(t)), sqlbroker.SubscriberConfig{OrderByKey: true, InitializeSchema: true}, nil)
	if err == nil {
		defer sub.Close()
		_, err = sub.Subscribe(context.Background(), "t")
	}
	require.ErrorAs(t, err, &cerr)
	assert.Equal(t, "OrderByKey", cerr.Field)
	assert.Contains(t, err.Error(), "SQLite")
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
// collector), apart from the nacked ones.
func TestOrderByKey_inspectCountsParked(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	var ms []*message.Message
	for i := range 3 {
		m := message.NewMessage(watermill.NewUUID(), []byte(strconv.Itoa(i)))
		m.Metadata.Set(sqlbroker.MetadataOrderKey, "A")
		ms = append(ms, m)
	}
	require.NoError(t, pub.Publish(topic, ms...))
	sub := newSubscriber(t, sqlbroker.SubscriberConfig{OrderByKey: true})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	first := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "0", string(first.Payload))
	noMessage(t, msgs, 300*time.Millisecond)

	a, err := sqlbroker.NewAdmin(pgxDB(t), sqlbroker.AdminConfig{})
	require.NoError(t, err)
	ins, err := a.Inspect(ctx, sqlbroker.InspectOptions{Topics: []string{topic}})
	require.NoError(t, err)
	require.Len(t, ins.Topics, 1)
	require.Len(t, ins.Topics[0].Groups, 1)
	g := ins.Topics[0].Groups[0]
	assert.Equal(t, int64(2), g.Parked)
	assert.Equal(t, int64(1), g.InWork)
	assert.Equal(t, int64(0), g.Waiting)

	first.Ack()
	second := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "1", string(second.Payload))
	second.Ack()
	assert.Equal(t, "2", string(receive(t, msgs, 10*time.Second).Payload))
}

// A delayed message holds its key's later messages back until it has come and been acked;
// a message of another key goes at once.
func TestOrderByKey_delayedMessageHoldsItsKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	keyed := func(payload, key string) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(payload))
		m.Metadata.Set(sqlbroker.MetadataOrderKey, key)
		return m
	}
	late := keyed("A1", "A")
	delay.Message(late, delay.For(1500*time.Millisecond))
	published := time.Now()
	require.NoError(t, pub.Publish(topic, late, keyed("A2", "A"), keyed("B1", "B")))

	sub := newSubscriber(t, sqlbroker.SubscriberConfig{OrderByKey: true, PollInterval: 20 * time.Millisecond})
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	first := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "B1", string(first.Payload), "the other key goes at once")
	first.Ack()
	second := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "A1", string(second.Payload), "A2 went before the delayed A1")
	assert.GreaterOrEqual(t, time.Since(published), 1500*time.Millisecond)
	noMessage(t, msgs, 300*time.Millisecond) // A2 waits for A1's ack
	second.Ack()
	assert.Equal(t, "A2", string(receive(t, msgs, 10*time.Second).Payload))
}
