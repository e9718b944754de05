package tests

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

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

// benchDrivers are the drivers the benchmarks run the library on: pgx keeps a prepared plan
// per statement; lib/pq sends each statement with arguments unnamed, planned on every call,
// in two round trips (see the README).
var benchDrivers = []struct {
	name string
	db   func(testing.TB) sqlbroker.DB
}{
	{"pgx", func(b testing.TB) sqlbroker.DB { return sqlbroker.Pgx(testdb.Pgx(b)) }},
	{"libpq", func(b testing.TB) sqlbroker.DB { return sqlbroker.StdSQL(testdb.Std(b)) }},
}

// BenchmarkPublish measures Publish on each driver: one message per call, and batches of 100
// per call. ns/op is per message.
func BenchmarkPublish(b *testing.B) {
	for _, drv := range benchDrivers {
		for _, batch := range []int{1, 100} {
			for _, notify := range []bool{true, false} {
				b.Run(fmt.Sprintf("%s/batch=%d/notify=%v", drv.name, batch, notify), func(b *testing.B) {
					topic := testdb.Topic(b, "")
					pub, err := sqlbroker.NewPublisher(drv.db(b), sqlbroker.PublisherConfig{InitializeSchema: true, DisableNotify: !notify}, nil)
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
	}
}

// BenchmarkConsume measures end-to-end consumption of a backlog with a no-op handler that
// acks at once, in each claim mode, on each driver. ns/op is per message.
func BenchmarkConsume(b *testing.B) {
	for _, drv := range benchDrivers {
		for _, mode := range []sqlbroker.ClaimMode{sqlbroker.ClaimLease, sqlbroker.ClaimAdvisoryLock} {
			b.Run(drv.name+"/"+mode.String(), func(b *testing.B) { benchConsume(b, drv.db(b), mode) })
		}
	}
}

func benchConsume(b *testing.B, db sqlbroker.DB, mode sqlbroker.ClaimMode) {
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
}

// BenchmarkShutdownUnderLoad measures how long a Router with the hook takes to stop with
// 10,000 messages queued and 64 handlers in work (each takes 50 ms): from router.Close to
// router.Run returning, which includes the drain, the shutdown and closing the pool the
// broker built. Reported as close-ms; the Router's CloseTimeout is 5 s.
func BenchmarkShutdownUnderLoad(b *testing.B) {
	for range b.N {
		b.StopTimer()
		topic := testdb.Topic(b, "")
		broker, err := sqlbroker.Open(testdb.URL(), sqlbroker.BrokerConfig{}, nil)
		if err != nil {
			b.Fatal(err)
		}
		ctx := context.Background()
		if err := broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic); err != nil {
			b.Fatal(err)
		}
		pub, _ := broker.NewPublisher(sqlbroker.PublisherConfig{})
		for range 10 {
			if err := pub.Publish(topic, benchMessages(1000)...); err != nil {
				b.Fatal(err)
			}
		}
		sub, _ := broker.NewSubscriber(sqlbroker.SubscriberConfig{MaxInFlight: 64})
		const closeTimeout = 5 * time.Second
		router, _ := message.NewRouter(message.RouterConfig{CloseTimeout: closeTimeout}, watermill.NopLogger{})
		hook := sqlbroker.NewRouterHook(broker, sqlbroker.RouterHookConfig{CloseTimeout: closeTimeout})
		router.AddPlugin(hook.Plugin)
		var running atomic.Int64
		router.AddNoPublisherHandler("work", topic, sub, func(msg *message.Message) error {
			running.Add(1)
			defer running.Add(-1)
			time.Sleep(50 * time.Millisecond)
			return nil
		})
		done := make(chan error, 1)
		go func() { done <- router.Run(ctx) }()
		deadline := time.Now().Add(30 * time.Second)
		for running.Load() < 64 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		b.StartTimer()
		start := time.Now()
		if err := router.Close(); err != nil {
			b.Fatal(err)
		}
		if err := <-done; err != nil {
			b.Fatal(err)
		}
		elapsed := time.Since(start)
		b.StopTimer()
		rep, err := hook.Report()
		if err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(float64(elapsed.Milliseconds()), "close-ms")
		b.ReportMetric(float64(rep.ClaimsReleased), "claims-released")
		b.ReportMetric(float64(rep.DeliveriesInWork), "left-in-work")
	}
}
