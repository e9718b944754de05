package sqlbroker

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// settler applies a subscription's acks and nacks: one goroutine (run) reading one queue,
// fenced by each delivery's token, in batches. Whatever queued up while the previous
// statement ran goes into the next one, so under load one round trip settles many messages
// and at rest a settlement waits for nothing. The claim mode decides what happens around the
// statement (claimMode: admit, unlock, failed, giveUp); a refused settlement is counted as
// stale here, for both modes.
type settler struct {
	sub   *subscription
	dlq   *offsets.Store  // the dead-letter topic's, with MaxAttempts only (deadletter.go)
	queue chan settlement // acks and nacks waiting for the loop

	// producers are the goroutines that may still queue: the awaits of deliveries handed out.
	// The queue closes once the claim loop has ended and they are all done.
	producers sync.WaitGroup
	// quit is closed (advisory mode, by Shutdown) once no settlement can be queued any more:
	// the loop applies what is there and ends.
	quit     chan struct{}
	quitOnce sync.Once
	// drained is closed when the loop has applied or given up its last settlement and ended.
	drained chan struct{}

	notApplied atomic.Int64 // settlements given up on because the subscriber shut down
}

// settleOp is what a handler made of its message: opAck or opNack (its text is what
// StaleSettlementError.Op and the logs say).
type settleOp string

const (
	opAck  settleOp = "ack"
	opNack settleOp = "nack"
)

// settlement is an ack or nack waiting to be applied.
type settlement struct {
	d  *delivery
	op settleOp
}

func newSettler(sub *subscription, dlq *offsets.Store) *settler {
	return &settler{
		sub:     sub,
		dlq:     dlq,
		queue:   make(chan settlement, sub.cfg.MaxInFlight),
		quit:    make(chan struct{}),
		drained: make(chan struct{}),
	}
}

// enqueue queues the settlement op of d; d is already marked as settling.
func (st *settler) enqueue(d *delivery, op settleOp) {
	st.queue <- settlement{d: d, op: op}
}

// stopQueue tells the loop that nothing is queued any more.
func (st *settler) stopQueue() { st.quitOnce.Do(func() { close(st.quit) }) }

// closeQueue closes the queue once the hand-out loop (ended) has ended and no producer is left
// to queue a settlement. When quit comes first (advisory mode, Shutdown), the loop ends on it
// and the producers end on it too: this ends once they have.
func (st *settler) closeQueue(ended <-chan struct{}) {
	<-ended
	awaited := make(chan struct{})
	go func() {
		st.producers.Wait()
		close(awaited)
	}()
	select {
	case <-awaited:
		close(st.queue)
	case <-st.quit:
		<-awaited
	}
}

// maxSettleBatch bounds the settlements applied in one statement.
const maxSettleBatch = 1000

// run is the settler's loop. A database error (a statement blocked longer than CleanupTimeout
// is cancelled on the server) is retried while the claim mode allows (a lease that still
// holds, a lock still held), until Shutdown stops the tracker: what is left is then given up
// (giveUp).
func (st *settler) run() {
	defer close(st.drained)
	var pending []settlement
	inProcess := st.sub.store.T.Dialect().InProcess
	for {
		if len(pending) == 0 {
			select {
			case x, ok := <-st.queue:
				if !ok {
					return
				}
				pending = append(pending, x)
			case <-st.quit:
				// Nothing is queued any more: apply what is there, then end.
				for len(pending) < maxSettleBatch {
					select {
					case x, ok := <-st.queue:
						if ok {
							pending = append(pending, x)
							continue
						}
					default:
					}
					break
				}
				if len(pending) == 0 {
					return
				}
			}
		}
		if inProcess {
			// SQLite runs its statements on the process's CPU, and every settlement statement is
			// a write transaction of its own: under load the handlers that finish meanwhile are
			// waiting for the CPU this loop holds. Letting them run first puts their acks in this
			// statement rather than one each. With nothing else to run the yield returns at
			// once, so a settlement at rest still waits for nothing.
			runtime.Gosched()
		}
		pending = st.settle(pending)
		if len(pending) > 0 {
			select {
			case <-time.After(st.sub.cfg.RetryInterval):
			case <-st.sub.s.tracker.Stopping():
			}
		}
	}
}

// settle takes what else is queued into pending, up to maxSettleBatch, applies the acks then
// the nacks, and returns those to try again.
func (st *settler) settle(pending []settlement) []settlement {
drain:
	for len(pending) < maxSettleBatch {
		select {
		case x, ok := <-st.queue:
			if !ok {
				break drain
			}
			pending = append(pending, x)
		default:
			break drain
		}
	}
	var failed []settlement
	for _, op := range [...]settleOp{opAck, opNack} {
		failed = append(failed, st.apply(op, pending)...)
	}
	if len(failed) > 0 && st.sub.stopping() {
		st.giveUp(failed)
		return nil
	}
	return failed
}

// giveUp drops settlements that Shutdown left no time to apply, and counts them; the claim
// mode says what becomes of their messages.
func (st *settler) giveUp(sts []settlement) {
	st.notApplied.Add(int64(len(sts)))
	st.sub.mode.giveUp(sts)
}

// drain waits until no delivery in work has been acked or nacked by its handler without its
// settlement being done: each such delivery leaves the work set once it is.
func (st *settler) drain(ctx context.Context) error {
	for {
		left := st.sub.work.left.wait()
		if st.sub.work.settledByHandler() == nil {
			return nil
		}
		select {
		case <-left:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// nackWaits returns how long the message of each settlement waits after its nack: until the
// time its handler delayed it to (middleware.DelayOnError sets it in the metadata), or else the
// backoff of its attempt (SubscriberConfig.nackBackoff), drawn once per attempt and call, so
// that the nacks of one attempt share a statement.
func (st *settler) nackWaits(sts []settlement) []time.Duration {
	waits := make([]time.Duration, len(sts))
	byAttempt := map[int]time.Duration{}
	now := time.Now()
	for i, x := range sts {
		if st.overAttempts(x.d) {
			waits[i] = deadLetterWait
			continue
		}
		if until, later, err := delayedUntil(x.d.msg.Metadata, now); err == nil && later {
			waits[i] = until.Sub(now).Round(time.Millisecond)
			continue
		}
		w, ok := byAttempt[x.d.attempts]
		if !ok {
			w = st.sub.cfg.nackBackoff(x.d.attempts)
			byAttempt[x.d.attempts] = w
		}
		waits[i] = w
	}
	return waits
}

// apply runs the settlements of kind op among sts and returns those that failed with a
// database error and may be retried. Acks made in the caller's transaction need no statement;
// the claim mode may refuse others first (admit). Those that the statements applied before an
// error are settled: counted as applied and not run again (a second run would find their
// claims gone and count them stale).
func (st *settler) apply(op settleOp, sts []settlement) []settlement {
	sub, mode := st.sub, st.sub.mode
	sts, inTx := st.ackedInTx(op, sts)
	if len(inTx) > 0 {
		mode.unlock(inTx) // the caller's commit deleted the claims
		st.settledInTx(inTx)
		mode.settled(len(inTx))
	}
	var these []settlement
	var fs []offsets.Fenced
	for _, x := range sts {
		if x.op != op || !mode.admit(x) {
			continue
		}
		these = append(these, x)
		fs = append(fs, offsets.Fenced{Offset: x.d.offset, Token: x.d.token, After: x.d.after})
	}
	if len(fs) == 0 {
		return nil
	}
	var done map[int64]bool
	var err error
	var handed []*delivery
	if op == opAck && sub.cfg.OrderByKey && sub.ctx.Err() == nil {
		done, handed, err = st.ackHandingOver(fs)
	} else {
		done, err = st.statement(op, fs, st.nackWaits(these))
	}
	if err != nil {
		st.giveBackHanded(handed)
		return mode.failed(op, these, done, err)
	}
	handedKeys := st.handOver(these, done, handed)
	lostBefore := make([]bool, len(these)) // read before the unlock, which may lose the connection
	for i, x := range these {
		lostBefore[i] = x.d.isLost()
	}
	mode.unlock(these)
	// Counted once the statement has run; in advisory mode the lock's drop is queued by then
	// (see advisoryMode.unlock).
	for i, x := range these {
		st.count(x, done[x.d.offset], lostBefore[i], handedKeys)
		sub.forget(x.d)
		mode.settled(1)
	}
	return nil
}

// count counts a settlement whose statement ran: applied, acked by the caller's committed
// transaction, or refused as stale (its row no longer carries the delivery's token).
func (st *settler) count(x settlement, applied, lostBefore bool, handedKeys map[string]bool) {
	if st.sub.cfg.OrderByKey && (applied && x.op == opAck || x.d.wasAckedInTx()) {
		if x.d.key != "" && !handedKeys[x.d.key] {
			// The next message of its key, parked, may go now and was not handed over: the
			// next claim looks.
			st.sub.claimer.markDue(time.Now())
		}
	}
	switch {
	case applied:
		st.countApplied(x.op)
	case x.d.wasAckedInTx():
		st.sub.s.stats.acked.Add(1) // the caller's transaction acked it and committed
	default:
		st.stale(x.d, x.op, "Settlement refused", false, watermill.LogFields{st.sub.mode.lostField(): lostBefore})
	}
}

// countApplied counts an applied settlement of kind op.
func (st *settler) countApplied(op settleOp) {
	if op == opAck {
		st.sub.s.stats.acked.Add(1)
	} else {
		st.sub.s.stats.nacked.Add(1)
	}
}

// stale counts and logs a settlement refused because its claim was no longer the delivery's:
// its lease ran out, its lock went, or (closed) Shutdown released it. It is logged at Info: it
// means only that the claim was lost, and the message is or will be delivered again;
// Stats().StaleSettlements counts them. The error, a StaleSettlementError (wrapped with
// ErrClosed when closed), is in the field "err".
func (st *settler) stale(d *delivery, op settleOp, msg string, closed bool, fields watermill.LogFields) {
	sub := st.sub
	sub.s.stats.stale.Add(1)
	var err error = &StaleSettlementError{Topic: sub.store.T.Topic, ConsumerGroup: sub.cfg.ConsumerGroup, Offset: d.offset, Op: string(op)}
	if closed {
		err = fmt.Errorf("%w: %w", ErrClosed, err)
	}
	f := watermill.LogFields{"err": err}
	for k, v := range fields {
		f[k] = v
	}
	sub.logger.Info(msg, f)
}

// statement applies acks or nacks (op) of the fenced claims in one statement, through the
// tracker (cancelled on the server after CleanupTimeout, or when Shutdown stops it), and
// returns the offsets it settled. waits holds, for nacks, how long each claim of fs waits
// before it comes due again (nackWaits).
func (st *settler) statement(op settleOp, fs []offsets.Fenced, waits []time.Duration) (map[int64]bool, error) {
	if op != opAck {
		return st.nackStatements(fs, waits)
	}
	sub := st.sub
	var done map[int64]bool
	err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtAck, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		var err error
		done, err = sub.store.Ack(ctx, q, sub.groupID, fs)
		return err
	})
	return done, err
}

// ackHandingOver applies acks of a group ordered by key in one statement that also claims,
// under a token of its own, the next message of each key it settles (offsets.Store's
// AckHandingOver), and returns those as deliveries not yet in the work set. Their local
// deadline counts from when the statement had its connection, before the database wrote
// their lease. On an error, what it handed over before the error is returned too.
func (st *settler) ackHandingOver(fs []offsets.Fenced) (map[int64]bool, []*delivery, error) {
	sub := st.sub
	token := newToken()
	var done map[int64]bool
	var claimed []offsets.Claimed
	var sent time.Time
	err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtAck, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		sent = time.Now()
		var err error
		done, claimed, err = sub.store.AckHandingOver(ctx, q, sub.groupID, fs, token, sub.cfg.LeaseTTL, nil)
		return err
	})
	if len(claimed) == 0 {
		return done, nil, err
	}
	sub.s.stats.claimed.Add(int64(len(claimed)))
	deadline := sent.Add(sub.cfg.LeaseTTL)
	ds := make([]*delivery, len(claimed))
	for i, c := range claimed {
		ds[i] = sub.newDelivery(c, token, deadline)
	}
	return done, ds, err
}

// handOver puts the deliveries that acks of these were handed over (ackHandingOver) in the
// work set, each with the held token of an applied ack (which kept it for this: leaseMode's
// await), and queues them for the hand-out loop; those it cannot are given back. It returns
// the order keys of those queued: their acks need no claim to free their key.
func (st *settler) handOver(these []settlement, done map[int64]bool, handed []*delivery) map[string]bool {
	if len(handed) == 0 {
		return nil
	}
	sub := st.sub
	var donors []*delivery
	for _, x := range these {
		if done[x.d.offset] {
			donors = append(donors, x.d)
		}
	}
	n := sub.work.adopt(handed, donors)
	st.giveBackHanded(handed[n:]) // none: each key handed over had an applied ack of its own
	handed = handed[:n]
	if len(handed) == 0 {
		return nil
	}
	if !sub.handout.offer(handed) {
		sub.handout.giveBack(handed) // the subscription stops
		return nil
	}
	sub.s.stats.handedOver.Add(int64(len(handed)))
	keys := make(map[string]bool, len(handed))
	for _, d := range handed {
		keys[d.key] = true
	}
	return keys
}

// giveBackHanded gives back messages handed over (ackHandingOver) that are not in the work
// set and that no handler will get: the statement failed after handing them over. They are
// released at once, each first of its key, for the group's next claim.
func (st *settler) giveBackHanded(ds []*delivery) {
	if len(ds) == 0 {
		return
	}
	sub := st.sub
	sub.work.removeAll(ds, context.Canceled) // ends their contexts
	sub.releaseRows(fenced(ds), "Releasing messages handed over by a failed ack failed; they return when their lease runs out")
	sub.claimer.markDue(time.Now())
}

// nackStatements applies nacks of the fenced claims fs, each to come due after its wait in
// waits (see nackWaits), one statement per distinct wait, and tells the claim loop when each
// comes due again (markDue).
func (st *settler) nackStatements(fs []offsets.Fenced, waits []time.Duration) (map[int64]bool, error) {
	sub := st.sub
	byWait := map[time.Duration][]offsets.Fenced{}
	var order []time.Duration
	for i, f := range fs {
		if _, ok := byWait[waits[i]]; !ok {
			order = append(order, waits[i])
		}
		byWait[waits[i]] = append(byWait[waits[i]], f)
	}
	done := make(map[int64]bool, len(fs))
	for _, w := range order {
		var these map[int64]bool
		if w == deadLetterWait {
			these, err := st.deadLetter(byWait[w])
			if err != nil {
				return done, err
			}
			for o := range these {
				done[o] = true
			}
			continue
		}
		err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtNack, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
			var err error
			these, err = sub.store.Nack(ctx, q, sub.groupID, byWait[w], w)
			return err
		})
		for o := range these {
			done[o] = true // applied, even when a later statement of the call failed
		}
		if err != nil {
			return done, err
		}
		if len(these) > 0 {
			sub.claimer.markDue(time.Now().Add(w))
		}
	}
	return done, nil
}

// outcome waits for the handler's ack ("ack") or nack ("nack") of d, or for stop ("").
func outcome[T any](d *delivery, stop <-chan T) settleOp {
	select {
	case <-d.msg.Acked():
		return opAck
	case <-d.msg.Nacked():
		return opNack
	case <-stop:
		return ""
	}
}
