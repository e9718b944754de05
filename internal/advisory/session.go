package advisory

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// dial opens a dedicated connection (in the room held for it, on a bounded pool) and sets up
// its session. The first lock connection of a pool in the process that passes the session
// check (A5) marks the pool: its later ones, and reconnects, are only set up.
func (c *Conn) dial(ctx context.Context) (dbx.Conn, error) {
	var conn dbx.Conn
	var err error
	if r, ok := c.pool.(dbx.Reserver); ok && c.unreserve != nil {
		conn, err = r.DedicatedReserved(ctx)
	} else {
		conn, err = c.pool.Dedicated(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("advisory: open the lock connection: %w", err)
	}
	if err := c.setup(ctx, conn); err != nil {
		conn.Destroy()
		return nil, err
	}
	if sessions.Has(c.pool) {
		return conn, nil
	}
	if err := c.probe(ctx, conn); err != nil {
		conn.Destroy()
		return nil, err
	}
	if err := checkPinned(ctx, c.pool, conn); err != nil {
		conn.Destroy()
		return nil, err
	}
	sessions.Set(c.pool)
	return conn, nil
}

func millis(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) + "ms" }

// setup sets up the session (setupSQL). Its two values, numbers of milliseconds, are written
// into the text: a statement without parameters is one round trip and one transaction with
// every driver, where a prepared one is two.
func (c *Conn) setup(ctx context.Context, conn dbx.Conn) error {
	if _, err := conn.Exec(ctx, fmt.Sprintf(setupSQL, millis(c.opt.LockTimeout), millis(c.opt.StatementTimeout))); err != nil {
		return fmt.Errorf("advisory: set up the lock connection: %w", err)
	}
	return nil
}

// probe is the first half of the session check (A5): the backend's pid, a probe lock, then
// the pid again and the lock as pg_locks shows it, from a separate statement.
func (c *Conn) probe(ctx context.Context, conn dbx.Conn) error {
	var pid1, pid2 int64
	var took, seen, dropped bool
	if err := dbx.QueryRow(ctx, conn, pidSQL, nil, &pid1); err != nil {
		return fmt.Errorf("advisory: check the lock connection: %w", err)
	}
	key2 := int32(pid1)
	if err := dbx.QueryRow(ctx, conn, probeLockSQL, []any{ProbeKey1, key2}, &took); err != nil {
		return fmt.Errorf("advisory: check the lock connection: %w", err)
	}
	if err := dbx.QueryRow(ctx, conn, probeSeeSQL, []any{ProbeKey1, key2}, &pid2, &seen); err != nil {
		return fmt.Errorf("advisory: check the lock connection: %w", err)
	}
	if took {
		if err := dbx.QueryRow(ctx, conn, probeUnlockSQL, []any{ProbeKey1, key2}, &dropped); err != nil {
			return fmt.Errorf("advisory: check the lock connection: %w", err)
		}
	}
	if !took || pid1 != pid2 || !seen || !dropped {
		return fmt.Errorf("%w (backend pid %d then %d, probe lock taken %t, seen by the next statement %t, released %t)",
			ErrNotSessionConnection, pid1, pid2, took, seen, dropped)
	}
	return nil
}

// stmtContext bounds one statement on the lock connection on the client side, well past the
// server's own bound. It never derives from a caller's context: a cancel while a driver runs
// a query closes the connection and drops every lock.
func (c *Conn) stmtContext() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), c.opt.StatementTimeout+clientTimeoutAfter)
}

func (c *Conn) stopped() bool { return c.opt.Stop != nil && c.opt.Stop.Err() != nil }

// take waits for the connection's turn: one statement at a time.
func (c *Conn) take() { c.turn <- struct{}{} }

// give ends a turn. When CloseContext gave up waiting for it, the connection is closed now.
func (c *Conn) give() {
	c.mu.Lock()
	var drop dbx.Conn
	if c.abandoned && c.conn != nil {
		drop = c.conn
		c.conn = nil
		c.gen++
		clear(c.held)
		c.deferred = c.deferred[:0]
	}
	c.mu.Unlock()
	if drop != nil {
		drop.Destroy()
		c.giveRoom()
	}
	<-c.turn
}

// turnOn opens the connection again if it was lost, takes a turn on it, and returns it with
// its generation; on an error the turn is given back.
func (c *Conn) turnOn() (dbx.Conn, uint64, error) {
	if err := c.ensure(); err != nil {
		return nil, 0, err
	}
	c.take()
	conn, gen, err := c.current()
	if err != nil {
		c.give()
	}
	return conn, gen, err
}

// current is the open connection and its generation; the turn is held.
func (c *Conn) current() (dbx.Conn, uint64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		return nil, 0, ErrClosed
	case c.conn == nil:
		return nil, 0, ErrDisconnected
	}
	return c.conn, c.gen, nil
}

// statement runs fn, one statement on conn, under the client-side last resort only. With a
// stop context, stop ending while fn runs cancels the statement on the server and awaits
// fn's end (dbx.RunOn: the request is sent again every cancelRepeat until fn returns); the
// error of a statement the server ended for it wraps ErrCancelled. The turn is held.
func (c *Conn) statement(stop context.Context, conn dbx.Conn, fn func(ctx context.Context) error) error {
	ctx, cancel := c.stmtContext()
	defer cancel()
	var err error
	if stop == nil {
		err = fn(ctx)
	} else {
		ran := false
		var cancelled bool
		cancelled, err = dbx.RunOn(stop, loggedCancel{Conn: conn, logger: c.opt.Logger}, cancelRepeat, func() error {
			ran = true
			return fn(ctx)
		})
		switch {
		case !ran:
			return ErrStopped // stop had ended: the statement did not start
		case cancelled:
			err = fmt.Errorf("%w: %w", ErrCancelled, err)
		}
	}
	if err == nil {
		c.lastOK.Store(time.Now().UnixNano())
	}
	return err
}

// loggedCancel is the lock connection as statement's cancel requests go out on it: a request
// that could not be sent is logged.
type loggedCancel struct {
	dbx.Conn
	logger watermill.LoggerAdapter
}

func (l loggedCancel) Cancel(ctx context.Context) (bool, error) {
	closes, err := l.Conn.Cancel(ctx)
	if err != nil {
		l.logger.Debug("Cancel request for the lock connection's statement failed", watermill.LogFields{"err": err.Error()})
	}
	return closes, err
}

// failed deals with a statement on conn that failed with err; the turn is held. A statement
// the server ended leaves a live connection: the locks the statement may have taken are found
// and dropped (reconcile), and nothing is lost. Otherwise, or when that fails too, the
// connection is closed and the locks it held are returned as lost, for report.
func (c *Conn) failed(conn dbx.Conn, err error) []int64 {
	if dbx.StatementFailed(err) {
		rerr := c.reconcile(conn)
		if rerr == nil {
			return nil
		}
		err = fmt.Errorf("%w (then, finding the locks it left: %w)", err, rerr)
	}
	return c.lose(conn, err)
}

// reconcile drops the locks this session holds under Key1 that the bookkeeping does not: a
// statement that failed may have taken some before it failed, and a session lock stays
// through the statement's rollback. The turn is held.
func (c *Conn) reconcile(conn dbx.Conn) error {
	c.mu.Lock()
	keep := make([]int64, 0, len(c.held))
	for o := range c.held {
		keep = append(keep, int64(Key2(o)))
	}
	c.mu.Unlock()
	dropped := 0
	var err error
	for range 3 { // again after a lock held twice, or a stray cancel meeting this statement
		var n int
		n, err = c.dropStray(conn, keep)
		if err != nil && !dbx.StatementFailed(err) {
			return err
		}
		dropped += n
		if err == nil && n == 0 {
			break
		}
	}
	if err != nil {
		return err
	}
	if dropped > 0 {
		c.opt.Logger.Info("A failed statement on the lock connection left locks the subscriber does not hold; released them",
			watermill.LogFields{"key1": c.opt.Key1, "locks": dropped})
	}
	return nil
}

func (c *Conn) dropStray(conn dbx.Conn, keep []int64) (int, error) {
	ctx, cancel := c.stmtContext()
	defer cancel()
	rows, err := conn.Query(ctx, reconcileSQL, c.opt.Key1, keep)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var k int64
		var ok bool
		if err := rows.Scan(&k, &ok); err != nil {
			return n, err
		}
		if ok {
			n++
		}
	}
	return n, rows.Err()
}

// lose closes a connection that failed: PostgreSQL frees every lock the session held. It
// returns the offsets whose locks were lost, for report to hand to OnLost. The turn is held.
func (c *Conn) lose(conn dbx.Conn, err error) []int64 {
	c.mu.Lock()
	if c.conn != conn || conn == nil {
		c.mu.Unlock()
		return nil
	}
	c.conn = nil
	c.gen++
	lost := make([]int64, 0, len(c.held))
	for o := range c.held {
		lost = append(lost, o)
	}
	clear(c.held)
	c.deferred = c.deferred[:0]
	c.mu.Unlock()
	c.opt.Logger.Error("Lock connection failed; every lock it held is gone, reconnecting", err,
		watermill.LogFields{"key1": c.opt.Key1, "locks_lost": len(lost)})
	conn.Destroy()
	return lost
}

func (c *Conn) report(lost []int64) {
	if len(lost) > 0 && c.opt.OnLost != nil {
		c.opt.OnLost(lost)
	}
}

// ensure opens the connection if it is not open (never yet, see Options.Lazy, or lost),
// unless the owner has stopped.
func (c *Conn) ensure() error {
	c.mu.Lock()
	up, closed := c.conn != nil, c.closed
	c.mu.Unlock()
	if up {
		return nil
	}
	if closed {
		return ErrClosed
	}
	if c.stopped() {
		return ErrStopped
	}
	c.dialMu.Lock()
	defer c.dialMu.Unlock()
	c.mu.Lock()
	up, closed = c.conn != nil, c.closed
	c.mu.Unlock()
	if up {
		return nil
	}
	if closed {
		return ErrClosed
	}
	parent := c.opt.Stop
	if parent == nil {
		parent = context.Background()
	}
	ctx, cancel := context.WithTimeout(parent, dbx.CleanupTimeout)
	conn, err := c.dial(ctx)
	cancel()
	if err != nil {
		if c.stopped() {
			return ErrStopped
		}
		return fmt.Errorf("%w: %w", ErrDisconnected, err)
	}
	c.mu.Lock()
	if c.closed || c.stopped() {
		c.mu.Unlock()
		conn.Destroy()
		return ErrStopped
	}
	c.conn = conn
	first := !c.opened
	c.opened = true
	if !first {
		c.reconnects++
	}
	c.mu.Unlock()
	c.lastOK.Store(time.Now().UnixNano())
	if first {
		c.opt.Logger.Debug("Lock connection opened", watermill.LogFields{"key1": c.opt.Key1})
	} else {
		c.opt.Logger.Info("Lock connection opened again", watermill.LogFields{"key1": c.opt.Key1})
	}
	return nil
}

// Check pings the connection, or opens it again when it is down. A failed ping loses the
// connection (A3).
func (c *Conn) Check() error {
	if err := c.ensure(); err != nil {
		return err
	}
	conn, _, err := c.turnOn()
	if err != nil {
		return nil // closed, or lost since the reconnect: nothing to ping
	}
	err = c.statement(nil, conn, func(ctx context.Context) error {
		_, err := conn.Exec(ctx, pingSQL)
		return err
	})
	var lost []int64
	if err != nil {
		lost = c.failed(conn, err)
	}
	c.give()
	c.report(lost)
	return err
}

// needsCheck says whether Run pings now: a lost connection is opened again at every
// CheckInterval (one never opened is left to the first statement that needs it); one that
// holds locks is pinged unless a statement succeeded on it within the last half CheckInterval
// (a busy connection needs no ping); one that holds none only every IdleCheckInterval.
func (c *Conn) needsCheck() bool {
	c.mu.Lock()
	down, held, opened := c.conn == nil, len(c.held), c.opened
	c.mu.Unlock()
	if down {
		return opened
	}
	since := time.Since(time.Unix(0, c.lastOK.Load()))
	if held == 0 {
		return since >= c.opt.IdleCheckInterval-c.opt.CheckInterval/2
	}
	return since >= c.opt.CheckInterval/2
}

// Run checks the connection (see needsCheck) every CheckInterval until stop is closed or the
// Conn is closed.
func (c *Conn) Run(stop <-chan struct{}) {
	t := time.NewTicker(c.opt.CheckInterval)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-c.closing:
			return
		case <-t.C:
		}
		c.mu.Lock()
		closed := c.closed
		c.mu.Unlock()
		if closed || !c.needsCheck() {
			if closed {
				return
			}
			continue
		}
		if err := c.Check(); err != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrStopped) {
			c.opt.Logger.Debug("Lock connection check failed", watermill.LogFields{"err": err.Error()})
		}
	}
}
