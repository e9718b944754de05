package advisory

import (
	"context"
	"errors"
	"fmt"
	"sync"
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

// Options configure a Conn.
type Options struct {
	// Key1 is the first half of every key this Conn locks (see Key1).
	Key1 int32
	// CheckInterval is how often an idle connection is pinged, and how often a lost one is
	// opened again.
	CheckInterval time.Duration
	// OnLost is called with the offsets whose locks were lost when the connection failed. It
	// is called without any lock of the Conn held, and may call the Conn.
	OnLost func(offsets []int64)
	// Logger logs losses, reconnects and bugs.
	Logger watermill.LoggerAdapter
}

// Conn is one session connection that holds the advisory locks of one consumer group's
// claims, with the set of keys it holds. It is safe for concurrent use: statements on the
// connection run one at a time.
type Conn struct {
	pool dbx.Pool
	opt  Options

	dialMu sync.Mutex // one (re)connect at a time

	mu     sync.Mutex // serialises statements on conn; guards the fields below
	conn   dbx.Conn   // nil while disconnected
	gen    uint64     // incremented every time the connection is lost
	held   map[int64]uint64
	closed bool

	reconnects int
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
	conn, err := dial(ctx, pool)
	if err != nil {
		return nil, err
	}
	return &Conn{pool: pool, opt: opt, conn: conn, gen: 1, held: map[int64]uint64{}}, nil
}

// dial opens a dedicated connection, sets up its session and checks it.
func dial(ctx context.Context, pool dbx.Pool) (dbx.Conn, error) {
	conn, err := pool.Dedicated(ctx)
	if err != nil {
		return nil, fmt.Errorf("advisory: open the lock connection: %w", err)
	}
	if err := setup(ctx, conn); err != nil {
		conn.Destroy()
		return nil, err
	}
	if err := checkPinned(ctx, pool, conn); err != nil {
		conn.Destroy()
		return nil, err
	}
	return conn, nil
}

func setup(ctx context.Context, conn dbx.Conn) error {
	if _, err := conn.Exec(ctx, setupSQL); err != nil {
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

// stmtContext bounds one statement on the lock connection. It never derives from a caller's
// context: a cancel while pgx runs a query would close the connection and drop every lock.
func stmtContext() (context.Context, context.CancelFunc) {
	return dbx.CleanupContext(context.Background())
}

// Gen is the connection's generation: it changes every time the connection is lost. Locks
// taken under an older generation are gone.
func (c *Conn) Gen() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen
}

// Held is the number of locks the connection holds now.
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

// TryLock tries the locks of exactly the given offsets, without waiting, and returns those it
// took together with the generation they were taken under. An offset whose lock this Conn
// already holds is not tried again (session locks are re-entrant, and a second hold would
// outlive the first unlock) and is not returned. An error means no lock was taken: a failed
// statement loses the connection, and with it whatever the statement may have locked.
func (c *Conn) TryLock(offsets []int64) ([]int64, uint64, error) {
	if len(offsets) == 0 {
		return nil, c.Gen(), nil
	}
	if err := c.ensure(); err != nil {
		return nil, 0, err
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, 0, ErrClosed
	}
	if c.conn == nil {
		c.mu.Unlock()
		return nil, 0, ErrDisconnected
	}
	try := make([]int64, 0, len(offsets))
	for _, o := range offsets {
		if _, ok := c.held[o]; !ok {
			try = append(try, o)
		}
	}
	if len(try) == 0 {
		gen := c.gen
		c.mu.Unlock()
		return nil, gen, nil
	}
	ctx, cancel := stmtContext()
	locked, err := dbx.ScanInt64s(c.conn.Query(ctx, tryLockSQL, c.opt.Key1, try))
	cancel()
	if err != nil {
		lost := c.failLocked(err)
		c.mu.Unlock()
		c.report(lost)
		return nil, 0, err
	}
	gen := c.gen
	for _, o := range locked {
		c.held[o] = gen
	}
	c.mu.Unlock()
	return locked, gen, nil
}

// Claim runs claim on the lock connection, with the offsets whose locks the connection holds
// already (claim must not lock those again: session locks are re-entrant). claim locks the
// offsets it returns in the statement that claims them (offsets.Store.ClaimLocked), so a claim
// becomes visible to others only with its lock held. Claim returns the generation the locks
// were taken under. A failed claim loses the connection: locks the statement took before it
// failed stay with the session, and closing the session is the only way to be sure that none
// is left.
func (c *Conn) Claim(claim func(ctx context.Context, q dbx.Querier, held []int64) ([]int64, error)) (uint64, error) {
	if err := c.ensure(); err != nil {
		return 0, err
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, ErrClosed
	}
	if c.conn == nil {
		c.mu.Unlock()
		return 0, ErrDisconnected
	}
	held := make([]int64, 0, len(c.held))
	for o := range c.held {
		held = append(held, o)
	}
	ctx, cancel := stmtContext()
	locked, err := claim(ctx, c.conn, held)
	cancel()
	if err != nil {
		lost := c.failLocked(err)
		c.mu.Unlock()
		c.report(lost)
		return 0, err
	}
	gen := c.gen
	for _, o := range locked {
		c.held[o] = gen
	}
	c.mu.Unlock()
	return gen, nil
}

// Unlock drops the locks of the offsets taken under generation gen and returns how many it
// dropped. Offsets this Conn does not hold under gen (the connection was lost since) are
// skipped. PostgreSQL saying that it did not hold a lock the bookkeeping says it held is a bug,
// and is logged as one.
func (c *Conn) Unlock(offsets []int64, gen uint64) (int, error) {
	c.mu.Lock()
	if c.conn == nil || gen != c.gen {
		c.mu.Unlock()
		return 0, nil
	}
	mine := make([]int64, 0, len(offsets))
	for _, o := range offsets {
		if g, ok := c.held[o]; ok && g == gen {
			mine = append(mine, o)
		}
	}
	n, lost, err := c.unlockLocked(mine)
	c.mu.Unlock()
	c.report(lost)
	return n, err
}

// unlockLocked unlocks offsets the bookkeeping holds; c.mu is held.
func (c *Conn) unlockLocked(offsets []int64) (int, []int64, error) {
	if len(offsets) == 0 {
		return 0, nil, nil
	}
	ctx, cancel := stmtContext()
	defer cancel()
	rows, err := c.conn.Query(ctx, unlockSQL, c.opt.Key1, offsets)
	if err != nil {
		return 0, c.failLocked(err), err
	}
	n := 0
	for rows.Next() {
		var o int64
		var ok bool
		if err := rows.Scan(&o, &ok); err != nil {
			rows.Close()
			return n, c.failLocked(err), err
		}
		delete(c.held, o)
		if ok {
			n++
			continue
		}
		c.opt.Logger.Error("BUG: advisory unlock returned false for a lock the subscriber's bookkeeping says it held",
			errors.New("advisory: unlock of a lock not held"),
			watermill.LogFields{"key1": c.opt.Key1, "offset": o, "key2": Key2(o)})
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return n, c.failLocked(err), err
	}
	return n, nil, nil
}

// failLocked closes a connection that failed: PostgreSQL frees every lock the session held.
// It returns the offsets whose locks were lost, for report to hand to OnLost once c.mu is
// released. c.mu is held.
func (c *Conn) failLocked(err error) []int64 {
	if c.conn == nil {
		return nil
	}
	c.opt.Logger.Error("Lock connection failed; every lock it held is gone, reconnecting", err,
		watermill.LogFields{"key1": c.opt.Key1, "locks_lost": len(c.held)})
	c.conn.Destroy()
	c.conn = nil
	c.gen++
	lost := make([]int64, 0, len(c.held))
	for o := range c.held {
		lost = append(lost, o)
	}
	clear(c.held)
	return lost
}

func (c *Conn) report(lost []int64) {
	if len(lost) > 0 && c.opt.OnLost != nil {
		c.opt.OnLost(lost)
	}
}

// ensure opens the connection again if it was lost.
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
	ctx, cancel := stmtContext()
	conn, err := dial(ctx, c.pool)
	cancel()
	if err != nil {
		return fmt.Errorf("%w: %w", ErrDisconnected, err)
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		conn.Destroy()
		return ErrClosed
	}
	c.conn = conn
	c.reconnects++
	c.mu.Unlock()
	c.opt.Logger.Info("Lock connection opened again", watermill.LogFields{"key1": c.opt.Key1})
	return nil
}

// Check pings the connection, or opens it again when it is down. A failed ping loses the
// connection (A3).
func (c *Conn) Check() error {
	if err := c.ensure(); err != nil {
		return err
	}
	c.mu.Lock()
	if c.conn == nil || c.closed {
		c.mu.Unlock()
		return nil
	}
	ctx, cancel := stmtContext()
	_, err := c.conn.Exec(ctx, pingSQL)
	cancel()
	var lost []int64
	if err != nil {
		lost = c.failLocked(err)
	}
	c.mu.Unlock()
	c.report(lost)
	return err
}

// Run checks the connection every CheckInterval until stop is closed or the Conn is closed.
func (c *Conn) Run(stop <-chan struct{}) {
	t := time.NewTicker(c.opt.CheckInterval)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		c.mu.Lock()
		closed := c.closed
		c.mu.Unlock()
		if closed {
			return
		}
		if err := c.Check(); err != nil && !errors.Is(err, ErrClosed) {
			c.opt.Logger.Debug("Lock connection check failed", watermill.LogFields{"err": err.Error()})
		}
	}
}

// Close drops every lock the connection holds and closes it. It returns how many locks it
// dropped (PostgreSQL confirmed each) and whether it closed an open connection. Later calls
// do nothing and return 0, false.
func (c *Conn) Close() (released int, closed bool) {
	c.dialMu.Lock() // no reconnect in between
	defer c.dialMu.Unlock()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, false
	}
	c.closed = true
	if c.conn == nil {
		c.mu.Unlock()
		return 0, false
	}
	closed = true // by the unlock's failure below, or by Destroy
	all := make([]int64, 0, len(c.held))
	for o := range c.held {
		all = append(all, o)
	}
	n, lost, err := c.unlockLocked(all)
	if err != nil {
		c.opt.Logger.Error("Releasing locks at close failed; closing the connection frees them", err,
			watermill.LogFields{"key1": c.opt.Key1, "locks": len(all)})
	}
	if c.conn != nil {
		c.conn.Destroy()
		c.conn = nil
	}
	clear(c.held)
	c.mu.Unlock()
	c.report(lost)
	return n, closed
}
