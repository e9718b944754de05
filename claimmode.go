package sqlbroker

import (
	"context"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// claimMode is how a subscription holds its claims: by a lease it keeps extending (leaseMode,
// lease.go) or by an advisory lock on its lock connection (advisoryMode, advisory.go). The
// claim loop, the hand-out loop, the settler and Shutdown are written once above it.
type claimMode interface {
	// claim takes up to n messages under a new token (see claimer.claim), running the due step
	// when due says so. from is the local time the claims' leases count from: never later
	// than the database counted them.
	claim(buf []offsets.Claimed, n int, due offsets.Due) (claimed []offsets.Claimed, token int64, from time.Time, err error)
	// registered is told of the deliveries of a claim once they are in the work set.
	registered(ds []*delivery)
	// release gives back, as the subscription stops, claims that never reached a handler; they
	// are out of the work set already.
	release(ds []*delivery)
	// run is the mode's loop, one of the subscription's loops: the lease extender, or the
	// watch of the lock connection.
	run()
	// idle is closed once the subscription stopped and the mode holds nothing any more.
	idle() <-chan struct{}
	// expires says whether a claim's local deadline bounds it (a lease does, a lock does not).
	expires() bool
	// woken tells the mode that the idle poll found work for the subscription.
	woken()
	// holdsLocks says whether claims hold advisory locks; locksHeld is how many are held now.
	holdsLocks() bool
	locksHeld() int

	// await waits for the handler's ack or nack of d, handed out, and queues it for the
	// settler; it calls settler.producers.Done when it ends.
	await(d *delivery)
	// beginSettle says whether a settlement may be queued now (one of a message claimed after
	// its last attempt, deadletter.go), and counts it as in flight if so.
	beginSettle() bool
	// admit says whether a settlement's statement may run; one it refuses is counted and its
	// delivery forgotten.
	admit(x settlement) bool
	// unlock is told of settlements whose statement ran, before they are counted.
	unlock(sts []settlement)
	// settled is told that n settlements counted as in flight are done.
	settled(n int)
	// failed is told of settlements whose statement failed (done holds those it applied
	// before the error) and returns those to try again.
	failed(op settleOp, these []settlement, done map[int64]bool, err error) []settlement
	// giveUp drops settlements that Shutdown left no time to apply.
	giveUp(sts []settlement)
	// lostField names, in the log of a refused settlement, whether its claim was lost before.
	lostField() string

	// stopWatching is Shutdown's step 4: lease extension and the wait for settlements stop.
	stopWatching()
	// shutdown is Shutdown's step 6; it returns the locks it released and the connections it
	// closed.
	shutdown(ctx context.Context) (released, closed int, err error)
	// leasesLeft is how many deliveries Shutdown left to their leases (step 5).
	leasesLeft() int
	// abandon closes what the mode opened, for a subscription that never started.
	abandon()
}

// newClaimMode opens the claim mode the subscriber is configured for; ctx bounds its connect.
func newClaimMode(ctx context.Context, sub *subscription) (claimMode, error) {
	if sub.cfg.ClaimMode == ClaimAdvisoryLock {
		return openAdvisory(ctx, sub)
	}
	return newLeaseMode(sub), nil
}
