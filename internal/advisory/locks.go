package advisory

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// TryLock tries the locks of exactly the given offsets, without waiting, and returns those it
// took together with the generation they were taken under. An offset whose lock this Conn
// already holds is not tried again (session locks are re-entrant, and a second hold would
// outlive the first unlock) and is not returned. An error means no lock was taken. stop ending
// cancels the statement on the server (see Options.Stop); the error then wraps ErrCancelled.
func (c *Conn) TryLock(stop context.Context, offsets []int64) ([]int64, uint64, error) {
	if len(offsets) == 0 {
		return nil, c.Gen(), nil
	}
	var locked []int64
	gen, err := c.locking(stop, false, func(held map[int64]uint64) []int64 {
		try := make([]int64, 0, len(offsets))
		for _, o := range offsets {
			if _, ok := held[o]; !ok {
				try = append(try, o)
			}
		}
		return try
	}, func(ctx context.Context, q dbx.Querier, try, _ []int64) ([]int64, []int64, error) {
		if len(try) == 0 {
			return nil, nil, nil
		}
		var err error
		locked, err = dbx.ScanInt64s(q.Query(ctx, tryLockSQL, c.opt.Key1, try))
		return locked, nil, err
	})
	if err != nil {
		return nil, 0, err
	}
	return locked, gen, nil
}

// Claim runs claim on the lock connection, with the offsets whose locks the connection holds
// already (claim must not lock those again: session locks are re-entrant) and those whose
// locks DeferUnlock left to it, which claim drops in the same statement
// (offsets.Store.ClaimLockedPassing) and returns those the session did not hold. claim locks
// the offsets it returns in the statement that claims them, so a claim becomes visible to
// others only with its lock held. Claim returns the generation the locks were taken under. A
// claim that fails takes nothing: locks its statement took before it failed are dropped again,
// and so are those it was to drop. stop ending cancels the statement on the server (see
// Options.Stop); the error then wraps ErrCancelled.
func (c *Conn) Claim(stop context.Context, claim func(ctx context.Context, q dbx.Querier, held, unlock []int64) (locked, refused []int64, err error)) (uint64, error) {
	return c.locking(stop, true, func(held map[int64]uint64) []int64 {
		out := make([]int64, 0, len(held))
		for o := range held {
			out = append(out, o)
		}
		return out
	}, claim)
}

// locking runs one statement that takes locks: args builds its argument from the bookkeeping,
// fn runs it and returns the offsets it locked, which are then held under the generation
// returned. With carry, fn also drops the deferred locks it is given (see Claim).
func (c *Conn) locking(stop context.Context, carry bool, args func(held map[int64]uint64) []int64,
	fn func(ctx context.Context, q dbx.Querier, arg, unlock []int64) (locked, refused []int64, err error)) (uint64, error) {
	conn, gen, err := c.turnOn()
	if err != nil {
		return 0, err
	}
	var unlock []int64
	if carry {
		unlock = c.takeDeferred(gen)
	}
	c.mu.Lock()
	arg := args(c.held)
	c.mu.Unlock()
	var locked, refused []int64
	err = c.statement(stop, conn, func(ctx context.Context) error {
		var err error
		locked, refused, err = fn(ctx, conn, arg, unlock)
		return err
	})
	if err != nil {
		if errors.Is(err, ErrStopped) {
			c.deferAgain(unlock, gen) // the statement did not run
		}
		// A statement that failed on a live connection is followed by reconcile, which drops
		// every lock of the session the bookkeeping does not hold: those of unlock are no
		// longer in it.
		lost := c.failedOrNotRun(conn, err)
		c.give()
		c.report(lost)
		return 0, err
	}
	c.mu.Lock()
	for _, o := range locked {
		c.held[o] = gen
	}
	c.mu.Unlock()
	c.give()
	c.refused(refused)
	return gen, nil
}

// Query runs fn, statements that take no lock (reads of the claims, the takeover of claims
// whose locks are held already), on the lock connection, so that stop ending cancels them on
// the server as it cancels a claim (see Options.Stop).
func (c *Conn) Query(stop context.Context, fn func(ctx context.Context, q dbx.Querier) error) error {
	conn, _, err := c.turnOn()
	if err != nil {
		return err
	}
	err = c.statement(stop, conn, func(ctx context.Context) error { return fn(ctx, conn) })
	var lost []int64
	if err != nil {
		lost = c.failedOrNotRun(conn, err)
	}
	c.give()
	c.report(lost)
	return err
}

// failedOrNotRun is failed for a statement of statement, which returns ErrStopped when stop had
// ended before the statement could start: the connection is then as it was, with its locks,
// for the owner's Close to drop and count. The turn is held.
func (c *Conn) failedOrNotRun(conn dbx.Conn, err error) []int64 {
	if errors.Is(err, ErrStopped) {
		return nil
	}
	return c.failed(conn, err)
}

// Unlock drops the locks of the offsets taken under generation gen and returns how many it
// dropped. Offsets this Conn does not hold under gen (the connection was lost since) are
// skipped. PostgreSQL saying that it did not hold a lock the bookkeeping says it held is a bug,
// and is logged as one.
func (c *Conn) Unlock(offsets []int64, gen uint64) (int, error) {
	c.take()
	c.mu.Lock()
	if c.conn == nil || gen != c.gen {
		c.mu.Unlock()
		c.give()
		return 0, nil
	}
	conn := c.conn
	mine := make([]int64, 0, len(offsets))
	for _, o := range offsets {
		if g, ok := c.held[o]; ok && g == gen {
			mine = append(mine, o)
		}
	}
	c.mu.Unlock()
	n, lost, err := c.unlock(conn, mine)
	c.give()
	c.report(lost)
	return n, err
}

// unlock unlocks offsets the bookkeeping holds; the turn is held. If the statement fails on a
// live connection, the offsets leave the bookkeeping and reconcile drops whichever of them is
// still held: all of them are then unlocked.
func (c *Conn) unlock(conn dbx.Conn, offsets []int64) (int, []int64, error) {
	if len(offsets) == 0 {
		return 0, nil, nil
	}
	var confirmed, refused []int64
	err := c.statement(nil, conn, func(ctx context.Context) error {
		rows, err := conn.Query(ctx, unlockSQL, c.opt.Key1, offsets)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var o int64
			var ok bool
			if err := rows.Scan(&o, &ok); err != nil {
				return err
			}
			if ok {
				confirmed = append(confirmed, o)
			} else {
				refused = append(refused, o)
			}
		}
		return rows.Err()
	})
	if err != nil {
		c.mu.Lock()
		for _, o := range offsets {
			delete(c.held, o)
		}
		c.mu.Unlock()
		if lost := c.failed(conn, err); lost != nil || !dbx.StatementFailed(err) {
			return 0, lost, err
		}
		return len(offsets), nil, nil // reconcile dropped what the statement left
	}
	c.mu.Lock()
	for _, o := range confirmed {
		delete(c.held, o)
	}
	for _, o := range refused {
		delete(c.held, o)
	}
	c.mu.Unlock()
	c.refused(refused)
	return len(confirmed), nil, nil
}

// refused logs the offsets whose unlock PostgreSQL refused although the bookkeeping held
// them: a bug.
func (c *Conn) refused(offsets []int64) {
	for _, o := range offsets {
		c.opt.Logger.Error("BUG: advisory unlock returned false for a lock the subscriber's bookkeeping says it held",
			errors.New("advisory: unlock of a lock not held"),
			watermill.LogFields{"key1": c.opt.Key1, "offset": o, "key2": Key2(o)})
	}
}

// DeferUnlock leaves the drop of the locks of the offsets taken under generation gen to the
// next Claim, which drops them in its own statement, or, if no Claim starts within
// Options.DeferFlush, to an unlock statement of their own: a subscriber that settles while
// it claims saves the round trip of an unlock. Offsets this Conn does not hold under gen are
// skipped. Until they are dropped, the locks count in Held, and CloseContext drops them
// without counting them.
func (c *Conn) DeferUnlock(offsets []int64, gen uint64) {
	c.mu.Lock()
	if c.conn == nil || gen != c.gen || c.closed {
		c.mu.Unlock()
		return
	}
	for _, o := range offsets {
		if g, ok := c.held[o]; ok && g == gen {
			c.deferred = append(c.deferred, o)
		}
	}
	schedule := len(c.deferred) > 0 && !c.flushing
	if schedule {
		c.flushing = true
	}
	c.mu.Unlock()
	if schedule {
		time.AfterFunc(c.opt.DeferFlush, c.flushDeferred)
	}
}

// deferAgain gives back to the deferred drops the offsets a Claim took but did not run.
func (c *Conn) deferAgain(offsets []int64, gen uint64) {
	if len(offsets) == 0 {
		return
	}
	c.mu.Lock()
	if c.conn == nil || gen != c.gen {
		c.mu.Unlock()
		return
	}
	for _, o := range offsets {
		c.held[o] = gen
	}
	c.mu.Unlock()
	c.DeferUnlock(offsets, gen)
}

// takeDeferred takes the deferred offsets still held under gen out of the bookkeeping, once
// each, for the statement that drops their locks; the turn is held.
func (c *Conn) takeDeferred(gen uint64) []int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.deferred) == 0 {
		return nil
	}
	var out []int64
	if gen == c.gen {
		out = make([]int64, 0, len(c.deferred))
		for _, o := range c.deferred {
			if g, ok := c.held[o]; ok && g == gen {
				delete(c.held, o)
				out = append(out, o)
			}
		}
	}
	c.deferred = c.deferred[:0]
	return out
}

// flushDeferred drops the deferred locks that no Claim took within Options.DeferFlush.
func (c *Conn) flushDeferred() {
	c.mu.Lock()
	c.flushing = false
	c.mu.Unlock()
	c.take()
	conn, gen, err := c.current()
	if err != nil {
		c.give()
		return
	}
	_, lost, err := c.unlock(conn, c.takeDeferred(gen))
	c.give()
	c.report(lost)
	if err != nil {
		c.opt.Logger.Error("Dropping the locks of settled claims failed", err, watermill.LogFields{"key1": c.opt.Key1})
	}
}
