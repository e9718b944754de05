package tests

import (
	"context"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func benchMessages(n int) []*message.Message {
	payload := make([]byte, 256)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
	}
	return msgs
}

// BenchmarkPublish measures Publish: one message per call, and batches of 100 per call.
// ns/op is per message.
func BenchmarkPublish(b *testing.B) {
	for _, batch := range []int{1, 100} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			topic := testdb.Topic(b, "")
			pub, err := sqlbroker.NewPublisher(sqlbroker.Pgx(testdb.Pgx(b)), sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer pub.Close()
			msgs := benchMessages(batch)
			b.ResetTimer()
			for i := 0; i < b.N; i += batch {
				for _, m := range msgs {
					m.UUID = watermill.NewUUID()
				}
				if err := pub.Publish(topic, msgs...); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkConsume measures end-to-end consumption of a backlog with a no-op handler that
// acks at once, in each claim mode. ns/op is per message.
func BenchmarkConsume(b *testing.B) {
	for _, mode := range []sqlbroker.ClaimMode{sqlbroker.ClaimLease, sqlbroker.ClaimAdvisoryLock} {
		b.Run(mode.String(), func(b *testing.B) {
			db := sqlbroker.Pgx(testdb.Pgx(b))
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ClaimMode: mode, InitializeSchema: true}, nil)
			if err != nil {
				b.Skipf("claim mode %s: %v", mode, err)
			}
			defer sub.Close()
			topic := testdb.Topic(b, "")
			pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer pub.Close()
			for left := b.N; left > 0; left -= 1000 {
				if err := pub.Publish(topic, benchMessages(min(left, 1000))...); err != nil {
					b.Fatal(err)
				}
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			b.ResetTimer()
			msgs, err := sub.Subscribe(ctx, topic)
			if err != nil {
				b.Fatal(err)
			}
			for range b.N {
				(<-msgs).Ack()
			}
			b.StopTimer()
		})
	}
}
