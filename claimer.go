package sqlbroker

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// claimer is a subscription's claim loop (run): it claims messages while claims may be held
// (the work set's held tokens), registers them in the work set, and queues them on ready for
// the hand-out loop. The claim statement itself is the claim mode's.
type claimer struct {
	sub   *subscription
	ready chan *delivery // claimed, waiting for a handler slot (FIFO); closed when run ends

	dueAt    dueTimes     // when claims of this subscription come due again (delay.go)
	passed   atomic.Int32 // delayed messages the last claim passed (passDelayed)
	passRoom int          // delayed messages the next claim may pass besides its room (run only)
	// parkFloor is where the next ordered claim reads the group's parked rows from
	// (offsets.Store.ClaimOrderedFrom): at or below every parked row of the group, above the
	// index entries of those handed out since the last vacuum. Each claim gives back the
	// next one's; the first reads from the bottom (run only).
	parkFloor int64

	park   parking        // sleeping while there is nothing to claim (idlepark.go)
	sqlite sqliteWatching // on SQLite: when an idle claim may be skipped (idlepark_sqlite.go)

	woken    <-chan struct{} // a publisher of this process or a NOTIFY woke the topic
	unreg    func()          // ends woken
	unlisten func() bool     // releases the process's LISTEN connection; true if that closed it
}

func newClaimer(sub *subscription) *claimer {
	c := &claimer{
		sub:   sub,
		ready: make(chan *delivery, sub.cfg.MaxInFlight+sub.work.prefetch),
		park:  parking{duePoke: make(chan struct{}, 1)},

		parkFloor: offsets.NoParkFloor,
	}
	return c
}

// firstRetryAfterWake is the first pause after a wake-up that found nothing: the message that
// woke the subscription may still be held back by the xmin horizon (an older transaction
// elsewhere in the cluster is still running), so it is looked for again soon, at doubling
// intervals up to PollInterval.
const firstRetryAfterWake = 5 * time.Millisecond

// run claims messages while claims may be held, and queues them for the hand-out loop.
func (c *claimer) run() {
	sub := c.sub
	defer close(c.ready)
	defer func() {
		if c.unlisten() {
			sub.atStop.connsClosed.Add(1)
		}
	}()
	defer sub.joinIdlePoll()()

	buf := make([]offsets.Claimed, 0, sub.cfg.BatchSize)
	idle := sub.cfg.PollInterval // the next pause when a claim finds nothing
	due := dueState{all: true}
	passed := false // the last claim passed delayed messages
	for {
		// Room for at least one claim, then as many as are free, up to BatchSize.
		if !sub.work.takeToken(sub.ctx) {
			return
		}
		n := c.gather()

		now := time.Now()
		var claimed []offsets.Claimed
		var token int64
		var from time.Time // the claims' leases count from then
		var err error
		withDue, ownDue, missed := offsets.DueNone, false, false
		if sub.lookNeeded(now) { // else nothing changed since a claim found nothing (idlepark_sqlite.go)
			sub.looking(now)
			withDue, ownDue = c.wantDue(&due, now)
			c.passRoom = 0
			if passed {
				c.passRoom = passAfterPassing
			}
			c.passed.Store(0)
			claimed, token, from, err = sub.mode.claim(buf[:0], n, withDue) // none when err != nil
			due.claimed(withDue, now, sub.cfg.IdlePollInterval, claimed, n, err)
			// The claim passed delayed messages: more of them, and messages to hand out behind
			// them, may be waiting. The next claim runs at once, not after the idle pause, with
			// room to pass many (passAfterPassing).
			passed = err == nil && c.passed.Load() > 0
			// A due time of its own came and the claim took nothing again: the claim may have
			// run a moment before the database's clock reached that time. It is looked for
			// again soon, once (firstRetryAfterWake), not only at the next idle look.
			missed = err == nil && ownDue && (len(claimed) == 0 || !claimed[0].Again)
			c.sqlite.mustLook = err != nil || len(claimed) > 0 || passed || missed
		}
		sub.work.returnTokens(n - len(claimed))
		if err != nil {
			if sub.ctx.Err() != nil {
				return
			}
			if dbx.SQLState(err) == dbx.CodeLockNotAvailable {
				// The advisory claim waited out LockWaitTimeout on a lock held elsewhere (a
				// migration's table lock): expected contention, not a failure.
				sub.logger.Info("Claim waited too long for a lock, retrying", watermill.LogFields{"err": err, "retry_in": sub.cfg.RetryInterval})
			} else {
				sub.s.stats.errors.Add(1)
				sub.logger.Error("Claim failed, retrying", err, watermill.LogFields{"retry_in": sub.cfg.RetryInterval})
			}
			if goOn, _ := c.wait(sub.cfg.RetryInterval, false); !goOn {
				return
			}
			continue
		}
		if len(claimed) == 0 {
			if passed {
				continue
			}
			if missed {
				idle = firstRetryAfterWake
			}
			var goOn, woken bool
			if withDue != offsets.DueNone && !missed && c.park.entry != nil && idle >= min(sub.cfg.PollInterval, sub.cfg.IdlePollInterval) {
				// Nothing now, nothing due: sleep until told (idlepark.go).
				goOn, woken = sub.park()
				// Not woken by new messages: by the shared poll, which may have found a lease
				// of another consumer that ran out, by a due time, or by the safety poll.
				due.all = due.all || !woken
			} else {
				goOn, woken = c.wait(sub.untilDue(idle), true)
			}
			if !goOn {
				return
			}
			if woken {
				c.sqlite.mustLook = true
				idle = firstRetryAfterWake
			} else {
				idle = min(idle*2, sub.cfg.PollInterval)
			}
			continue
		}
		idle = sub.cfg.PollInterval
		sub.s.stats.claimed.Add(int64(len(claimed)))
		c.register(claimed, token, from)
	}
}

// wait sleeps for d, or until the subscription stops. A wakeable wait also ends when the
// topic is woken (a publisher of this process, or a NOTIFY through the LISTEN connection), and
// when a claim of the subscription comes due sooner than d (markDue: an applied ack of a group
// ordered by key freed its key, a nack's backoff, a lost lease). It reports whether to go on,
// and whether the topic was woken.
func (c *claimer) wait(d time.Duration, wakeable bool) (goOn, woken bool) {
	end := time.Now().Add(d)
	t := time.NewTimer(d)
	defer t.Stop()
	var wakeCh, dueCh <-chan struct{}
	if wakeable {
		wakeCh, dueCh = c.woken, c.park.duePoke
	}
	for {
		select {
		case <-t.C:
			return true, false
		case <-wakeCh:
			return true, true
		case <-dueCh:
			at := c.dueAt.first()
			if at == 0 {
				continue
			}
			until := time.Until(time.Unix(0, at))
			if until <= 0 {
				return true, false
			}
			if until < time.Until(end) {
				t.Reset(until)
			}
		case <-c.sub.ctx.Done():
			return false, false
		}
	}
}

// dueState tells the claim loop which claims due again its claims take back first
// (offsets.Due). There are three looks:
//   - at the claims no one holds (offsets.DueGivenBack): nacked or released, delayed messages
//     whose time came, in the advisory mode claims left for a later round. On PostgreSQL they
//     are a range of the claims table's key of their own (negative tokens), which the claims
//     held and settled never enter, so the look costs little however long vacuum has been
//     held back. A claim makes it when there may be such claims: its last claim was short
//     (the backlog ran out, or in the advisory mode a lock was taken elsewhere and the claim
//     left due for a later round) or took claims again.
//   - at those and at the held claims whose lease ran out: a subscription makes it once per
//     IdlePollInterval, as the shared poll of idle subscriptions looks for them (leases of
//     other consumers, whose times it cannot know), and at once when it knows better: one of
//     its own claims came due (a nack's backoff ended, a lease was lost, or the time of a
//     delayed message it passed came: dueAt), its last claim failed, or the last such look
//     was filled with claims taken again (there may be more). It reads the leases that ran
//     out within offsets.RecentWindow only (offsets.DueRecent), through an index of their
//     deadlines, so its cost does not grow with the claims settled while vacuum is held back,
//     when the subscription's looks leave no gap: its last look that left nothing behind
//     began less than half that window ago (covered), so every lease that ran out since has
//     its deadline in the window. Otherwise, and every fullLookPolls IdlePollIntervals, it
//     reads every claim of the group (offsets.DueAll): the first look of a subscription, a
//     look after a claim that waited for seconds, and a lease that another claimer's look
//     locked, skipped by this one, and left when its statement failed.
//
// With MaxInFlight 1 a nacked message is thus claimed again by the first claim after its
// backoff, ahead of new messages (M3).
type dueState struct {
	next    time.Time // the next periodic look at leases that ran out
	fullAt  time.Time // the next periodic look at every claim
	covered time.Time // when the last look at leases that ran out that left none behind began
	again   bool      // the next claim looks at the claims given back at least
	all     bool      // the next claim looks at leases that ran out
	full    bool      // that look reads every claim: the last one that did was filled, or failed
}

// fullLookPolls is how many IdlePollIntervals apart a subscription's looks at every claim of
// its group are, at most.
const fullLookPolls = 30

// wantDue says which claims due again the claim made at now takes back, and takes the
// subscription's own due times that have come; own says whether there were any.
func (c *claimer) wantDue(st *dueState, now time.Time) (due offsets.Due, own bool) {
	own = c.dueAt.take(now.UnixNano())
	switch {
	case own || st.all || !now.Before(st.next):
		if st.full || st.covered.IsZero() || now.Sub(st.covered) >= offsets.RecentWindow/2 || !now.Before(st.fullAt) {
			return offsets.DueAll, own
		}
		return offsets.DueRecent, own
	case st.again:
		return offsets.DueGivenBack, own
	}
	return offsets.DueNone, own
}

// claimed records the outcome of a claim of up to n messages that looked at due, made at at;
// poll is the IdlePollInterval, between periodic looks at leases that ran out.
func (st *dueState) claimed(due offsets.Due, at time.Time, poll time.Duration, cs []offsets.Claimed, n int, err error) {
	again := len(cs) > 0 && cs[0].Again // taken again come first
	// A look filled with claims taken again may have left more.
	filled := again && len(cs) == n
	lost := due == offsets.DueAll || due == offsets.DueRecent
	if lost {
		st.next = at.Add(poll)
		if err == nil && !filled {
			st.covered = at
		}
		if due == offsets.DueAll && err == nil {
			st.fullAt = at.Add(fullLookPolls * poll)
		}
	}
	st.full = due == offsets.DueAll && (filled || err != nil)
	st.all = err != nil || lost && filled
	st.again = st.all || len(cs) < n || again
}

// markDue notes that a claim of this subscription is due again from t on.
func (c *claimer) markDue(t time.Time) {
	if c.dueAt.add(t.UnixNano()) {
		c.sub.pokeDue()
	}
}

// gather takes the free held tokens, up to BatchSize, for the next claim; the caller holds
// one already. With claims held ahead (prefetch), it waits until at least half of them are
// free: under load tokens free one at a time, and claiming each at once would make a claim
// statement a message, every one of them locking the group's row (the consumers of a group
// take turns on it) and paying a round trip, while the handlers are fed from the claims held
// ahead meanwhile. Tokens are then certain to free: fewer than half free means more than
// MaxInFlight held, so some are in handlers or settling. An idle subscription has every token
// free and claims at once.
func (c *claimer) gather() int {
	sub := c.sub
	n := 1
	want := max(1, sub.work.prefetch/2)
	for n < sub.cfg.BatchSize {
		if n < want {
			if !sub.work.takeToken(sub.ctx) {
				return n
			}
			n++
			continue
		}
		if !sub.work.tryToken() {
			return n
		}
		n++
	}
	return n
}

// claimTimeout bounds one claim statement, as a safety net: it runs under no caller's
// context (see leaseMode.claim).
const claimTimeout = time.Minute

// register puts claimed messages in the work set and queues them for the hand-out loop; the
// queue holds every held token, so this never blocks. from is when the claims' leases began
// at the latest, locally (claimMode.claim): the local deadline never outlives the database's.
func (c *claimer) register(claimed []offsets.Claimed, token int64, from time.Time) {
	sub := c.sub
	deadline := from.Add(sub.cfg.LeaseTTL)
	ds := make([]*delivery, len(claimed))
	for i, cl := range claimed {
		ds[i] = sub.newDelivery(cl, token, deadline)
	}
	sub.work.add(ds)
	sub.mode.registered(ds)
	for _, d := range ds {
		if sub.settler.overAttempts(d) && d.attempts > sub.cfg.MaxAttempts {
			sub.deadOnArrival(d)
			continue
		}
		c.ready <- d
	}
}

// releaseRows makes claims visible again at once, fenced by their tokens, and returns how
// many the database released. A failure is counted and logged as failed, which says what
// becomes of the claims then.
func (sub *subscription) releaseRows(fs []offsets.Fenced, failed string) (int, bool) {
	var done map[int64]bool
	err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtRelease, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		var err error
		done, err = sub.store.Release(ctx, q, sub.groupID, fs)
		return err
	})
	if err != nil {
		sub.s.stats.errors.Add(1)
		sub.logger.Error(failed, err, watermill.LogFields{"count": len(fs)})
		return 0, false
	}
	sub.s.stats.released.Add(int64(len(done)))
	return len(done), true
}
