package sqlbroker

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// The advisory-lock claim mode (ClaimAdvisoryLock) on top of a subscription.
//
// Each subscription keeps one lock connection (package advisory). A delivery is held by the
// session advisory lock (key1 of the topic and group, key2 = its offset) on that connection;
// its claim row has visible_at 'infinity'. Why nobody else can take a message in work:
//
//   - New messages and claims due again (nacked, released) are claimed by one statement on the
//     lock connection that also takes the locks of exactly the offsets it claims (see
//     offsets.Store.ClaimLocked). So a claim row becomes visible to others only with its lock
//     already held: no window in which it looks orphaned. A lock that cannot be taken (its
//     previous holder is still unlocking after a nack, or a key collision) leaves the claim
//     due for a later round. The statement is bounded by the server (the lock connection's
//     lock_timeout and statement_timeout), never by the subscription's cancel: a claim the
//     server ended, blocked on a table lock say, takes nothing (the locks it took before
//     failing are dropped again) and is retried, and the lock connection stays. When the
//     subscription stops, the statement of the claim round in flight is cancelled on the
//     server and awaited (counted in QueriesCancelled).
//   - A claim whose lock is free and whose row is still 'infinity' is an orphan (its consumer
//     died or lost its lock connection). Each claim round, at most once per PollInterval,
//     reads a page of the group's held claims, tries the locks of exactly those offsets, then
//     re-reads and takes over the rows whose lock it got, under a new token, in a statement
//     that starts after the locks were taken (A4), all on the lock connection: a row settled meanwhile is gone or no
//     longer 'infinity' and is dropped, its lock released. No timeout is involved (A2).
//   - Ack and nack are applied in the database (fenced by the token, as in lease mode) and then
//     the lock is released.
//   - The lock connection failing frees its locks: the deliveries it held lose their claim,
//     their contexts are cancelled with ErrLeaseLost, their settlements are refused as stale,
//     and the connection is opened again (A3).
type advisoryMode struct {
	sub     *subscription
	conn    *advisory.Conn
	key1    int32
	lookSQL string // the look of a claim round before the lock connection was ever opened

	roundGen    uint64    // lock generation of the claim round being handed out (claim loop only)
	lastRescue  time.Time // claim loop only
	rescueAfter int64     // claim loop only: where the walk for orphans goes on
	settling    sync.WaitGroup

	mu       sync.Mutex
	closed   bool          // guarded by mu: Shutdown released the locks; settlements are refused
	released chan struct{} // closed by Shutdown once the locks of deliveries in work are released

	idleCh      chan struct{} // closed when the subscription stopped and every settlement is done
	shutdownOne sync.Once
}

// openAdvisory sets up the subscription's lock connection. The first one of a pool in the
// process is opened here, and its session checked (A5): Subscribe fails behind a
// transaction-mode pooler. The others are opened by the first claim round that finds work
// (see claimRound): an idle subscription holds no connection, and its start costs the server
// no connection, no session set-up, no orphan search. On a bounded *sql.DB the room for the
// connection is taken here all the same (C4). ctx bounds the connect.
func openAdvisory(ctx context.Context, sub *subscription) (*advisoryMode, error) {
	a := &advisoryMode{
		sub:      sub,
		key1:     advisory.Key1(sub.store.T.Messages, sub.cfg.ConsumerGroup),
		released: make(chan struct{}),
		idleCh:   make(chan struct{}),
	}
	a.lookSQL, _ = offsets.IdleLookSQL([]offsets.IdleBranch{{Tables: &sub.store.T, GroupID: sub.groupID, Locks: true}}, []int64{0})
	conn, err := advisory.Open(ctx, sub.s.db, advisory.Options{
		Key1:          a.key1,
		CheckInterval: sub.cfg.LockCheckInterval,
		LockTimeout:   sub.cfg.LockWaitTimeout,
		Stop:          sub.ctx, // the claim statements in flight are cancelled on the server, and no reconnect
		OnLost:        a.lost,
		Logger:        sub.logger,
		Lazy:          true,
	})
	if err != nil {
		return nil, err
	}
	a.conn = conn
	return a, nil
}

func (a *advisoryMode) idle() <-chan struct{} { return a.idleCh }
func (a *advisoryMode) expires() bool         { return false }
func (a *advisoryMode) holdsLocks() bool      { return true }
func (a *advisoryMode) lostField() string     { return "lock_lost_before" }
func (a *advisoryMode) stopWatching()         {} // the awaits end on released (step 6)
func (a *advisoryMode) leasesLeft() int       { return 0 }
func (a *advisoryMode) abandon()              { a.conn.Close() }
func (a *advisoryMode) settled(n int)         { a.settling.Add(-n) }

// woken: the idle poll found work, and a claim may have lost its holder: look for orphans now.
func (a *advisoryMode) woken() { a.lastRescue = time.Time{} }

// run watches the lock connection (A3) until the subscription has stopped and every
// settlement is done, or Shutdown closed the connection; then it closes the connection.
func (a *advisoryMode) run() {
	go func() {
		<-a.sub.handout.ended
		a.sub.settler.producers.Wait()
		a.settling.Wait()
		close(a.idleCh)
	}()
	a.conn.Run(a.idleCh)
	select {
	case <-a.sub.s.shutdown:
		// Shutdown releases what is left and closes the connection, and counts both (S9).
		<-a.released
	default:
		// The subscription stopped by itself and nothing is held any more.
		if _, closed := a.conn.Close(); closed {
			a.sub.atStop.connsClosed.Add(1)
		}
	}
}

func (a *advisoryMode) locksHeld() int { return a.conn.Held() }

// lost is called by the lock connection with the offsets whose locks went with it.
func (a *advisoryMode) lost(offs []int64) { a.lose(a.sub.work.lookup(offs)) }

// lose marks deliveries whose locks are gone: their contexts end with ErrLeaseLost, their
// settlements will be refused (A3).
func (a *advisoryMode) lose(ds []*delivery) {
	for _, d := range ds {
		if !a.sub.work.lose(d) {
			continue
		}
		a.sub.s.stats.leasesLost.Add(1)
		a.sub.logger.Info("Advisory lock lost with its connection; the message may be redelivered", a.sub.fields(d.offset))
		d.cancel(ErrLeaseLost)
	}
}

// registered is called by handOut once the deliveries of a round are in the work set: a lock
// connection lost since the round took its locks lost them too.
func (a *advisoryMode) registered(ds []*delivery) {
	for _, d := range ds {
		d.gen = a.roundGen
	}
	if a.conn.Gen() != a.roundGen {
		a.lose(ds)
	}
}

// claim is the advisory claim round: orphans first, then claims due again and new messages.
// A round that finds the lock connection gone while it held no lock (an idle connection is
// pinged rarely) runs once more at once, on the connection opened again: nothing was lost.
// A lock has no lease: from is when the round began.
func (a *advisoryMode) claim(buf []offsets.Claimed, n int, due offsets.Due) ([]offsets.Claimed, int64, time.Time, error) {
	from := time.Now()
	held, gen := a.conn.Held(), a.conn.Gen()
	out, token, err := a.claimRound(buf, n, due)
	if err != nil && held == 0 && a.conn.Gen() != gen && a.sub.ctx.Err() == nil {
		a.sub.logger.Debug("The idle lock connection was gone; claiming again on a new one", watermill.LogFields{"err": err.Error()})
		out, token, err = a.claimRound(buf, n, due)
	}
	return out, token, from, err
}

func (a *advisoryMode) claimRound(buf []offsets.Claimed, n int, due offsets.Due) ([]offsets.Claimed, int64, error) {
	sub := a.sub
	if err := sub.ctx.Err(); err != nil {
		return buf[:0], 0, err // stopping: claim nothing only to give it back
	}
	token := rand.Int64N(1<<62) + 1
	a.roundGen = 0
	if !a.conn.Opened() {
		if work, err := a.look(); err != nil || !work {
			return buf[:0], token, err
		}
	}
	if time.Since(a.lastRescue) >= sub.cfg.PollInterval {
		a.lastRescue = time.Now()
		var err error
		buf, err = a.rescue(buf, n, token)
		if err != nil {
			return buf[:0], token, err
		}
	}
	rescued := len(buf)
	if rescued < n {
		claimed, gen, err := a.claimNew(buf, n-rescued, token, due)
		if err != nil {
			a.giveBackNow(buf[:rescued], token, a.roundGen)
			return buf[:0], token, err
		}
		if rescued > 0 && gen != a.roundGen && len(claimed) > rescued {
			// The connection was lost between the two steps: the orphans' locks are gone (their
			// rows are orphans again); give back the new claims.
			a.giveBackNow(claimed[rescued:], token, gen)
			return claimed[:0], token, nil
		}
		buf = claimed
		if rescued == 0 {
			a.roundGen = gen
		}
	}
	return buf, token, nil
}

// look reads on the pool whether a claim round would find anything: a claim due again, a
// message that may be delivered, or a claim held by a lock, whose holder may be gone (the
// shared poll's look, for this subscription alone). A claim round runs it while the lock
// connection was never opened, and opens that connection only when it says yes; it is
// cancelled on the server, and awaited, when the subscription stops, as a claim is.
func (a *advisoryMode) look() (bool, error) {
	var found []int64
	err := a.sub.s.tracker.Run(a.sub.ctx, stmtClaim, claimTimeout, func(ctx context.Context, q dbx.Querier) error {
		var err error
		found, err = dbx.ScanInt64s(q.Query(ctx, a.lookSQL))
		return err
	})
	return len(found) > 0, err
}

// rescuePage is how many claims held by a lock one claim round looks at for orphans.
const rescuePage = 256

// rescue takes over up to n orphaned claims (A2): it walks the group's claims held by a lock,
// a page a round, tries the locks of exactly those offsets, and adopts the rows whose lock it
// got and that still read as held once the lock is ours (A4).
func (a *advisoryMode) rescue(buf []offsets.Claimed, n int, token int64) ([]offsets.Claimed, error) {
	sub := a.sub
	skip := sub.work.offsets()
	var cands []int64
	err := a.conn.Query(sub.ctx, func(ctx context.Context, q dbx.Querier) error {
		var err error
		cands, err = sub.store.HeldAfter(ctx, q, sub.groupID, a.rescueAfter, skip, rescuePage)
		return err
	})
	if err != nil {
		return buf, a.claimError(err)
	}
	if len(cands) < rescuePage {
		a.rescueAfter = 0 // the end: start over next time
	} else {
		a.rescueAfter = cands[len(cands)-1]
	}
	if len(cands) == 0 {
		return buf, nil
	}
	locked, gen, err := a.conn.TryLock(sub.ctx, cands)
	if err != nil || len(locked) == 0 {
		return buf, a.claimError(err)
	}
	if len(locked) > n {
		a.unlockGen(locked[n:], gen) // no room for them this round
		locked = locked[:n]
	}
	// A takeover cancelled as the subscription stops changes no row: the locks go back.
	var got []offsets.Claimed
	err = a.conn.Query(sub.ctx, func(ctx context.Context, q dbx.Querier) error {
		var err error
		got, err = sub.store.Adopt(ctx, q, sub.groupID, token, locked, buf)
		return err
	})
	if err != nil {
		a.unlockGen(locked, gen)
		return buf[:0], a.claimError(err)
	}
	if len(got) < len(locked) {
		kept := make(map[int64]bool, len(got))
		for _, c := range got {
			kept[c.Offset] = true
		}
		var drop []int64
		for _, o := range locked {
			if !kept[o] {
				drop = append(drop, o)
			}
		}
		a.unlockGen(drop, gen) // settled meanwhile (A4)
	}
	if len(got) > 0 {
		a.roundGen = gen
		sub.logger.Debug("Took over claims whose consumer is gone", watermill.LogFields{"count": len(got)})
	}
	return got, nil
}

// claimNew claims due and new messages on the lock connection, taking their locks in the
// statement that claims them.
func (a *advisoryMode) claimNew(buf []offsets.Claimed, n int, token int64, due offsets.Due) ([]offsets.Claimed, uint64, error) {
	sub := a.sub
	start := len(buf)
	out := buf
	gen, err := a.conn.Claim(sub.ctx, func(ctx context.Context, q dbx.Querier, held, unlock []int64) ([]int64, []int64, error) {
		var refused []int64
		var err error
		out, refused, err = sub.store.ClaimLockedPassing(ctx, q, sub.groupID, token, n, sub.claimer.passRoom, a.key1, held, unlock, due, buf)
		if err != nil {
			return nil, nil, err
		}
		out = append(out[:start], sub.passDelayed(out[start:], nil)...)
		locked := make([]int64, 0, len(out)-start)
		for _, c := range out[start:] {
			locked = append(locked, c.Offset)
		}
		return locked, refused, nil
	})
	if err != nil {
		return buf, 0, a.claimError(err)
	}
	return out, gen, nil
}

// claimError counts a statement of the claim round that the server cancelled as the
// subscription stopped (Shutdown reports it), and says what a lock wait that ran out means.
func (a *advisoryMode) claimError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, advisory.ErrCancelled):
		a.sub.atStop.lockClaimsCancelled.Add(1)
	case dbx.SQLState(err) == dbx.CodeLockNotAvailable:
		return fmt.Errorf("the claim waited longer than LockWaitTimeout (%s) for a lock another session holds on the topic's tables (a migration's table lock?); "+
			"it took nothing, and the deliveries in work keep their locks: %w", a.sub.cfg.LockWaitTimeout, err)
	}
	return err
}

// giveBackNow releases claims of this round, locked under gen, that will not be handed out.
func (a *advisoryMode) giveBackNow(cs []offsets.Claimed, token int64, gen uint64) {
	if len(cs) == 0 {
		return
	}
	a.releaseGen(offsets.Fence(cs, token), gen)
}

// release gives back, as the subscription stops, claims that never reached a handler (fs,
// those of ds), then drops their locks (M5), each under the lock generation of the round that
// took it: claims held ahead may come from several rounds. What it released and unlocked is
// counted for Shutdown's report.
func (a *advisoryMode) release(ds []*delivery) {
	fs := fenced(ds)
	var gens []uint64
	byGen := map[uint64][]offsets.Fenced{}
	for i, d := range ds {
		if _, ok := byGen[d.gen]; !ok {
			gens = append(gens, d.gen)
		}
		byGen[d.gen] = append(byGen[d.gen], fs[i])
	}
	for _, gen := range gens {
		released, unlocked := a.releaseGen(byGen[gen], gen)
		a.sub.atStop.released.Add(int64(released))
		a.sub.atStop.unlocked.Add(int64(unlocked))
	}
}

// releaseGen makes the claims fs, locked under gen, visible again at once, then drops their
// locks; it returns how many rows it released and how many locks it dropped.
func (a *advisoryMode) releaseGen(fs []offsets.Fenced, gen uint64) (released, unlocked int) {
	released, ok := a.sub.releaseRows(fs, "Releasing undelivered claims failed; unlocking them, the group takes them over")
	if ok {
		a.sub.claimer.markDue(time.Now())
	}
	offs := make([]int64, len(fs))
	for i, f := range fs {
		offs[i] = f.Offset
	}
	return released, a.unlockGen(offs, gen)
}

// unlockGen drops locks of gen and returns how many it dropped; a failure loses the connection,
// which frees them anyway.
func (a *advisoryMode) unlockGen(offs []int64, gen uint64) int {
	if len(offs) == 0 {
		return 0
	}
	n, err := a.conn.Unlock(offs, gen)
	if err != nil {
		a.sub.s.stats.errors.Add(1)
	}
	return n
}

// await waits for the handler's ack or nack and queues it for the settler, unless Shutdown
// released the locks first (S5). The delivery keeps its slot and held token until its
// settlement is done.
func (a *advisoryMode) await(d *delivery) {
	sub := a.sub
	defer sub.settler.producers.Done()
	op := outcome(d, a.released)
	if op == "" {
		a.awaitLate(d)
		return
	}
	if !a.beginSettle() {
		sub.settler.stale(d, op, "Settlement after shutdown refused", true, nil)
		sub.forget(d)
		return
	}
	sub.work.settling(d)
	sub.settler.enqueue(d, op)
	// The handler is done: its slot goes back now, so that a message claimed ahead goes to a
	// handler while the settlement runs. An ack's held token goes back too, while fewer than
	// MaxInFlight acks settle so: the next claim does not wait for the ack's round trip. Its
	// lock stays held until the statement has run, and is dropped after it (unlock): the locks
	// of a subscription are bounded by 2 x MaxInFlight plus what it claims ahead, and the
	// settled ones whose drop waits for the next claim for a few milliseconds. A nack keeps
	// its token until it is applied, so that the message it makes due again is claimed before
	// newer ones; so does an ack in a group ordered by key (see leaseMode.await).
	sub.work.freeSlot(d)
	if op == opAck && !sub.cfg.OrderByKey {
		sub.work.freeTokenEarly(d)
	}
}

// beginSettle counts a settlement in flight, unless Shutdown released the locks.
func (a *advisoryMode) beginSettle() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return false
	}
	a.settling.Add(1)
	return true
}

// awaitLate refuses and reports the settlement of a delivery whose lock Shutdown released,
// if it comes before Shutdown has finished; nothing of the subscription waits for it after
// that (a settlement made later is not applied and not seen). It is not applied, and the
// message may already be with another consumer (S5).
func (a *advisoryMode) awaitLate(d *delivery) {
	if op := outcome(d, a.sub.settler.quit); op != "" {
		a.sub.settler.stale(d, op, "Settlement after shutdown refused", true, nil)
	}
	a.sub.forget(d)
}

// admit refuses, without a statement, the settlement of a delivery whose lock is gone: lost
// with its connection (A3), or released by Shutdown (S5).
func (a *advisoryMode) admit(x settlement) bool {
	lost := x.d.isLost()
	if !lost && !a.locksReleased() {
		return true
	}
	switch {
	case !x.d.wasAckedInTx() && lost:
		a.sub.settler.stale(x.d, x.op, "Settlement refused: the advisory lock was lost", false, nil)
	case !x.d.wasAckedInTx():
		a.sub.settler.stale(x.d, x.op, "Settlement refused", true, nil)
	default:
		// A nack after AckInTx whose lock is gone: the caller rolled back (the message is
		// another consumer's now) or committed (it is settled); not stale either way.
	}
	a.sub.forget(x.d)
	a.settling.Done()
	return false
}

// unlock drops the locks of settlements whose statement ran (or that the caller's commit
// settled), each under the generation of the round that took it. It leaves the drop to the
// next claim on the lock connection, which makes it in its own statement, or to a statement
// of its own a few milliseconds later if no claim comes (advisory.Conn.DeferUnlock): the
// settled deliveries free their places at once, and a subscriber that claims as it settles
// sends no statement for its unlocks.
func (a *advisoryMode) unlock(sts []settlement) {
	byGen := map[uint64][]int64{}
	for _, x := range sts {
		byGen[x.d.gen] = append(byGen[x.d.gen], x.d.offset)
	}
	for gen, offs := range byGen {
		a.conn.DeferUnlock(offs, gen)
	}
}

// failed: the settlements are retried while their locks hold; admit refuses them once their
// lock is gone.
func (a *advisoryMode) failed(op settleOp, these []settlement, _ map[int64]bool, err error) []settlement {
	a.sub.s.stats.errors.Add(1)
	a.sub.logger.Error("Settlement failed, retrying while the lock holds", err, watermill.LogFields{"op": op, "count": len(these)})
	return these
}

// giveUp: Shutdown has released their locks, and they are refused as such.
func (a *advisoryMode) giveUp(sts []settlement) {
	for _, op := range [...]settleOp{opAck, opNack} {
		a.sub.settler.apply(op, sts)
	}
}

// shutdown is the advisory part of Shutdown (S5): refuse new settlements, wait for those in
// flight, then release the lock of every delivery still in work and close the lock
// connection. It returns the locks it released and the connections it closed.
func (a *advisoryMode) shutdown(ctx context.Context) (released, closed int, err error) {
	a.shutdownOne.Do(func() {
		a.mu.Lock()
		a.closed = true
		a.mu.Unlock()

		settled := make(chan struct{})
		go func() {
			a.settling.Wait()
			close(settled)
		}()
		select {
		case <-settled:
		case <-ctx.Done():
			err = ctx.Err()
		}

		n, c, cerr := a.conn.CloseContext(ctx)
		released = n
		if c {
			closed = 1
		}
		if cerr != nil && err == nil {
			err = cerr
		}
		close(a.released)
		a.sub.settler.stopQueue() // no settlement is queued any more
	})
	return released, closed, err
}

// locksReleased reports whether Shutdown released the locks of the deliveries in work.
func (a *advisoryMode) locksReleased() bool {
	select {
	case <-a.released:
		return true
	default:
		return false
	}
}
