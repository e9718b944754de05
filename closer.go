package sqlbroker

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
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
	// QueriesCancelled is the number of the library's statements that were running when the
	// shutdown stopped them, that the server was asked to cancel, and whose end and rollback
	// the shutdown waited for: the sum of the five counts below.
	QueriesCancelled int
	// ClaimStatementsCancelled counts the claim statements among QueriesCancelled.
	ClaimStatementsCancelled int
	// SettlementStatementsCancelled counts the ack and nack statements among QueriesCancelled.
	SettlementStatementsCancelled int
	// ExtensionStatementsCancelled counts the lease extensions among QueriesCancelled.
	ExtensionStatementsCancelled int
	// ReleaseStatementsCancelled counts the statements giving back claims among QueriesCancelled.
	ReleaseStatementsCancelled int
	// OtherStatementsCancelled counts the rest of QueriesCancelled: deletes of settled messages
	// (Retention) and looks for the server process of a claim cut off by the network.
	OtherStatementsCancelled int
	// StatementsAbandoned is the number of statements whose end the server did not confirm
	// within a second of the cancel, once ctx had ended: their connections were closed, and the
	// server ends them when it notices.
	StatementsAbandoned int
	// SettlementsNotApplied is the number of acks and nacks made before the shutdown ended that
	// it did not apply (ctx ended first, or the database failed): in lease mode those messages
	// return when their leases run out, in advisory mode once their locks are released.
	SettlementsNotApplied int
	// LeasesLeft is the number of lease-mode deliveries in work whose leases were left to run
	// out: their messages return to the queue then. An ack or nack that comes after Shutdown
	// returned is not applied.
	LeasesLeft int
	// PublishesCancelled is the number of publishers' statements (inserts, COPYs, NOTIFYs)
	// still running when the wait for them ran out, cancelled on the server and awaited: none
	// of them committed.
	PublishesCancelled int
	// PublishesAbandoned is the number of publishers' statements whose end the server did not
	// confirm in time after their cancel; their connections were closed.
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
	r.ClaimStatementsCancelled += o.ClaimStatementsCancelled
	r.SettlementStatementsCancelled += o.SettlementStatementsCancelled
	r.ExtensionStatementsCancelled += o.ExtensionStatementsCancelled
	r.ReleaseStatementsCancelled += o.ReleaseStatementsCancelled
	r.OtherStatementsCancelled += o.OtherStatementsCancelled
	r.StatementsAbandoned += o.StatementsAbandoned
	r.SettlementsNotApplied += o.SettlementsNotApplied
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
// Every statement the subscriber has in flight (claim, ack, nack, lease extension, release,
// delete of settled messages) either finishes or is cancelled on the server, and Shutdown
// waits for the server to end it before it returns. While ctx allows, the steps below finish
// their statements. When ctx ends first, Shutdown cancels on the server every statement still
// running (or still waiting for a connection of the pool) and waits up to one more second for
// the server to end them; a statement the server has not ended by then is given up on, its
// connection closed (which takes up to another second), and counted in StatementsAbandoned.
// After Shutdown returns, no goroutine of the subscriber runs, nothing is logged, no
// connection is opened, and no statement of the subscriber runs or waits on the server.
//
// The order, each step finishing before the next starts:
//  1. No new Subscribe: it returns ErrClosed from now on.
//  2. Every subscription stops claiming; claims not yet handed to a handler are given back at
//     once (in advisory mode, their locks dropped), and the output channels are closed.
//  3. Settlements already made by handlers (acked or nacked) are applied.
//  4. Lease extension stops; the contexts of messages still in work are cancelled with
//     ErrClosed as their cause.
//  5. Lease mode: deliveries still in work keep their leases, which run out: an ack or nack
//     made after Shutdown returned is not applied, and the message returns to the queue once
//     its lease has run out (LeasesLeft).
//  6. Advisory mode: settlements already in flight finish, then the lock of every delivery
//     still in work is released and the lock connections close; a settlement made before
//     Shutdown returns is refused (counted and logged with ErrClosed), one made after it is
//     neither applied nor seen, and the message goes to the group's next consumer.
//     LocksReleased counts the locks of steps 2 and 6, ConnectionsClosed the
//     connections closed.
//  7. The subscriptions' loops end; statements still running are cancelled on the server as
//     described above, and settlements that could not be applied are given up
//     (SettlementsNotApplied).
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
	alone := map[*subscription]bool{} // under a Router's hook: stopped before, not by its closing
	for sub := range s.subs {
		subs = append(subs, sub)
		if sub.stoppedAlone() {
			alone[sub] = true
		}
	}
	// Under a Router's hook, subscriptions that the Router's closing stopped and that ended
	// before now: what their stop did is part of this shutdown.
	rep := s.stoppedByRouter
	s.mu.Unlock()
	start := time.Now()
	cancelledBefore, closedBefore := s.tracker.Cancelled(), s.tracker.Closed()
	close(s.shutdown)

	var err error
	rep.Subscriptions += len(subs) - len(alone)

	// 2. Stop claiming, give back what was not handed out, close the channels. A claim
	// running, or waiting for a connection, is cancelled on the server and awaited.
	for _, sub := range subs {
		sub.stop(ErrClosed)
	}
	for _, sub := range subs {
		select {
		case <-sub.handout.ended:
		case <-ctx.Done():
			err = ctx.Err()
		}
	}

	// 3. Let the settlements already made (acked or nacked, not yet applied) reach the
	// database, so that what is left in work is exactly what no handler has settled.
	for _, sub := range subs {
		if werr := sub.settler.drain(ctx); werr != nil && err == nil {
			err = werr
		}
	}

	// 4. Stop extending leases and waiting for settlements; end the contexts of messages in
	// work.
	for _, sub := range subs {
		sub.mode.stopWatching()
		rep.DeliveriesInWork += sub.work.cancelAll(ErrClosed)
	}

	// 5. Lease mode: deliveries in work keep their leases (counted once the loops ended).

	// 6. Advisory mode: settlements already in flight finish; then the lock of every delivery
	//    still in work is released and the lock connections are closed. A settlement that
	//    comes before Shutdown returns is refused, counted and logged with ErrClosed.
	for _, sub := range subs {
		released, closed, aerr := sub.mode.shutdown(ctx)
		rep.LocksReleased += released
		rep.ConnectionsClosed += closed
		if aerr != nil && err == nil {
			err = aerr
		}
	}

	// 7. Let the loops end while ctx allows; then cancel on the server what still runs, wait
	// for the server's answers, and for the loops, which have nothing left to wait for.
	for _, sub := range subs {
		select {
		case <-sub.loops.ended:
		case <-ctx.Done():
			if err == nil {
				err = ctx.Err()
			}
		}
	}
	stop := s.tracker.Stop(ctx)
	grace, cancelGrace := context.WithTimeout(context.Background(), dbx.CancelWait)
	defer cancelGrace()
	for _, sub := range subs {
		select {
		case <-sub.loops.finished:
		case <-grace.Done():
		}
	}

	for _, sub := range subs {
		rep.SettlementsNotApplied += int(sub.settler.notApplied.Load())
		if alone[sub] {
			continue // what its own stop did is not this shutdown's
		}
		stopped := sub.stopReport()
		rep.ClaimsReleased += stopped.ClaimsReleased
		rep.LocksReleased += stopped.LocksReleased
		rep.ConnectionsClosed += stopped.ConnectionsClosed
		rep.QueriesCancelled += stopped.QueriesCancelled
		rep.ClaimStatementsCancelled += stopped.ClaimStatementsCancelled
		rep.LeasesLeft += sub.mode.leasesLeft()
	}
	for kind, n := range stop.Cancelled {
		n -= cancelledBefore[kind]
		rep.QueriesCancelled += n
		switch kind {
		case stmtClaim:
			rep.ClaimStatementsCancelled += n
		case stmtAck, stmtNack:
			rep.SettlementStatementsCancelled += n
		case stmtExtend:
			rep.ExtensionStatementsCancelled += n
		case stmtRelease:
			rep.ReleaseStatementsCancelled += n
		default:
			rep.OtherStatementsCancelled += n
		}
	}
	for _, n := range stop.Abandoned {
		rep.StatementsAbandoned += n
	}
	rep.ConnectionsClosed += s.tracker.Closed() - closedBefore

	rep.Duration = time.Since(start)
	s.mu.Lock()
	s.report, s.err = rep, err
	s.mu.Unlock()
	if err == nil {
		s.logger.Info("Subscriber shut down", watermill.LogFields{
			"subscriptions": rep.Subscriptions, "claims_released": rep.ClaimsReleased,
			"deliveries_in_work": rep.DeliveriesInWork, "locks_released": rep.LocksReleased,
			"connections_closed": rep.ConnectionsClosed, "duration": rep.Duration,
		})
	}
	close(s.done)
	return rep, err
}
