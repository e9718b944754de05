package sqlbroker

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// Shutdowner is what a RouterHook shuts down when the Router closes: a *Broker with everything
// it handed out, a *Subscriber, or a type of your own (a fake in a test, or a service that
// stops more than the library).
//
// router.Run returns after the owner's Shutdown, whatever the owner. The handlers drain
// before it, and the owner's subscribers stop their subscriptions only when the Router
// closes them, if the owner is, or embeds, a *Broker or a *Subscriber; any other Shutdowner
// is shut down when the Router closes, without a drain.
type Shutdowner interface {
	Shutdown(ctx context.Context) (CloseReport, error)
}

// attacher is the optional part of a Shutdowner that hands its subscribers to the hook.
type attacher interface {
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
	// this long, minus the time the shutdown keeps for itself (a tenth of it, at most 2s), so
	// that the shutdown ends before the Router stops waiting. The hook cannot read it from
	// the Router, which keeps its configuration to itself. 0 means 30s, the Router's own
	// default.
	CloseTimeout time.Duration
}

// RouterHook ties the library's shutdown to a Watermill Router's. Add its Plugin to the
// Router; when router.Run returns, whether the Router was closed or Run's context was
// cancelled, the handlers have drained, the library has shut down and closed what it built,
// and Report returns what the shutdown did:
//
//	hook := sqlbroker.NewRouterHook(broker, sqlbroker.RouterHookConfig{CloseTimeout: 30 * time.Second})
//	router.AddPlugin(hook.Plugin)
//	err := router.Run(ctx)
//	report, shutdownErr := hook.Report()
//
// The owner shuts down when the Router closes: router.Close(), Run's context cancelled, or
// every handler of the Router stopped (which makes the Router close itself). A handler
// stopped alone with Handler.Stop stops alone: its subscription gives back at once the claims
// not yet handed to it, what it has in work settles as usual, and the other handlers and the
// owner go on. So does a subscription taken with Subscribe outside the Router when its
// context ends.
//
// If router.Run fails before it runs (a Subscribe error), the Router never runs and the hook
// never shuts the owner down: call the owner's Shutdown yourself in that case.
//
// The order: the Router stops the subscriptions (claims not yet handed to a handler are given
// back at once) and the handlers in work finish, up to CloseTimeout, while their leases are
// still extended; then the owner shuts down (claim loops and lease extension stop, locks are
// released, a pool built from a URL closes last). The owner's subscribers' Close then stops
// their subscriptions only, and the Router's channels close once the shutdown is done, which
// is what router.Run waits for. The report counts what the whole closing of the Router did,
// the subscriptions that stopped before the shutdown began included.
type RouterHook struct {
	owner  Shutdowner
	config RouterHookConfig

	mu       sync.Mutex
	expected int                        // handlers the Router had when Run loaded the plugin
	started  int                        // handlers that subscribed through the hook
	live     []context.Context          // their contexts, those not yet ended
	closing  bool                       // the Router called Close on a subscriber
	subs     map[*subscription]struct{} // the Router's subscriptions of the owner, until they end
	deadline time.Time                  // end of the drain, set when the Router began to close

	once   sync.Once
	done   chan struct{}
	report CloseReport
	err    error
}

// ErrNotShutDown is returned by RouterHook.Report before the shutdown ran.
var ErrNotShutDown = errors.New("sqlbroker: the router hook's shutdown has not run")

// NewRouterHook builds a RouterHook that shuts owner down.
func NewRouterHook(owner Shutdowner, config RouterHookConfig) *RouterHook {
	if config.CloseTimeout <= 0 {
		config.CloseTimeout = DefaultCloseTimeout
	}
	return &RouterHook{owner: owner, config: config, subs: map[*subscription]struct{}{}, done: make(chan struct{})}
}

// Plugin is the message.RouterPlugin: router.AddPlugin(hook.Plugin). From then on the
// owner's subscribers are the Router's: their Close stops the subscriptions only, and the
// hook shuts the owner down once the Router closes and its handlers have drained.
//
// The hook learns that the Router closes from the handlers' subscriptions: it adds a
// subscriber decorator that sees the context of every handler's Subscribe, whatever its
// subscriber. The Router ends all those contexts when it closes or Run's context is
// cancelled; Handler.Stop ends one.
func (h *RouterHook) Plugin(r *message.Router) error {
	h.mu.Lock()
	h.expected = len(r.Handlers())
	h.mu.Unlock()
	if a, ok := h.owner.(attacher); ok {
		a.attach(h)
	}
	r.AddSubscriberDecorators(func(sub message.Subscriber) (message.Subscriber, error) {
		return &hookedSubscriber{Subscriber: sub, hook: h}, nil
	})
	return nil
}

// hookedSubscriber is a handler's subscriber as the Router sees it once the hook is added.
type hookedSubscriber struct {
	message.Subscriber
	hook *RouterHook
}

// routerSubscription marks the context of a Subscribe made by one of the Router's handlers.
type routerSubscription struct{ hook *RouterHook }

func (hs *hookedSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	h := hs.hook
	ch, err := hs.Subscriber.Subscribe(context.WithValue(ctx, routerSubscription{h}, true), topic)
	if err != nil {
		return nil, err
	}
	h.mu.Lock()
	h.started++
	h.live = append(h.live, ctx)
	h.mu.Unlock()
	// Every handler's channel, the owner's or not, closes after the shutdown when the Router
	// closes, so that router.Run waits for it whichever handlers are left.
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for msg := range ch {
			out <- msg
		}
		if h.routerClosing() {
			h.closeDown()
		}
	}()
	return out, nil
}

// Close is called by the Router only when it closes.
func (hs *hookedSubscriber) Close() error {
	hs.hook.closeBegun()
	return hs.Subscriber.Close()
}

// closeBegun records that the Router, or the user, began to close the owner's subscribers.
func (h *RouterHook) closeBegun() {
	h.mu.Lock()
	h.closing = true
	h.mu.Unlock()
}

// routerClosing reports whether the Router is closing: it called Close on a subscriber, or
// every handler that subscribed has had its context ended (Close and Run's cancelled
// context end them all; Handler.Stop ends one). Before every handler known when Run began has
// subscribed, a handler's end is not the Router's.
func (h *RouterHook) routerClosing() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closing {
		return true
	}
	live := h.live[:0]
	for _, ctx := range h.live {
		if ctx.Err() == nil {
			live = append(live, ctx)
		}
	}
	clear(h.live[len(live):])
	h.live = live
	return h.started > 0 && h.started >= h.expected && len(h.live) == 0
}

// isRouterSubscription reports whether ctx is that of a Subscribe by one of the Router's
// handlers, through this hook.
func (h *RouterHook) isRouterSubscription(ctx context.Context) bool {
	return ctx.Value(routerSubscription{h}) != nil
}

// routerState is a subscription's side of a RouterHook.
type routerState struct {
	taken atomic.Bool // taken by a handler of a hooked Router
	alone atomic.Bool // a Router subscription that stopped while the Router ran on
}

// stoppedAlone reports whether sub, of a hooked subscriber, stopped before the Router's
// closing and not because of it: a handler stopped alone, or a Subscribe outside the Router
// whose context ended. What its stop did is then no part of the hook's report.
func (sub *subscription) stoppedAlone() bool {
	if sub.s.hook.Load() == nil {
		return false
	}
	if sub.router.taken.Load() {
		return sub.router.alone.Load()
	}
	// Outside the Router: its own context ended, not the owner's Close or Shutdown.
	return sub.ctx.Err() != nil && !errors.Is(context.Cause(sub.ctx), ErrClosed)
}

// forget drops a subscription that has ended.
func (h *RouterHook) forget(sub *subscription) {
	h.mu.Lock()
	delete(h.subs, sub)
	h.mu.Unlock()
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

// closeDown lets the handlers of the Router's subscriptions drain, then shuts the owner down;
// concurrent callers wait for it.
func (h *RouterHook) closeDown() {
	h.once.Do(func() {
		h.mu.Lock()
		h.deadline = time.Now().Add(h.config.CloseTimeout - h.margin())
		h.mu.Unlock()
		h.drain()
		h.shutdown()
	})
}

// drain waits until no handler of the Router's subscriptions has a message in work, or the
// drain time ran out.
func (h *RouterHook) drain() {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		h.mu.Lock()
		subs := make([]*subscription, 0, len(h.subs))
		for sub := range h.subs {
			subs = append(subs, sub)
		}
		deadline := h.deadline
		h.mu.Unlock()
		n := 0
		for _, sub := range subs {
			n += sub.inFlight()
		}
		if n == 0 {
			return
		}
		if !time.Now().Before(deadline) {
			subs[0].logger.Info("Handlers still in work after the drain time; shutting down", watermill.LogFields{"in_work": n})
			return
		}
		<-t.C
	}
}

// shutdown runs the owner's shutdown with what is left of CloseTimeout since the Router began
// to close, and at least the margin.
func (h *RouterHook) shutdown() {
	h.mu.Lock()
	deadline := h.deadline
	h.mu.Unlock()
	budget := max(time.Until(deadline)+h.margin(), h.margin())
	ctx, cancel := context.WithTimeout(context.Background(), budget)
	defer cancel()
	h.report, h.err = h.owner.Shutdown(ctx)
	close(h.done)
}

// relay hands a Router subscription's messages on. When the subscription stops, it stops
// alone (its channel closes at once) unless the Router is closing; then it takes part in the
// shutdown, and its channel closes after it, which is what router.Run waits for.
func (h *RouterHook) relay(sub *subscription) <-chan *message.Message {
	h.mu.Lock()
	h.subs[sub] = struct{}{}
	h.mu.Unlock()
	out := make(chan *message.Message)
	go func() {
		defer close(out)
		for msg := range sub.handout.out {
			out <- msg // the Router reads its channel until it is closed
		}
		if !h.routerClosing() {
			sub.router.alone.Store(true) // a handler stopped alone: its channel closes now
			return
		}
		h.closeDown()
	}()
	return out
}
