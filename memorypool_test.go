package sqlbroker_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

// An in-memory SQLite broker works with the smallest pools: the connection that keeps the
// database alive does not take one of MaxConns' connections, and no connection watches for
// commits of other processes (none can write to it). Publish, receive and Shutdown end within
// the test's deadline.
func TestSQLite_memoryBrokerSmallPool(t *testing.T) {
	t.Parallel()
	for _, maxConns := range []int{1, 2, 3} {
		t.Run(fmt.Sprint(maxConns), func(t *testing.T) {
			t.Parallel()
			done := make(chan error, 1)
			go func() { done <- memoryRoundTrip(maxConns) }()
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(30 * time.Second):
				t.Fatalf("MaxConns %d: hung (publish, receive and Shutdown did not end in 30 s)", maxConns)
			}
		})
	}
}

// memoryRoundTrip publishes to and receives from a broker on sqlite::memory: with maxConns,
// and shuts it down.
func memoryRoundTrip(maxConns int) error {
	ctx := context.Background()
	b, err := sqlbroker.Open("sqlite::memory:", sqlbroker.BrokerConfig{MaxConns: maxConns}, nil)
	if err != nil {
		return fmt.Errorf("Open: %w", err)
	}
	defer b.Close()
	pub, err := b.NewPublisher(sqlbroker.PublisherConfig{InitializeSchema: true})
	if err != nil {
		return fmt.Errorf("NewPublisher: %w", err)
	}
	sub, err := b.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "g", InitializeSchema: true, PollInterval: 20 * time.Millisecond})
	if err != nil {
		return fmt.Errorf("NewSubscriber: %w", err)
	}
	ch, err := sub.Subscribe(ctx, "t")
	if err != nil {
		return fmt.Errorf("Subscribe: %w", err)
	}
	const n = 20
	sent := map[string]bool{}
	for range n {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		sent[m.UUID] = true
		if err := pub.Publish("t", m); err != nil {
			return fmt.Errorf("Publish: %w", err)
		}
	}
	for range n {
		select {
		case m := <-ch:
			if !sent[m.UUID] {
				return fmt.Errorf("received %s: not sent, or twice", m.UUID)
			}
			delete(sent, m.UUID)
			m.Ack()
		case <-time.After(20 * time.Second):
			return errors.New("receive: nothing within 20 s")
		}
	}
	sctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if _, err := b.Shutdown(sctx); err != nil {
		return fmt.Errorf("Shutdown: %w", err)
	}
	return nil
}
