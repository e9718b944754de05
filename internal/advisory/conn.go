package advisory

import (
	"context"
	"errors"
	"fmt"
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
	DefaultDeferFlush       = 5 * time.Millisecond
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
	// DeferFlush is how long the locks given to DeferUnlock wait for a Claim to drop them
	// before a statement of their own does. Defaults to DefaultDeferFlush.
	DeferFlush time.Duration
	// Lazy lets Open return without a connection when a lock connection of the same pool has
	// passed the session check before (in this process): the first statement that needs the
	// connection (a claim, a try-lock, a query, Check) opens it then. Until that, the Conn
	// holds no connection and nothing of the server, Run does not ping it, and Opened is
	// false. On a bounded *sql.DB the room for the connection is held from Open on all the
	// same, so that Open fails at once where it would fail later.
	Lazy bool
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
	deferred   []int64 // held offsets whose locks the next statement drops (DeferUnlock)
	flushing   bool    // a flush of deferred is scheduled
	closed     bool
	abandoned  bool // CloseContext gave up on a running statement: its end closes conn
	opened     bool // a connection was open once (see Options.Lazy)
	reconnects int
	unreserve  func() // gives back the room held in a bounded pool (dbx.Reserver); nil without

	closing chan struct{} // closed when CloseContext starts: Run returns at once

	lastOK atomic.Int64 // UnixNano of the last statement that succeeded on the connection
}

// sessions are the pools whose lock connections passed the session check in this process:
// the later lock connections of such a pool are only set up (see dial).
var sessions dbx.PoolFacts

// Open opens the lock connection and checks that it is a session connection of its own (A5),
// or, with Options.Lazy on a pool whose sessions were checked already, returns without
// opening it. ctx bounds the connect.
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
	if opt.DeferFlush <= 0 {
		opt.DeferFlush = DefaultDeferFlush
	}
	opt.StatementTimeout = max(opt.StatementTimeout, opt.LockTimeout)
	c := &Conn{pool: pool, opt: opt, turn: make(chan struct{}, 1), gen: 1, held: map[int64]uint64{}, closing: make(chan struct{})}
	if r, ok := pool.(dbx.Reserver); ok {
		release, err := r.ReserveDedicated()
		if err != nil {
			return nil, fmt.Errorf("advisory: open the lock connection: %w", err)
		}
		var once sync.Once
		c.unreserve = func() { once.Do(release) }
	}
	if opt.Lazy && sessions.Has(pool) {
		return c, nil
	}
	conn, err := c.dial(ctx)
	if err != nil {
		c.giveRoom()
		return nil, err
	}
	c.conn, c.opened = conn, true
	c.lastOK.Store(time.Now().UnixNano())
	return c, nil
}

// Opened reports whether the connection was ever open (see Options.Lazy).
func (c *Conn) Opened() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.opened
}

// giveRoom gives back the room held in a bounded pool, if any.
func (c *Conn) giveRoom() {
	if c.unreserve != nil {
		c.unreserve()
	}
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
				// The room in the pool goes with the connection, when that statement ends (give).
				return 0, false, fmt.Errorf("advisory: a statement still runs on the lock connection; the connection and its %d locks go when it ends: %w", held, ctx.Err())
			}
		}
	}
	c.dialMu.Lock() // a reconnect that began before closed was set has finished
	c.dialMu.Unlock()
	defer c.giveRoom()
	c.mu.Lock()
	conn, gen := c.conn, c.gen
	c.mu.Unlock()
	settled := c.takeDeferred(gen)
	if conn == nil {
		<-c.turn
		return 0, false, nil
	}
	// The locks of settled claims whose drop DeferUnlock left to a later statement are dropped
	// first, and not counted as released by the close. A failure that loses the connection
	// empties the bookkeeping: the unlock below then has nothing to do.
	_, lostSettled, serr := c.unlock(conn, settled)
	if serr != nil {
		c.opt.Logger.Error("Dropping the locks of settled claims at close failed; closing the connection frees them", serr,
			watermill.LogFields{"key1": c.opt.Key1, "locks": len(settled)})
	}
	c.mu.Lock()
	all := make([]int64, 0, len(c.held))
	for o := range c.held {
		all = append(all, o)
	}
	c.mu.Unlock()
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
	c.report(append(lostSettled, lost...))
	return n, true, nil
}
