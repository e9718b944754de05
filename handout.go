package sqlbroker

import (
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// handout is a subscription's hand-out loop (run): it sends the claims the claimer queued on
// out, each once a handler slot is free, and starts the wait for its settlement. When the
// subscription stops, the claims not yet handed out are given back at once and out is closed
// (M5).
type handout struct {
	sub   *subscription
	out   chan *message.Message
	ended chan struct{} // the claim loop ended, what was not handed out is given back, out is closed

	// handed holds the claims that acks of a group ordered by key were handed over (offer),
	// sent before those of the claim loop: each is the next message of a key, held already.
	// Each holds a token, so it never fills. Once the loop has ended, closed refuses more.
	handed chan *delivery
	mu     sync.Mutex
	closed bool
}

func newHandout(sub *subscription) *handout {
	return &handout{sub: sub, out: make(chan *message.Message), ended: make(chan struct{}),
		handed: make(chan *delivery, cap(sub.work.held))}
}

// offer queues claims handed over by an ack; false (nothing queued) once the loop has ended,
// when the caller gives them back.
func (h *handout) offer(ds []*delivery) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return false
	}
	for _, d := range ds {
		h.handed <- d
	}
	return true
}

// next returns the next claim to hand out: a handed-over one first, else the claim loop's;
// false once the claim loop has closed its queue.
func (h *handout) next() (*delivery, bool) {
	select {
	case d := <-h.handed:
		return d, true
	default:
	}
	select {
	case d := <-h.handed:
		return d, true
	case d, ok := <-h.sub.claimer.ready:
		return d, ok
	}
}

// closeHanded refuses further offers and gives back the handed-over claims still queued.
func (h *handout) closeHanded() {
	h.mu.Lock()
	h.closed = true
	var ds []*delivery
	for len(h.handed) > 0 {
		ds = append(ds, <-h.handed)
	}
	h.mu.Unlock()
	if len(ds) > 0 {
		h.giveBack(ds)
	}
}

func (h *handout) run() {
	sub := h.sub
	defer close(h.ended)
	defer close(h.out)
	defer h.closeHanded()
	expire := time.NewTimer(time.Hour)
	expire.Stop()
	defer expire.Stop()
	for {
		d, ok := h.next()
		if !ok {
			return
		}
		if sub.ctx.Err() != nil {
			h.giveBackQueued(d)
			return
		}
		if d.isLost() {
			h.dropLost(d)
			continue
		}
		if !sub.work.takeSlot(sub.ctx, d) {
			h.giveBackQueued(d)
			return
		}
		handed, stop := h.send(d, expire)
		switch {
		case stop:
			h.giveBackQueued(d)
			return
		case !handed:
			h.dropLost(d)
			continue
		}
		sub.settler.producers.Add(1)
		go sub.mode.await(d)
	}
}

// send offers d's message on out until a handler takes it (handed), the subscription stops
// (stop), or d is lost meanwhile (neither). In lease mode a claim whose local deadline passed
// (the process was frozen, extensions failed) may be another consumer's already: it is lost,
// not handed out, whether the deadline passed before the send or while it waited for a
// handler. The deadline is read again right before each attempt, and the wait ends when it
// passes (expire, a timer of the caller's, is armed for it) or when a delivery of the work
// set is lost otherwise (its extension refused, its lock gone with its connection), after
// which d is checked again.
func (h *handout) send(d *delivery, expire *time.Timer) (handed, stop bool) {
	sub := h.sub
	expires := sub.mode.expires()
	for {
		if sub.ctx.Err() != nil {
			return false, true
		}
		lost, deadline := sub.work.expire(d, expires)
		if lost {
			return false, false
		}
		// A handler waiting already (a busy subscription): handed out without a timer or a
		// wait on the message's context, which the checks above stand for.
		select {
		case h.out <- d.msg:
			return true, false
		default:
		}
		lostOne := sub.work.lost.wait()
		if d.isLost() { // lost after the check above, before the wait was taken
			return false, false
		}
		var expired <-chan time.Time
		if expires {
			expire.Reset(time.Until(deadline))
			expired = expire.C
		}
		select {
		case h.out <- d.msg:
			expire.Stop()
			return true, false
		case <-expired:
			// Checked again above: an extension may have moved the deadline meanwhile.
		case <-lostOne:
			// Some delivery was lost: checked again above. Nothing is handed a message
			// whose claim is known to be gone.
			expire.Stop()
		case <-sub.ctx.Done():
			expire.Stop()
			return false, true
		}
	}
}

// dropLost drops a claim that lost its lease, or its lock with the lock connection, while it
// was held ahead: no handler runs it here. Its row is due (the lease ran out) or an orphan
// (no lock holds it): the group's next claim or orphan search takes it, this subscription's
// included once the claim has left its work set.
func (h *handout) dropLost(d *delivery) {
	h.sub.logger.Debug("Claim held ahead lost before it was handed out", h.sub.fields(d.offset))
	h.sub.forget(d)
}

// giveBackQueued gives back d and every claim still queued, once the claim loop has ended.
func (h *handout) giveBackQueued(d *delivery) {
	ds := []*delivery{d}
	for d := range h.sub.claimer.ready {
		ds = append(ds, d)
	}
	h.giveBack(ds)
}

// giveBack releases claims that never reached a handler: they leave the work set, their
// contexts end with ErrClosed, and the claim mode gives them back.
func (h *handout) giveBack(ds []*delivery) {
	h.sub.work.removeAll(ds, ErrClosed)
	h.sub.mode.release(ds)
}
