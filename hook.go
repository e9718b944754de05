package sqlbroker

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Shutdowner is what a RouterHook shuts down: a *Subscriber, or a *Broker with everything it
// handed out.
type Shutdowner interface {
	Shutdown(ctx context.Context) (CloseReport, error)
	attach(*RouterHook)
}

func (s *Subscriber) attach(h *RouterHook) { s.hook.Store(h) }

// attach hooks the subscribers the broker handed out, and those it will hand out.
func (b *Broker) attach(h *RouterHook) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hook = h
	for _, s := range b.subscribers {
		s.attach(h)
	}
}

// RouterHookConfig configures a RouterHook.
type RouterHookConfig struct {
	// CloseTimeout must be the Router's RouterConfig.CloseTimeout: handlers drain for at most
	// this long, minus the time the shutdown keeps for itself (a tenth of it, at most 2s).
	// Defaults to 30s, the Router's own default.
	CloseTimeout time.Duration
}

// RouterHook ties the library's shutdown to a Watermill Router's (S10). Add its Plugin to
// the Router; when router.Run returns, whether the Router was closed or Run's context was
// cancelled, the handlers have drained, the library has shut down and closed what it built,
// and Report returns what the shutdown did:
//
//	hook := sqlbroker.NewRouterHook(broker, sqlbroker.RouterHookConfig{CloseTimeout: 30 * time.Second})
//	router.AddPlugin(hook.Plugin)
//	err := router.Run(ctx)
//	report, shutdownErr := hook.Report()
//
// If router.Run fails before it runs (a Subscribe error), no subscription ever stops and the
// hook never shuts the owner down: call the owner's Shutdown yourself in that case.
//
// The order: the Router stops the subscriptions (claims not yet handed to a handler are given
// back at once) and the handlers in work finish, up to CloseTimeout, while their leases are
// still extended; then the owner shuts down (claim loops and lease extension stop, locks are
// released, a pool built from a URL closes last). The owner's subscribers' Close then stops
// their subscriptions only, and their channels close once the shutdown is done, which is
// what router.Run waits for.
type RouterHook struct {
	owner  Shutdowner
	config RouterHookConfig

	mu       sync.Mutex
	active   int       // hooked subscriptions not yet drained
	deadline time.Time // end of the drain, set when the first subscription stops
	once     sync.Once
	done     chan struct{}
	report   CloseReport
	err      error
}

// ErrNotShutDown is returned by RouterHook.Report before the shutdown ran.
var ErrNotShutDown = errors.New("sqlbroker: the router hook's shutdown has not run")

// NewRouterHook builds a RouterHook that shuts owner down.
func NewRouterHook(owner Shutdowner, config RouterHookConfig) *RouterHook {
	if config.CloseTimeout <= 0 {
		config.CloseTimeout = DefaultCloseTimeout
	}
	return &RouterHook{owner: owner, config: config, done: make(chan struct{})}
}

// Plugin is the message.RouterPlugin: router.AddPlugin(hook.Plugin). From then on the
// owner's subscribers are the Router's: their Close stops the subscriptions only, and the
// hook shuts the owner down once the handlers have drained.
func (h *RouterHook) Plugin(*message.Router) error {
	h.owner.attach(h)
	return nil
}

// Done is closed when the shutdown has finished.
func (h *RouterHook) Done() <-chan struct{} { return h.done }

// Report returns the shutdown's report and error, or ErrNotShutDown before it ran.
func (h *RouterHook) Report() (CloseReport, error) {
	select {
	case <-h.done:
		return h.report, h.err
	default:
		return CloseReport{}, ErrNotShutDown
	}
}

// margin is the part of CloseTimeout the shutdown keeps for itself.
func (h *RouterHook) margin() time.Duration { return min(h.config.CloseTimeout/10, 2*time.Second) }

// drained is called by a hooked subscription once its channel closed and its handlers are
// done (or the drain time ran out). The last one runs the shutdown; all wait for it.
func (h *RouterHook) drained() {
	h.mu.Lock()
	h.active--
	last := h.active == 0
	h.mu.Unlock()
	if last {
		h.once.Do(h.shutdown)
	}
	select {
	case <-h.done:
	case <-time.After(h.config.CloseTimeout):
	}
}

// shutdown runs the owner's shutdown with what is left of CloseTimeout since the first
// subscription stopped, and at least the margin.
func (h *RouterHook) shutdown() {
	budget := max(time.Until(h.drainDeadline())+h.margin(), h.margin())
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	h.report, h.err = h.owner.Shutdown(ctx)
	close(h.done)
}

// drainDeadline is when handlers stop being waited for: CloseTimeout after the first
// subscription stopped, less the shutdown's margin.
func (h *RouterHook) drainDeadline() time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.deadline.IsZero() {
		h.deadline = time.Now().Add(h.config.CloseTimeout - h.margin())
	}
	return h.deadline
}

// relay hands the subscription's messages on, and once the subscription stopped and its
// handlers drained, takes part in the shutdown; its channel closes after the shutdown, which
// is what router.Run waits for.
func (h *RouterHook) relay(sub *subscription) <-chan *message.Message {
	h.mu.Lock()
	h.active++
	h.mu.Unlock()
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for msg := range sub.out {
			out <- msg // the Router reads its channel until it is closed
		}
		// The subscription stopped. Handlers in work finish while their leases are extended.
		deadline := h.drainDeadline()
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for sub.inFlight() > 0 && time.Now().Before(deadline) {
			<-t.C
		}
		if n := sub.inFlight(); n > 0 {
			sub.logger.Info("Handlers still in work after the drain time; shutting down", watermill.LogFields{"in_work": n})
		}
		h.drained()
	}()
	return out
}
