package sqlbroker_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// An outbox forwarded into another Pub/Sub keeps each key's order end to end: the service
// publishes through the forwarder's publisher onto a topic of this library (the key read out
// of the envelope), the forwarder's subscriber is ordered by key, and the other side receives
// every key's messages in the order they were published, while keys interleave.
func TestOrderByKey_forwarderKeepsOrderEndToEnd(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	outbox := testdb.Topic(t, "")
	logger := watermill.NopLogger{}

	sqlPub, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{InitializeSchema: true, OrderKey: sqlbroker.OrderKeyInEnvelope}, logger)
	require.NoError(t, err)
	defer sqlPub.Close()
	pub := forwarder.NewPublisher(sqlPub, forwarder.PublisherConfig{ForwarderTopic: outbox})

	// Publish returns once the message is acked here: without it, the GoChannel hands each
	// message to its subscribers from a goroutine of its own, and two messages published one
	// after the other may arrive the other way round.
	other := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 10000, BlockPublishUntilSubscriberAck: true}, logger)
	defer other.Close()
	dest, err := other.Subscribe(ctx, "dest")
	require.NoError(t, err)

	const keys, perKey = 16, 30
	for i := range perKey {
		for k := range keys {
			m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("k%d:%d", k, i)))
			m.Metadata.Set(sqlbroker.MetadataOrderKey, fmt.Sprintf("k%d", k))
			require.NoError(t, pub.Publish("dest", m))
		}
	}

	in := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "forwarder", OrderByKey: true, MaxInFlight: 32, PollInterval: 20 * time.Millisecond})
	fwd, err := forwarder.NewForwarder(in, slowPublisher{other}, logger, forwarder.Config{ForwarderTopic: outbox})
	require.NoError(t, err)
	go func() { _ = fwd.Run(ctx) }()
	defer fwd.Close()

	next := map[string]int{}
	var mu sync.Mutex
	for n := 0; n < keys*perKey; n++ {
		select {
		case m := <-dest:
			k, i := parseKeyed(string(m.Payload))
			mu.Lock()
			assert.Equal(t, next[k], i, "key %s out of order", k)
			next[k] = i + 1
			mu.Unlock()
			assert.Equal(t, k, m.Metadata.Get(sqlbroker.MetadataOrderKey))
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("%d of %d forwarded", n, keys*perKey)
		}
	}
}

// slowPublisher publishes after a short pause, so that the forwarder's handlers overlap and
// an order kept only by luck would show.
type slowPublisher struct{ message.Publisher }

func (p slowPublisher) Publish(topic string, msgs ...*message.Message) error {
	time.Sleep(time.Duration(len(msgs[0].UUID)%3) * time.Millisecond)
	return p.Publisher.Publish(topic, msgs...)
}
