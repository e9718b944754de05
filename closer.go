package sqlbroker

import (
	"context"
	"errors"
	"github.com/ThreeDotsLabs/watermill"
	"time"
)

// CloseReport says what a shutdown did. Its figures count what the shutdown itself did, so a
// tool can compare them with pg_locks and pg_stat_activity.
type CloseReport struct {
	// LocksReleased is the number of advisory locks the shutdown released.
	LocksReleased int
	// ConnectionsClosed is the number of database connections the shutdown closed.
	ConnectionsClosed int
	// Subscriptions is the number of subscriptions the shutdown stopped.
	Subscriptions int
	// ClaimsReleased is the number of claims not yet handed to a handler that were given back.
	ClaimsReleased int
	// DeliveriesInWork is the number of messages handed to handlers and not yet settled.
	DeliveriesInWork int
	// QueriesCancelled is the number of claim statements that were running when their
	// subscription stopped, that the server was asked to cancel, and whose end and rollback
	// the shutdown waited for (S3).
	QueriesCancelled int
	// LeasesLeft is the number of lease-mode deliveries in work whose leases were left to run
	// out: settled before then, the settlement applies; otherwise the message returns (S4).
	LeasesLeft int
	// PublishesCancelled is the number of publishers' statements (inserts, COPYs, NOTIFYs) still running when the wait for them ran out, cancelled on the server and awaited: none of them committed.
	PublishesCancelled int
	// PublishesAbandoned is the number of publishers' statements whose end the server did not confirm in time after their cancel; their connections were closed.
	PublishesAbandoned int
	// Duration is how long the shutdown took.
	Duration time.Duration
}

// add adds the figures of o to r.
func (r *CloseReport) add(o CloseReport) {
	r.LocksReleased += o.LocksReleased
	r.ConnectionsClosed += o.ConnectionsClosed
	r.Subscriptions += o.Subscriptions
	r.ClaimsReleased += o.ClaimsReleased
	r.DeliveriesInWork += o.DeliveriesInWork
	r.LeasesLeft += o.LeasesLeft
	r.QueriesCancelled += o.QueriesCancelled
	r.PublishesCancelled += o.PublishesCancelled
	r.PublishesAbandoned += o.PublishesAbandoned
}

func joinErrors(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	return errors.Join(errs...)
}

// Shutdown stops the subscriber, bounded by ctx like http.Server.Shutdown: it returns ctx's
// error when ctx ends first, and the report of what it had done by then.
//
// The order, each step finishing before the next starts:
//  1. No new Subscribe: it returns ErrClosed from now on.
//  2. Every subscription stops claiming; claims not yet handed to a handler are given back at
//     once (in advisory mode, their locks dropped), and the output channels are closed (M5).
//  3. Settlements already made by handlers (acked or nacked) are applied.
//  4. Lease extension stops (S2); the contexts of messages still in work are cancelled with
//     ErrClosed as their cause.
//  5. Lease mode: deliveries still in work keep their leases, which run out unless the
//     delivery settles first (S4).
//  6. Advisory mode: settlements already in flight finish, then the lock of every delivery
//     still in work is released and the lock connections close (S5); a later settlement is
//     refused. LocksReleased counts the locks of steps 2 and 6, ConnectionsClosed the
//     connections closed (S9).
//
// Shutdown is idempotent: later and concurrent calls wait for the first one and return its
// report and error.
func (s *Subscriber) Shutdown(ctx context.Context) (CloseReport, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		select {
		case <-s.done:
			return s.report, s.err
		case <-ctx.Done():
			return CloseReport{}, ctx.Err()
		}
	}
	// 1. Refuse new subscriptions.
	s.closed = true
	subs := make([]*subscription, 0, len(s.subs))
	for sub := range s.subs {
		subs = append(subs, sub)
	}
	s.mu.Unlock()
	start := time.Now()
	close(s.shutdown)

	var rep CloseReport
	var err error
	rep.Subscriptions = len(subs)

	// 2. Stop claiming, give back what was not handed out, close the channels.
	for _, sub := range subs {
		sub.cancel(ErrClosed)
	}
	for _, sub := range subs {
		select {
		case <-sub.claimDone:
			rep.ClaimsReleased += int(sub.releasedAtStop.Load())
			rep.LocksReleased += int(sub.unlockedAtStop.Load())
			rep.QueriesCancelled += int(sub.queriesCancelled.Load())
			rep.ConnectionsClosed += int(sub.connsClosed.Load())
		case <-ctx.Done():
			err = ctx.Err()
		}
	}

	// 3. Let the settlements already made (acked or nacked, not yet applied) reach the
	// database, so that what is left in work is exactly what no handler has settled.
	for _, sub := range subs {
		if werr := sub.waitSettling(ctx); werr != nil && err == nil {
			err = werr
		}
	}

	// 4. Stop extending leases; end the contexts of messages in work.
	for _, sub := range subs {
		close(sub.stopExt)
		sub.mu.Lock()
		for _, d := range sub.inWork {
			rep.DeliveriesInWork++
			d.cancel(ErrClosed)
		}
		sub.mu.Unlock()
	}

	// 5. Lease mode: deliveries in work keep their leases.
	if s.config.ClaimMode == ClaimLease {
		rep.LeasesLeft = rep.DeliveriesInWork
	}

	// 6. Advisory mode: settlements already in flight finish; then the lock of every delivery
	//    still in work is released and the lock connections are closed (S5). A settlement
	//    that comes later is refused, counted and logged with ErrClosed.
	for _, sub := range subs {
		if sub.adv == nil {
			continue
		}
		released, closed, aerr := sub.adv.shutdown(ctx)
		rep.LocksReleased += released
		rep.ConnectionsClosed += closed
		if aerr != nil && err == nil {
			err = aerr
		}
	}

	rep.Duration = time.Since(start)
	s.mu.Lock()
	s.report, s.err = rep, err
	s.mu.Unlock()
	close(s.done)
	if err == nil {
		s.logger.Info("Subscriber shut down", watermill.LogFields{
			"subscriptions": rep.Subscriptions, "claims_released": rep.ClaimsReleased,
			"deliveries_in_work": rep.DeliveriesInWork, "locks_released": rep.LocksReleased,
			"connections_closed": rep.ConnectionsClosed, "duration": rep.Duration,
		})
	}
	return rep, err
}

// waitSettling waits until no delivery in work has been acked or nacked without its
// settlement being applied yet.
func (sub *subscription) waitSettling(ctx context.Context) error {
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	for {
		if !sub.settling() {
			return nil
		}
		select {
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (sub *subscription) settling() bool {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	for _, d := range sub.inWork {
		select {
		case <-d.msg.Acked():
			return true
		case <-d.msg.Nacked():
			return true
		default:
		}
	}
	return false
}
