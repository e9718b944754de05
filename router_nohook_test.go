package sqlbroker_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// What the README says of a Router without the hook: router.Close() closes the subscriber at
// once, which cancels the context of a message in work; cancelling Run's context only stops
// the subscription, and the message in work keeps its context while the Router waits for it.
func TestRouterWithoutHook_closeCancelsRunContextDoesNot(t *testing.T) {
	t.Parallel()
	for _, viaClose := range []bool{true, false} {
		name := "run context cancelled"
		if viaClose {
			name = "router.Close"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, pgxDB(t))
			sub := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "g"})
			router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
			require.NoError(t, err)
			started := make(chan context.Context, 1)
			release := make(chan struct{})
			watched := &closeWatch{Subscriber: sub, closed: make(chan struct{})}
			router.AddNoPublisherHandler("h", topic, watched, func(msg *message.Message) error {
				started <- msg.Context()
				select {
				case <-release:
				case <-msg.Context().Done():
				}
				return nil
			})
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			runErr := make(chan error, 1)
			go func() { runErr <- router.Run(ctx) }()
			<-router.Running()
			publish(t, pub, topic, "x")
			var msgCtx context.Context
			select {
			case msgCtx = <-started:
			case <-time.After(30 * time.Second):
				t.Fatal("no message handled")
			}
			if viaClose {
				closed := make(chan error, 1)
				go func() { closed <- router.Close() }()
				testdb.Eventually(t, 10*time.Second, "the message's context to be cancelled", func() bool { return msgCtx.Err() != nil })
				require.NoError(t, <-closed)
			} else {
				cancel()
				// The subscription stops and closes its channel; the Router then waits for
				// the message in work, whose context stays as it was.
				select {
				case <-watched.closed:
				case <-time.After(10 * time.Second):
					t.Fatal("the subscription's channel was not closed")
				}
				assert.NoError(t, msgCtx.Err(), "the message in work keeps its context")
				close(release)
			}

			select {
			case err := <-runErr:
				require.NoError(t, err)
			case <-time.After(30 * time.Second):
				t.Fatal("Run did not return")
			}
		})
	}
}

// closeWatch relays a subscription's messages and closes closed when its channel is closed.
type closeWatch struct {
	message.Subscriber
	closed chan struct{}
}

func (w *closeWatch) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	in, err := w.Subscriber.Subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	go func() {
		defer close(w.closed)
		defer close(out)
		for m := range in {
			out <- m
		}
	}()
	return out, nil
}
