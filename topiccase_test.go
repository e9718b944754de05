package sqlbroker_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// Two topics whose names differ only in letter case are two topics: each subscriber receives
// its own topic's messages only, with a group of its own and with one group name on both,
// and a message moved to the dead-letter topic of one is not seen on the other's. SQLite
// compares table names without regard to case, so there the two topics' tables must be named
// apart.
func TestTopicNames_differingOnlyInCaseAreDistinct(t *testing.T) {
	t.Parallel()
	for _, d := range leaseDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			lower := testdb.Topic(t, "")
			upper := strings.ToUpper(lower)
			for _, topic := range []string{upper, lower + sqlbroker.DefaultDeadLetterSuffix, upper + sqlbroker.DefaultDeadLetterSuffix} {
				t.Cleanup(func() { testdb.DropTopic(t, "", topic) })
			}
			db := d.open(t)
			pub := newPublisher(t, db)

			const n = 5
			// Subscriptions of one group name on both topics, and of a group of their own.
			sameLower, err := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g"}).Subscribe(ctx, lower)
			require.NoError(t, err)
			sameUpper, err := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g"}).Subscribe(ctx, upper)
			require.NoError(t, err)
			ownLower, err := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "lower-only"}).Subscribe(ctx, lower)
			require.NoError(t, err)
			ownUpper, err := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "upper-only"}).Subscribe(ctx, upper)
			require.NoError(t, err)

			publish(t, pub, lower, repeat("published to "+lower, n)...)
			publish(t, pub, upper, repeat("published to "+upper, n)...)

			for _, c := range []struct {
				topic string
				ch    <-chan *message.Message
			}{{lower, sameLower}, {upper, sameUpper}, {lower, ownLower}, {upper, ownUpper}} {
				for range n {
					m := receive(t, c.ch, 10*time.Second)
					assert.Equal(t, "published to "+c.topic, string(m.Payload), "a subscriber of %s", c.topic)
					m.Ack()
				}
			}
			for _, ch := range []<-chan *message.Message{sameLower, sameUpper, ownLower, ownUpper} {
				noMessage(t, ch, 200*time.Millisecond)
			}

			// Dead letters: a message nacked at its only attempt moves to its topic's
			// dead-letter topic, and only there.
			dlLower, err := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "ops"}).Subscribe(ctx, lower+sqlbroker.DefaultDeadLetterSuffix)
			require.NoError(t, err)
			dlUpper, err := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "ops"}).Subscribe(ctx, upper+sqlbroker.DefaultDeadLetterSuffix)
			require.NoError(t, err)
			for _, topic := range []string{lower, upper} {
				ch, err := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "failing", MaxAttempts: 1}).Subscribe(ctx, topic)
				require.NoError(t, err)
				for range n {
					m := receive(t, ch, 10*time.Second)
					require.Equal(t, "published to "+topic, string(m.Payload))
					m.Nack()
				}
			}
			for _, c := range []struct {
				topic string
				ch    <-chan *message.Message
			}{{lower, dlLower}, {upper, dlUpper}} {
				for range n {
					m := receive(t, c.ch, 10*time.Second)
					assert.Equal(t, "published to "+c.topic, string(m.Payload), "the dead-letter topic of %s", c.topic)
					assert.Equal(t, c.topic, m.Metadata.Get(sqlbroker.MetadataDeadLetterTopic))
					m.Ack()
				}
			}
			noMessage(t, dlLower, 200*time.Millisecond)
			noMessage(t, dlUpper, 200*time.Millisecond)
		})
	}
}

// repeat returns n copies of s.
func repeat(s string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = s
	}
	return out
}
