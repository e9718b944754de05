package sqlbroker

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// leaseMode is the lease claim mode (ClaimLease): a claim is held by its lease (visible_at and
// the token on its claim row), which the extender (run) keeps moving while the message is in
// work. A claim released is made visible again, fenced by its token.
type leaseMode struct {
	sub *subscription
	// stop is closed by Shutdown (step 4): lease extension stops, and so does the wait for
	// the settlements of deliveries in work.
	stop     chan struct{}
	stopOnce sync.Once
}

func newLeaseMode(sub *subscription) *leaseMode {
	return &leaseMode{sub: sub, stop: make(chan struct{})}
}

var closedChan = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

func (l *leaseMode) idle() <-chan struct{}  { return closedChan }
func (l *leaseMode) expires() bool          { return true }
func (l *leaseMode) woken()                 {}
func (l *leaseMode) holdsLocks() bool       { return false }
func (l *leaseMode) locksHeld() int         { return 0 }
func (l *leaseMode) registered([]*delivery) {}
func (l *leaseMode) beginSettle() bool      { return true }
func (l *leaseMode) admit(settlement) bool  { return true }
func (l *leaseMode) unlock([]settlement)    {}
func (l *leaseMode) settled(int)            {}
func (l *leaseMode) lostField() string      { return "lease_lost_before" }
func (l *leaseMode) stopWatching()          { l.stopOnce.Do(func() { close(l.stop) }) }
func (l *leaseMode) abandon()               {}
func (l *leaseMode) shutdown(context.Context) (int, int, error) {
	return 0, 0, nil // the leases of deliveries in work are left to run out (step 5)
}

// leasesLeft is the number of deliveries whose leases Shutdown left to run out: those still in
// work with their lease, and those whose settlement it gave up.
func (l *leaseMode) leasesLeft() int {
	return int(l.sub.settler.notApplied.Load()) + l.sub.work.notLost()
}

// claim takes up to n messages in one short statement: no transaction is left open.
//
// The statement runs through the subscriber's tracker, never under the subscription's context
// directly: a context cancelled in the middle of a query makes the driver return at once while
// the server may still be running it (pgx then closes the socket in the background), so the
// caller's error is not the server's word. When the subscription stops during a claim (or
// while it waits for a connection of an exhausted pool), the server is asked to cancel that
// very statement, and the claim returns only once the server has ended it and rolled it back
// (S3, S11).
func (l *leaseMode) claim(buf []offsets.Claimed, n int, due offsets.Due) ([]offsets.Claimed, int64, time.Time, error) {
	sub := l.sub
	token := newToken()
	if sub.ctx.Err() != nil {
		return nil, 0, time.Time{}, sub.ctx.Err()
	}
	// The local deadline of the claims counts from sent: a time before the database wrote
	// their leases, so that it never outlives them. It is taken once the claim has its
	// connection, and for an ordered claim it is the time the store gives, which comes after
	// the wait for the group's lock: a wait for either (a pool whose connections are being
	// dialled, another consumer's claim) would otherwise be taken off the lease, and at the
	// start of a busy process leave too little of it for the first extensions.
	sent := time.Now()
	var pid uint32
	claimed := buf
	err := sub.s.tracker.RunConn(sub.ctx, stmtClaim, claimTimeout, func(ctx context.Context, conn dbx.Conn) error {
		sent = time.Now()
		// Known without a round trip on pgx, and asked once per connection on database/sql;
		// 0 if it cannot be had. dropUnsure needs it after the connection is gone.
		pid, _ = conn.PID(ctx)
		var err error
		if sub.cfg.OrderByKey {
			// Ordered claims always look at what is due: a parked message's key frees when
			// another message of its key is settled, by any consumer.
			var leased time.Time
			floor := sub.claimer.parkFloor
			claimed, leased, err = sub.store.ClaimOrderedFrom(ctx, conn, sub.groupID, token, sub.cfg.LeaseTTL, n, sub.claimer.passRoom, &floor, buf)
			if err == nil {
				sub.claimer.parkFloor = floor // a failed claim leaves it as it was
			}
			if leased.After(sent) {
				sent = leased
			}
			return err
		}
		claimed, err = sub.store.ClaimPassing(ctx, conn, sub.groupID, token, sub.cfg.LeaseTTL, n, sub.claimer.passRoom, due, buf)
		return err
	})
	claimed = sub.passDelayed(claimed, err)
	if err != nil && len(claimed) > 0 {
		if dbx.SQLState(err) != dbx.CodeQueryCanceled {
			sub.dropUnsure(claimed, token, pid)
		} // else the server ended the statement and rolled it back: its claims never were
		claimed = claimed[:0]
	}
	if err == nil && len(claimed) > 0 && time.Since(sent) >= sub.cfg.LeaseTTL/2 {
		claimed, sent = l.confirm(claimed, token, sent)
	}
	return claimed, token, sent, err
}

// newToken makes the token of a claim: positive (the rows no one holds have negative ones)
// and random, so that the claims of every consumer of a group have distinct tokens.
func newToken() int64 { return rand.Int64N(1<<62) + 1 }

// confirm extends at once the claims of a claim statement that took half a lease or more to
// return: it waited on a lock (a migration's LOCK TABLE), on a slow server, or the process was
// frozen. The database counts their lease from when it wrote them, which may be long after
// the statement was sent; counted from then, the local deadline would leave too little time to
// hand them out, or be past, and they would be dropped while the database still holds them
// for this claim. The extension, fenced by the claim's token, asks the database: the claims it
// extends are held for a lease counted from when it was sent; the ones it does not are
// another consumer's already and are dropped here. If the extension fails, the claims keep
// the deadline counted from the claim's sending, and the hand-out drops those whose deadline
// passed.
func (l *leaseMode) confirm(cs []offsets.Claimed, token int64, sent time.Time) ([]offsets.Claimed, time.Time) {
	sub := l.sub
	done, at, err := l.extendRows(offsets.Fence(cs, token), 0)
	if err != nil {
		if !sub.stopping() {
			sub.s.stats.errors.Add(1)
			sub.logger.Error("Extending the leases of a slow claim failed", err, watermill.LogFields{"count": len(cs)})
		}
		return cs, sent
	}
	kept := cs[:0]
	for _, c := range cs {
		if done[c.Offset] {
			kept = append(kept, c)
			continue
		}
		sub.s.stats.leasesLost.Add(1)
		sub.logger.Info("Lease of a slow claim ran out before it returned; the message is another consumer's", sub.fields(c.Offset))
	}
	return kept, at
}

// extendRows extends the leases of fs and returns the offsets extended, and a time before the
// database wrote their new leases: when the statement had its connection. The statement is
// bounded by LeaseRenewInterval from the moment it has a connection; it waits for one that
// long, or up to wait if longer. A pool busy with other work (handlers sharing it, claims
// and settlements queued) hands connections out in turn: a wait given up at each renew
// interval and begun again would go to the back of the line each time, and leases could run
// out while the pool served everyone else.
func (l *leaseMode) extendRows(fs []offsets.Fenced, wait time.Duration) (map[int64]bool, time.Time, error) {
	sub := l.sub
	var done map[int64]bool
	at := time.Now()
	renew := sub.cfg.LeaseRenewInterval
	err := sub.s.tracker.RunWaiting(context.WithoutCancel(sub.ctx), stmtExtend, max(wait, renew), renew, func(ctx context.Context, q dbx.Querier) error {
		at = time.Now()
		var err error
		done, err = sub.store.Extend(ctx, q, sub.groupID, fs, sub.cfg.LeaseTTL)
		return err
	})
	return done, at, err
}

// dropUnsure gives back claims whose rows arrived before their statement failed, which none
// of them is handed out for: the connection may have been cut after the server committed
// (a restart of the server does that), or before it did, since rows go out while the
// statement still runs and its writes are made last. So it first waits, up to
// CleanupTimeout, for the statement's backend (pid) to end, which settles whether the claim
// committed; then a release fenced by the claim's token makes the rows visible again at once
// if they were claimed, and matches nothing if they were not. If the backend cannot be seen
// to end, or the release fails, the rows return when their lease runs out (L5). Handing them
// out instead would deliver messages whose claim may have been rolled back, and keeping them
// would hold their MaxInFlight places forever: with MaxInFlight 1 the subscription stopped
// claiming at a restart.
func (sub *subscription) dropUnsure(cs []offsets.Claimed, token int64, pid uint32) {
	fs := offsets.Fence(cs, token)
	if pid != 0 && !sub.backendEnded(pid) {
		sub.logger.Info("A failed claim's statement may still be running; its claims return when their lease runs out", watermill.LogFields{"count": len(fs), "backend_pid": pid})
		return
	}
	if n, ok := sub.releaseRows(fs, "Releasing the claims of a failed claim statement failed; they return when their lease runs out"); ok && n > 0 {
		sub.claimer.markDue(time.Now())
	}
}

// backendEnded waits up to CleanupTimeout for the server process pid to be gone, and says
// whether it saw it go. A failed look is tried again: after a restart the server is back
// within that time, without the process. (A new backend given the same pid meanwhile only
// makes it wait.)
func (sub *subscription) backendEnded(pid uint32) bool {
	ctx, cancel := dbx.CleanupContext(sub.ctx)
	defer cancel()
	for {
		var alive bool
		err := sub.s.tracker.Run(ctx, stmtBackend, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
			var err error
			alive, err = offsets.BackendAlive(ctx, q, pid)
			return err
		})
		if err == nil && !alive {
			return true
		}
		pause := 10 * time.Millisecond
		if err != nil {
			pause = 100 * time.Millisecond // the server may be restarting
		}
		select {
		case <-time.After(pause):
		case <-ctx.Done():
			return false
		case <-sub.s.tracker.Stopping():
			return false
		}
	}
}

// release gives back claims that never reached a handler, fenced by their tokens.
func (l *leaseMode) release(ds []*delivery) {
	sub := l.sub
	n, ok := sub.releaseRows(fenced(ds), "Releasing undelivered claims failed; they return when their lease runs out")
	if ok {
		sub.atStop.released.Add(int64(n))
		sub.logger.Debug("Released undelivered claims", watermill.LogFields{"count": n})
	}
}

// await waits for the handler's ack or nack and queues it for the settler.
func (l *leaseMode) await(d *delivery) {
	sub := l.sub
	defer sub.settler.producers.Done()
	op := outcome(d, l.stop)
	if op == "" {
		// Shutdown stopped watching (S4, S11): a settlement made by then is still applied;
		// one made later is not, and the message returns when its lease runs out.
		select {
		case <-d.msg.Acked():
			op = opAck
		case <-d.msg.Nacked():
			op = opNack
		default:
			return
		}
	}
	sub.work.settling(d)
	sub.settler.enqueue(d, op)
	// The handler is done: its slot goes back now. An ack's held token goes back too, not when
	// the settle statement has run, so that the next claim does not wait for that round trip. A
	// nack keeps its token until it is applied, so that the message it makes due again is
	// claimed before newer ones (with MaxInFlight 1, order holds across nacks). Acks waiting
	// for their statement are bounded by the queue's capacity plus one statement's batch.
	// In a group ordered by key an ack keeps its token until it is applied too: the statement
	// may hand it the next message of its key (settler.handOver).
	sub.work.freeSlot(d)
	if op == opAck && !sub.cfg.OrderByKey {
		sub.work.freeToken(d)
	}
}

// failed handles settlements whose statement failed: those it applied before the error are
// counted and done; the rest are retried while their lease holds (it keeps being extended
// meanwhile), or left to Shutdown's giveUp once it stopped the tracker.
func (l *leaseMode) failed(op settleOp, these []settlement, done map[int64]bool, err error) []settlement {
	sub := l.sub
	var rest []settlement
	for _, x := range these {
		if done[x.d.offset] {
			sub.settler.countApplied(op)
			sub.forget(x.d)
		} else {
			rest = append(rest, x)
		}
	}
	these = rest
	if len(these) == 0 {
		return nil
	}
	if sub.stopping() {
		return these // the settler gives them up
	}
	sub.s.stats.errors.Add(1)
	var retry []settlement
	for _, x := range these {
		x.d.mu.Lock()
		left := time.Until(x.d.deadline)
		x.d.mu.Unlock()
		if left > 0 {
			retry = append(retry, x)
			continue
		}
		sub.logger.Error("Settlement failed and the lease ran out; the message will be redelivered", err, sub.fields(x.d.offset))
		sub.forget(x.d)
	}
	sub.logger.Error("Settlement failed", err, watermill.LogFields{"op": op, "count": len(these), "retrying": len(retry)})
	return retry
}

// giveUp: their messages return when their leases run out.
func (l *leaseMode) giveUp(sts []settlement) {
	l.sub.logger.Info("Settlements not applied before the shutdown ended; their messages return when their leases run out", watermill.LogFields{"count": len(sts)})
	for _, x := range sts {
		l.sub.forget(x.d)
	}
}

// run is the lease extender: it extends the leases of every delivery in work, well before
// they run out (L2). A lease the database refuses to extend, or whose deadline passed
// locally, is lost: the message's context is cancelled so the handler can stop (L4). An
// extension that cannot run (blocked on a table lock, a slow server) is cancelled on the
// server once LeaseRenewInterval has passed and tried again at the next tick; when the
// lease's deadline passes meanwhile, the lease is lost. One that waits for a connection of a
// busy pool keeps waiting, as long as the first lease it extends allows.
func (l *leaseMode) run() {
	sub := l.sub
	t := time.NewTicker(sub.cfg.LeaseRenewInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-l.stop:
			return
		case <-sub.handout.ended:
			// The subscription stopped; keep extending while handlers still work.
			if sub.inFlight() == 0 {
				return
			}
			select {
			case <-t.C:
			case <-l.stop:
				return
			}
		}
		l.extendOnce()
	}
}

func (l *leaseMode) extendOnce() {
	sub := l.sub
	ds := sub.work.all()
	if len(ds) == 0 {
		return
	}
	fs := make([]offsets.Fenced, 0, len(ds))
	live := ds[:0]
	var first time.Time // the earliest local deadline of those extended
	for _, d := range ds {
		d.mu.Lock()
		ok := d.state != stateLost && !d.ackedInTx // a claim acked in a transaction is locked by it until it ends
		if ok && (first.IsZero() || d.deadline.Before(first)) {
			first = d.deadline
		}
		d.mu.Unlock()
		if ok {
			fs = append(fs, offsets.Fenced{Offset: d.offset, Token: d.token})
			live = append(live, d)
		}
	}
	// Wait for a connection until the statement could still end, within its own limit, before
	// the first deadline: the leases are no worse off than after failed tries, and the wait
	// keeps its place in the pool's line.
	done, at, err := l.extendRows(fs, time.Until(first)-sub.cfg.LeaseRenewInterval)
	if err != nil && sub.stopping() {
		return // Shutdown stopped it: the leases are left to run out
	}
	if err != nil {
		sub.s.stats.errors.Add(1)
		sub.logger.Error("Extending leases failed", err, watermill.LogFields{"count": len(fs)})
	}
	for _, d := range live {
		d.mu.Lock()
		extended := err == nil && done[d.offset]
		if extended {
			d.deadline = at.Add(sub.cfg.LeaseTTL)
		}
		// Refused while settling: the settlement deleted or moved the row. Refused once
		// AckInTx has marked it: the extension was sent before and waited on the row for the
		// caller's transaction, whose commit took the offset out; the message is settled.
		lost := !extended && !d.ackedInTx && (err == nil && d.state != stateSettling || err != nil && time.Now().After(d.deadline))
		deadline := d.deadline
		d.mu.Unlock()
		if lost && sub.work.lose(d) {
			sub.claimer.markDue(time.Now()) // its lease ran out: the row is due, and this may take it
			sub.s.stats.leasesLost.Add(1)
			// The deadline says which: a lease that ran out (an extension that could not reach
			// the database in time: a lock, a slow pool) or one refused before it did.
			fields := sub.fields(d.offset)
			fields["lease_deadline"] = deadline.Format(time.RFC3339Nano)
			if err != nil {
				fields["extension_error"] = err.Error()
			}
			sub.logger.Info("Lease lost; the message may be redelivered", fields)
			d.cancel(ErrLeaseLost)
		}
	}
}

// fenced returns the fenced claims of ds.
func fenced(ds []*delivery) []offsets.Fenced {
	fs := make([]offsets.Fenced, len(ds))
	for i, d := range ds {
		fs[i] = offsets.Fenced{Offset: d.offset, Token: d.token}
	}
	return fs
}
