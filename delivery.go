package sqlbroker

import (
	"context"
	"encoding/json"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// deliveryState is where a claimed message is in its life.
type deliveryState uint8

const (
	stateQueued    deliveryState = iota // claimed, waiting in the hand-out queue for a handler slot
	stateHandedOut                      // in a handler
	stateSettling                       // acked or nacked, queued for the settler or in its statement
	stateDone                           // out of the work set: settled, given back or given up
	stateLost                           // its claim is gone (lease ran out, lock lost): it stays in work until its handler lets go
)

// holding is what a delivery holds of its work set's bounds.
type holding uint8

const (
	holdsToken holding = 1 << iota // a place among the claims held (MaxInFlight plus those held ahead)
	holdsSlot                      // a handler slot (MaxInFlight)
	holdsEarly                     // a place among the acks settling without a held token (MaxInFlight)
)

// delivery is one claimed message.
type delivery struct {
	offset   int64
	token    int64
	attempts int // the claim's attempt count when it was delivered
	msg      *message.Message
	cancel   context.CancelCauseFunc
	gen      uint64 // advisory mode: generation of the lock connection that took its lock
	key      string // its order key (MetadataOrderKey) as delivered, which the handler may change
	after    int64  // where its ack looks for its key's next parked message (offsets.Claimed.After)
	sub      *subscription

	mu        sync.Mutex
	deadline  time.Time // local lease deadline
	state     deliveryState
	holds     holding // changed by its work set only
	ackedInTx bool    // acked in the caller's transaction (AckInTx)
}

// isLost reports whether d's claim is gone.
func (d *delivery) isLost() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.state == stateLost
}

// workSet is a subscription's claimed messages not yet settled or given up, and the owner of
// the two bounds on them: handler slots (MaxInFlight) and held tokens (one a claim held: in a
// handler, queued for one, or settling). Only its methods take and give back either.
type workSet struct {
	mu       sync.Mutex
	byOffset map[int64]*delivery

	slots    chan struct{} // one token a message in a handler (MaxInFlight)
	held     chan struct{} // one token a claim held: in a handler, queued for one, or settling
	early    chan struct{} // one token an ack settling that gave its held token back (MaxInFlight)
	prefetch int           // claims held beyond MaxInFlight, ready for the next free slot
	msgCtx   context.Context

	// Waits on the set as a whole, so that no delivery carries a channel of its own: lost
	// fires when a delivery is lost (the hand-out's wait for a handler ends on it), left when
	// deliveries leave the set (Shutdown's wait for settlements ends on it).
	lost, left broadcast
}

// broadcast wakes whoever waits for an event that many may wait for and that happens often:
// its channel is made only when someone waits, and closed at the next event.
type broadcast struct {
	mu sync.Mutex
	ch chan struct{}
}

// wait returns a channel closed at the next fire. Take it before checking the condition it
// waits for, so that an event between the check and the wait is not missed.
func (b *broadcast) wait() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ch == nil {
		b.ch = make(chan struct{})
	}
	return b.ch
}

func (b *broadcast) fire() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.ch != nil {
		close(b.ch)
		b.ch = nil
	}
}

func newWorkSet(cfg *SubscriberConfig, msgCtx context.Context) *workSet {
	prefetch := prefetchFor(cfg)
	return &workSet{
		byOffset: map[int64]*delivery{},
		slots:    make(chan struct{}, cfg.MaxInFlight),
		held:     make(chan struct{}, cfg.MaxInFlight+prefetch),
		early:    make(chan struct{}, cfg.MaxInFlight),
		prefetch: prefetch,
		msgCtx:   msgCtx,
	}
}

// prefetchFor is how many claims a subscription holds beyond MaxInFlight, so that a handler
// slot that frees is filled from memory while the next claim runs, and claims can be large
// (the consumers of a group take turns on its row: with small claims, four subscribers of
// one group were bound by those turns). In the advisory mode each of them holds a lock (A6).
// None with MaxInFlight 1, where order must hold across nacks (M3): a message claimed ahead
// would overtake one nacked before it.
func prefetchFor(c *SubscriberConfig) int {
	if c.MaxInFlight == 1 {
		return 0
	}
	return min(c.MaxInFlight, c.BatchSize)
}

// takeToken takes a held token for a claim to come, waiting until one is free or ctx ends.
func (w *workSet) takeToken(ctx context.Context) bool {
	select {
	case w.held <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

// tryToken takes a held token if one is free now.
func (w *workSet) tryToken() bool {
	select {
	case w.held <- struct{}{}:
		return true
	default:
		return false
	}
}

// returnTokens gives back n tokens taken for claims that did not come.
func (w *workSet) returnTokens(n int) {
	for range n {
		<-w.held
	}
}

// add puts claimed deliveries in the set, each with one of the tokens taken for its claim.
func (w *workSet) add(ds []*delivery) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range ds {
		d.holds = holdsToken
		w.byOffset[d.offset] = d
	}
}

// adopt puts ds in the set, each with the held token of one of donors (deliveries settled,
// whose tokens pass on instead of going back), and returns how many it put: those of ds
// first, one per donor that still held a token.
func (w *workSet) adopt(ds, donors []*delivery) int {
	n := 0
	for _, from := range donors {
		if n == len(ds) {
			break
		}
		if w.drop(from, holdsToken) {
			n++
		}
	}
	w.add(ds[:n])
	return n
}

// takeSlot waits for a handler slot for d, or for ctx to end; with the slot, d is handed out.
func (w *workSet) takeSlot(ctx context.Context, d *delivery) bool {
	select {
	case w.slots <- struct{}{}:
	case <-ctx.Done():
		return false
	}
	d.mu.Lock()
	d.holds |= holdsSlot
	if d.state == stateQueued {
		d.state = stateHandedOut
	}
	d.mu.Unlock()
	return true
}

// settling marks d as acked or nacked and on its way to the settler (a lost delivery stays
// lost: its settlement is refused or finds its claim gone).
func (w *workSet) settling(d *delivery) {
	d.mu.Lock()
	if d.state != stateLost {
		d.state = stateSettling
	}
	d.mu.Unlock()
}

// lose marks d's claim as gone and reports whether it was not already; a delivery out of the
// set is not lost.
func (w *workSet) lose(d *delivery) bool {
	d.mu.Lock()
	if d.state == stateLost || d.state == stateDone {
		d.mu.Unlock()
		return false
	}
	d.state = stateLost
	d.mu.Unlock()
	w.lost.fire()
	return true
}

// expire marks d lost when expires (the claim mode bounds a claim by its local deadline) and
// its deadline has passed; it reports whether d is lost, and its deadline.
func (w *workSet) expire(d *delivery, expires bool) (lost bool, deadline time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if expires && d.state != stateLost && d.state != stateDone && !time.Now().Before(d.deadline) {
		d.state = stateLost
	}
	return d.state == stateLost, d.deadline
}

// freeSlot gives back d's handler slot, if it holds one.
func (w *workSet) freeSlot(d *delivery) {
	if w.drop(d, holdsSlot) {
		<-w.slots
	}
}

// freeToken gives back d's held token, once.
func (w *workSet) freeToken(d *delivery) {
	if w.drop(d, holdsToken) {
		<-w.held
	}
}

// freeTokenEarly gives back d's held token before its settlement has been applied, in
// exchange for a token of its own kind (at most MaxInFlight), if one is free; d keeps that one
// until it leaves the set. The claims held stay bounded as ever, and the deliveries settling
// without a held token by MaxInFlight.
func (w *workSet) freeTokenEarly(d *delivery) {
	select {
	case w.early <- struct{}{}:
	default:
		return
	}
	d.mu.Lock()
	had := d.holds&holdsToken != 0
	if had {
		d.holds = d.holds&^holdsToken | holdsEarly
	}
	d.mu.Unlock()
	if had {
		<-w.held
	} else {
		<-w.early
	}
}

func (w *workSet) drop(d *delivery, h holding) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	had := d.holds&h != 0
	d.holds &^= h
	return had
}

// remove takes d out of the set, ends its context with cause and gives back what it holds.
func (w *workSet) remove(d *delivery, cause error) {
	w.removeAll([]*delivery{d}, cause)
}

func (w *workSet) removeAll(ds []*delivery, cause error) {
	w.mu.Lock()
	for _, d := range ds {
		if w.byOffset[d.offset] == d {
			delete(w.byOffset, d.offset)
		}
		d.cancel(cause)
	}
	w.mu.Unlock()
	for _, d := range ds {
		w.freeSlot(d)
		w.freeToken(d)
		if w.drop(d, holdsEarly) {
			<-w.early
		}
		d.mu.Lock()
		if d.state != stateLost {
			d.state = stateDone // a lost one stays lost: AckInTx tells its handler so
		}
		d.mu.Unlock()
	}
	w.left.fire()
}

// all returns the deliveries in the set.
func (w *workSet) all() []*delivery {
	w.mu.Lock()
	defer w.mu.Unlock()
	ds := make([]*delivery, 0, len(w.byOffset))
	for _, d := range w.byOffset {
		ds = append(ds, d)
	}
	return ds
}

// lookup returns the deliveries in the set of the offsets offs.
func (w *workSet) lookup(offs []int64) []*delivery {
	w.mu.Lock()
	defer w.mu.Unlock()
	ds := make([]*delivery, 0, len(offs))
	for _, o := range offs {
		if d := w.byOffset[o]; d != nil {
			ds = append(ds, d)
		}
	}
	return ds
}

// offsets returns the offsets in the set.
func (w *workSet) offsets() []int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	offs := make([]int64, 0, len(w.byOffset))
	for o := range w.byOffset {
		offs = append(offs, o)
	}
	return offs
}

func (w *workSet) len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.byOffset)
}

// settledByHandler returns a delivery in the set whose handler acked or nacked it, or nil.
func (w *workSet) settledByHandler() *delivery {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range w.byOffset {
		select {
		case <-d.msg.Acked():
			return d
		case <-d.msg.Nacked():
			return d
		default:
		}
	}
	return nil
}

// cancelAll ends the contexts of the deliveries in the set with cause, and counts them.
func (w *workSet) cancelAll(cause error) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, d := range w.byOffset {
		d.cancel(cause)
	}
	return len(w.byOffset)
}

// notLost counts the deliveries in the set whose claim is not known to be gone.
func (w *workSet) notLost() int {
	n := 0
	for _, d := range w.all() {
		if !d.isLost() {
			n++
		}
	}
	return n
}

// newDelivery builds the delivery of a claimed message, queued for a handler.
func (sub *subscription) newDelivery(c offsets.Claimed, token int64, deadline time.Time) *delivery {
	msg := message.NewMessage(c.UUID, c.Payload)
	if c.Metadata != "" && c.Metadata != "{}" {
		md := map[string]string{}
		if err := json.Unmarshal([]byte(c.Metadata), &md); err != nil {
			sub.logger.Error("Message metadata is not a JSON object of strings; delivering without it", err, sub.fields(c.Offset))
		}
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
	}
	msg.Metadata.Set(MetadataAttempt, strconv.Itoa(c.Attempts))
	msg.Metadata.Set(MetadataOffset, strconv.FormatInt(c.Offset, 10))
	ctx, cancel := context.WithCancelCause(sub.work.msgCtx)
	d := &delivery{offset: c.Offset, token: token, attempts: c.Attempts, msg: msg, cancel: cancel,
		after: c.After, deadline: deadline, sub: sub, state: stateQueued, key: msg.Metadata.Get(MetadataOrderKey)}
	msg.SetContext(context.WithValue(ctx, deliveryKey{}, d))
	return d
}

// forget drops a delivery from the work set, frees what it holds and ends its context.
func (sub *subscription) forget(d *delivery) { sub.work.remove(d, context.Canceled) }

func (sub *subscription) inFlight() int { return sub.work.len() }

func (sub *subscription) fields(offset int64) watermill.LogFields {
	return watermill.LogFields{"offset": offset}
}
