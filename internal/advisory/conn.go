package advisory

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// ErrNotSessionConnection says that the database connection does not behave as one server
// session: most likely a transaction-mode pooler (PgBouncer with pool_mode = transaction) sits
// in between. Session advisory locks cannot work there (A5).
var ErrNotSessionConnection = errors.New("advisory: the connection is not a PostgreSQL session of its own " +
	"(a transaction-mode pooler such as PgBouncer with pool_mode = transaction?): " +
	"the advisory-lock claim mode needs session connections; connect to PostgreSQL directly or through a session-mode pooler, or use the lease claim mode")

// ErrDisconnected is returned by TryLock while the lock connection is down and could not be
// opened again.
var ErrDisconnected = errors.New("advisory: the lock connection is down")

// ErrClosed is returned by TryLock after Close.
var ErrClosed = errors.New("advisory: the lock connection is closed")

// ErrStopped is returned once Options.Stop is done: the Conn runs no statement for its
// owner's claims any more and never opens the connection again.
var ErrStopped = errors.New("advisory: the lock connection's owner has stopped")

// ErrCancelled wraps the server's error for a statement that was cancelled on the server
// because Options.Stop ended while it ran.
var ErrCancelled = errors.New("advisory: the statement was cancelled on the server as its owner stopped")

// ErrPoolTooSmall is returned by Open when a lock connection would leave a bounded pool
// (a *sql.DB with SetMaxOpenConns) too few connections for the other statements of its
// users. The error says how many connections the pool needs.
var ErrPoolTooSmall = dbx.ErrPoolTooSmall

// Defaults of Options.
const (
	DefaultLockTimeout      = 2 * time.Second
	DefaultStatementTimeout = 30 * time.Second
	DefaultIdleChecks       = 30
)

// clientTimeoutAfter is how long past its StatementTimeout a statement may run before the
// client gives up on it. The server ends every statement by then; one that has not returned
// has lost its network, and closing the connection is all that is left.
const clientTimeoutAfter = 30 * time.Second

// cancelRepeat is how often a cancel request is sent again while the statement it is for
// still runs (the first may reach the server before the statement did).
const cancelRepeat = 100 * time.Millisecond

// CloseGrace is how long CloseContext goes on waiting, after its context ended, for a
// statement still running on the connection (cancelled on the server when it belongs to a
// stopped owner) before it gives up on it.
const CloseGrace = time.Second

// Options configure a Conn.
type Options struct {
	// Key1 is the first half of every key this Conn locks (see Key1).
	Key1 int32
	// CheckInterval is how often a connection that holds locks is pinged when no other
	// statement succeeded on it meanwhile, and how often a lost one is opened again.
	CheckInterval time.Duration
	// IdleCheckInterval is how often a connection that holds no lock is pinged: its loss
	// loses nothing, and the next statement on it opens it again. Defaults to
	// DefaultIdleChecks CheckIntervals.
	IdleCheckInterval time.Duration
	// LockTimeout is the session's lock_timeout: how long a statement waits for a table or
	// row lock another session holds before the server ends it. Defaults to
	// DefaultLockTimeout.
	LockTimeout time.Duration
	// StatementTimeout is the session's statement_timeout. Defaults to
	// DefaultStatementTimeout, and is never less than LockTimeout.
	StatementTimeout time.Duration
	// Stop, when done, says that the owner takes no more claims: the connection is never
	// opened again, and a statement that was given Stop (TryLock, Claim, Query) is cancelled
	// on the server and awaited. Settlements' unlocks and Close still run. Nil: never.
	Stop context.Context
	// OnLost is called with the offsets whose locks were lost when the connection failed. It
	// is called without any lock of the Conn held, and may call the Conn.
	OnLost func(offsets []int64)
	// Logger logs losses, reconnects and bugs.
	Logger watermill.LoggerAdapter
}

// Conn is one session connection that holds the advisory locks of one consumer group's
// claims, with the set of keys it holds. It is safe for concurrent use: statements on the
// connection run one at a time, and reading its state (Held, Gen) never waits for them.
//
// Every statement is bounded by the server (the session's lock_timeout and
// statement_timeout), never by a client-side timeout that would close the session and drop
// its locks; a client-side bound well past the server's is kept only for a connection whose
// network is gone. A statement the server ended with an error leaves the connection as it
// was, except for locks the statement took before it failed (session advisory locks ignore
// rollback): the Conn then reads the session's locks from pg_locks and drops those its
// bookkeeping does not hold. Only a connection that really failed loses its locks.
type Conn struct {
	pool dbx.Pool
	opt  Options

	dialMu sync.Mutex    // one (re)connect at a time
	turn   chan struct{} // held by the one statement running on conn

	mu         sync.Mutex // guards the fields below; never held across a statement
	conn       dbx.Conn   // nil while disconnected
	gen        uint64     // incremented every time the connection is lost
	held       map[int64]uint64
	closed     bool
	abandoned  bool // CloseContext gave up on a running statement: its end closes conn
	reconnects int

	closing chan struct{} // closed when CloseContext starts: Run returns at once

	lastOK atomic.Int64 // UnixNano of the last statement that succeeded on the connection
}

// Open opens the lock connection and checks that it is a session connection of its own (A5).
// ctx bounds the connect.
func Open(ctx context.Context, pool dbx.Pool, opt Options) (*Conn, error) {
	if opt.Logger == nil {
		opt.Logger = watermill.NopLogger{}
	}
	if opt.CheckInterval <= 0 {
		opt.CheckInterval = time.Second
	}
	if opt.IdleCheckInterval <= 0 {
		opt.IdleCheckInterval = DefaultIdleChecks * opt.CheckInterval
	}
	if opt.LockTimeout <= 0 {
		opt.LockTimeout = DefaultLockTimeout
	}
	if opt.StatementTimeout <= 0 {
		opt.StatementTimeout = DefaultStatementTimeout
	}
	opt.StatementTimeout = max(opt.StatementTimeout, opt.LockTimeout)
	c := &Conn{pool: pool, opt: opt, turn: make(chan struct{}, 1), gen: 1, held: map[int64]uint64{}, closing: make(chan struct{})}
	conn, err := c.dial(ctx)
	if err != nil {
		return nil, err
	}
	c.conn = conn
	c.lastOK.Store(time.Now().UnixNano())
	return c, nil
}

// dial opens a dedicated connection, sets up its session and checks it.
func (c *Conn) dial(ctx context.Context) (dbx.Conn, error) {
	conn, err := c.pool.Dedicated(ctx)
	if err != nil {
		return nil, fmt.Errorf("advisory: open the lock connection: %w", err)
	}
	if err := c.setup(ctx, conn); err != nil {
		conn.Destroy()
		return nil, err
	}
	if err := checkPinned(ctx, c.pool, conn); err != nil {
		conn.Destroy()
		return nil, err
	}
	return conn, nil
}

func millis(d time.Duration) string { return strconv.FormatInt(d.Milliseconds(), 10) + "ms" }

func (c *Conn) setup(ctx context.Context, conn dbx.Conn) error {
	if _, err := conn.Exec(ctx, setupSQL, millis(c.opt.LockTimeout), millis(c.opt.StatementTimeout)); err != nil {
		return fmt.Errorf("advisory: set up the lock connection: %w", err)
	}
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

// Gen is the connection's generation: it changes every time the connection is lost. Locks
// taken under an older generation are gone.
func (c *Conn) Gen() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen
}

// Held is the number of locks the connection holds now. It never waits for a statement.
func (c *Conn) Held() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.held)
}

// Reconnects is how many times the connection was opened again after a loss.
func (c *Conn) Reconnects() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.reconnects
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
	}
	c.mu.Unlock()
	if drop != nil {
		drop.Destroy()
	}
	<-c.turn
}

// current is the open connection and its generation; the turn is held.
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
// stop context, stop ending while fn runs sends the server a cancel request for it (again
// every cancelRepeat until fn returns), and fn's end is awaited; cancelled says that the
// server ended the statement for it. The turn is held.
func (c *Conn) statement(stop context.Context, conn dbx.Conn, fn func(ctx context.Context) error) (cancelled bool, err error) {
	ctx, cancel := c.stmtContext()
	defer cancel()
	defer func() {
		if err == nil {
			c.lastOK.Store(time.Now().UnixNano())
		}
	}()
	if stop == nil {
		return false, fn(ctx)
	}
	if stop.Err() != nil {
		return false, ErrStopped
	}
	var sent atomic.Bool
	finished, done := make(chan struct{}), make(chan struct{})
	after := context.AfterFunc(stop, func() {
		defer close(done)
		t := time.NewTicker(cancelRepeat)
		defer t.Stop()
		for {
			cctx, ccancel := dbx.CleanupContext(context.Background())
			_, cerr := conn.Cancel(cctx)
			ccancel()
			if cerr == nil {
				sent.Store(true)
			} else {
				c.opt.Logger.Debug("Cancel request for the lock connection's statement failed", watermill.LogFields{"err": cerr.Error()})
			}
			select {
			case <-finished:
				return
			case <-t.C:
			}
		}
	})
	err = fn(ctx)
	close(finished)
	if !after() {
		<-done
	}
	if err != nil && sent.Load() && dbx.SQLState(err) == dbx.CodeQueryCanceled {
		return true, fmt.Errorf("%w: %w", ErrCancelled, err)
	}
	return false, err
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
	gen, err := c.locking(stop, func(held map[int64]uint64) []int64 {
		try := make([]int64, 0, len(offsets))
		for _, o := range offsets {
			if _, ok := held[o]; !ok {
				try = append(try, o)
			}
		}
		return try
	}, func(ctx context.Context, q dbx.Querier, try []int64) ([]int64, error) {
		if len(try) == 0 {
			return nil, nil
		}
		var err error
		locked, err = dbx.ScanInt64s(q.Query(ctx, tryLockSQL, c.opt.Key1, try))
		return locked, err
	})
	if err != nil {
		return nil, 0, err
	}
	return locked, gen, nil
}

// Claim runs claim on the lock connection, with the offsets whose locks the connection holds
// already (claim must not lock those again: session locks are re-entrant). claim locks the
// offsets it returns in the statement that claims them (offsets.Store.ClaimLocked), so a claim
// becomes visible to others only with its lock held. Claim returns the generation the locks
// were taken under. A claim that fails takes nothing: locks its statement took before it
// failed are dropped again. stop ending cancels the statement on the server (see
// Options.Stop); the error then wraps ErrCancelled.
func (c *Conn) Claim(stop context.Context, claim func(ctx context.Context, q dbx.Querier, held []int64) ([]int64, error)) (uint64, error) {
	return c.locking(stop, func(held map[int64]uint64) []int64 {
		out := make([]int64, 0, len(held))
		for o := range held {
			out = append(out, o)
		}
		return out
	}, claim)
}

// locking runs one statement that takes locks: args builds its argument from the bookkeeping,
// fn runs it and returns the offsets it locked, which are then held under the generation
// returned.
func (c *Conn) locking(stop context.Context, args func(held map[int64]uint64) []int64,
	fn func(ctx context.Context, q dbx.Querier, arg []int64) ([]int64, error)) (uint64, error) {
	conn, gen, err := c.turnOn()
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	arg := args(c.held)
	c.mu.Unlock()
	var locked []int64
	_, err = c.statement(stop, conn, func(ctx context.Context) error {
		var err error
		locked, err = fn(ctx, conn, arg)
		return err
	})
	if err != nil {
		lost := c.failed(conn, err)
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
	_, err = c.statement(stop, conn, func(ctx context.Context) error { return fn(ctx, conn) })
	var lost []int64
	if err != nil {
		lost = c.failed(conn, err)
	}
	c.give()
	c.report(lost)
	return err
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
	_, err := c.statement(nil, conn, func(ctx context.Context) error {
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
	for _, o := range refused {
		c.opt.Logger.Error("BUG: advisory unlock returned false for a lock the subscriber's bookkeeping says it held",
			errors.New("advisory: unlock of a lock not held"),
			watermill.LogFields{"key1": c.opt.Key1, "offset": o, "key2": Key2(o)})
	}
	return len(confirmed), nil, nil
}

// ensure opens the connection again if it was lost, unless the owner has stopped.
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
	c.reconnects++
	c.mu.Unlock()
	c.lastOK.Store(time.Now().UnixNano())
	c.opt.Logger.Info("Lock connection opened again", watermill.LogFields{"key1": c.opt.Key1})
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
	_, err = c.statement(nil, conn, func(ctx context.Context) error {
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
// CheckInterval; one that holds locks is pinged unless a statement succeeded on it within the
// last half CheckInterval (a busy connection needs no ping); one that holds none only every
// IdleCheckInterval.
func (c *Conn) needsCheck() bool {
	c.mu.Lock()
	down, held := c.conn == nil, len(c.held)
	c.mu.Unlock()
	if down {
		return true
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

// Close is CloseContext without a bound.
func (c *Conn) Close() (released int, closed bool) {
	released, closed, _ = c.CloseContext(context.Background())
	return released, closed
}

// CloseContext drops every lock the connection holds and closes it. It returns how many locks
// it dropped (PostgreSQL confirmed each) and whether it closed an open connection. No
// statement starts once it has begun; it waits for the one running, if any, until ctx ends
// and then for CloseGrace more (a statement of a stopped owner is being cancelled on the
// server meanwhile); past that it gives up and returns an error: the connection, and the locks
// on it, then go when that statement ends. Later calls do nothing and return 0, false, nil.
func (c *Conn) CloseContext(ctx context.Context) (released int, closed bool, err error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, false, nil
	}
	c.closed = true // no statement starts from now on, and no reconnect
	c.mu.Unlock()
	close(c.closing)
	select {
	case c.turn <- struct{}{}:
	case <-ctx.Done():
		t := time.NewTimer(CloseGrace)
		defer t.Stop()
		select {
		case c.turn <- struct{}{}:
		case <-t.C:
			c.mu.Lock()
			c.abandoned = true
			held := len(c.held)
			c.mu.Unlock()
			// The statement may have ended between the timer and the flag: try once more.
			select {
			case c.turn <- struct{}{}:
			default:
				return 0, false, fmt.Errorf("advisory: a statement still runs on the lock connection; the connection and its %d locks go when it ends: %w", held, ctx.Err())
			}
		}
	}
	c.dialMu.Lock() // a reconnect that began before closed was set has finished
	c.dialMu.Unlock()
	c.mu.Lock()
	conn := c.conn
	all := make([]int64, 0, len(c.held))
	for o := range c.held {
		all = append(all, o)
	}
	c.mu.Unlock()
	if conn == nil {
		<-c.turn
		return 0, false, nil
	}
	n, lost, uerr := c.unlock(conn, all)
	if uerr != nil {
		c.opt.Logger.Error("Releasing locks at close failed; closing the connection frees them", uerr,
			watermill.LogFields{"key1": c.opt.Key1, "locks": len(all)})
	}
	c.mu.Lock()
	open := c.conn == conn
	if open {
		c.conn = nil
	}
	clear(c.held)
	c.mu.Unlock()
	if open {
		conn.Destroy()
	}
	<-c.turn
	c.report(lost)
	return n, true, nil
}
