package dbx

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/lib/pq"
)

// stdQuerier is what *sql.DB, *sql.Conn and *sql.Tx have in common.
type stdQuerier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

type stdQ struct{ q stdQuerier }

// stdArgs converts the slice arguments the library passes into values database/sql drivers
// accept: pgx takes Go slices for array parameters, lib/pq needs its array wrappers.
func stdArgs(args []any) []any {
	for i, a := range args {
		switch v := a.(type) {
		case []int64:
			args[i] = pq.Array(v)
		case []string:
			args[i] = pq.Array(v)
		case [][]byte:
			args[i] = pq.ByteaArray(v)
		}
	}
	return args
}

func (s stdQ) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	res, err := s.q.ExecContext(ctx, query, stdArgs(args)...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

func (s stdQ) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	rows, err := s.q.QueryContext(ctx, query, stdArgs(args)...)
	if err != nil {
		return nil, err
	}
	return stdRows{rows}, nil
}

type stdRows struct{ r *sql.Rows }

func (r stdRows) Next() bool             { return r.r.Next() }
func (r stdRows) Scan(dest ...any) error { return r.r.Scan(dest...) }
func (r stdRows) Err() error             { return r.r.Err() }
func (r stdRows) Close()                 { _ = r.r.Close() }

type stdTx struct {
	stdQ
	tx *sql.Tx
}

func (t stdTx) Commit(context.Context) error   { return t.tx.Commit() }
func (t stdTx) Rollback(context.Context) error { return t.tx.Rollback() }

// StdTx wraps a caller's database/sql transaction.
func StdTx(tx *sql.Tx) Querier { return stdQ{tx} }

// StdPool wraps a *sql.DB.
type StdPool struct {
	stdQ
	DB   *sql.DB
	prep *stmtCache // set by NewStdPoolPrepared
}

// NewStdPool wraps db.
func NewStdPool(db *sql.DB) *StdPool { return &StdPool{stdQ: stdQ{db}, DB: db} }

// NewStdPoolPrepared wraps db, whose statements with arguments on a connection taken from it
// (Acquire, Dedicated: the library's claims, settlements and publishing) are prepared once per
// connection and run as prepared (see stdprep.go). Not behind a transaction-mode pooler.
func NewStdPoolPrepared(db *sql.DB) *StdPool {
	p := NewStdPool(db)
	p.prep = newStmtCache()
	return p
}

// Prepared reports whether the pool prepares its statements per connection.
func (p *StdPool) Prepared() bool { return p.prep != nil }

func (p *StdPool) Driver() string   { return "database/sql" }
func (p *StdPool) Dialect() Dialect { return Postgres }

func (p *StdPool) Begin(ctx context.Context) (Tx, error) {
	tx, err := p.DB.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	return stdTx{stdQ{tx}, tx}, nil
}

func (p *StdPool) Acquire(ctx context.Context) (Conn, error) {
	c, err := p.DB.Conn(ctx)
	if err != nil {
		return nil, err
	}
	return &stdConn{stdQ: stdQ{c}, c: c, prep: p.prep}, nil
}

// Dedicated takes a connection from the *sql.DB: database/sql has no way to open one outside
// its pool, so the connection counts against SetMaxOpenConns until it is destroyed. On a
// bounded pool it refuses, with ErrPoolTooSmall, a connection that would leave fewer than
// StdSpareConns for everything else: dedicated connections are kept for long (a lock
// connection for the life of its subscription), and a pool they fill starves every other
// statement without an error anywhere.
//
// Its statements run under the caller's context as they are: nothing cancels them on the side
// (a client-side cancel would make lib/pq close the connection, and a lock connection with
// it). Cancel asks the server, through another connection of the pool, to cancel the
// statement running now (pg_cancel_backend): the statement returns the server's error and the
// connection stays usable.
func (p *StdPool) Dedicated(ctx context.Context) (Conn, error) {
	release, err := reserveDedicated(p.DB)
	if err != nil {
		return nil, err
	}
	c, err := p.dedicated(ctx, release)
	if err != nil {
		release()
	}
	return c, err
}

// ReserveDedicated holds room in a bounded *sql.DB for one dedicated connection (Reserver).
func (p *StdPool) ReserveDedicated() (release func(), err error) { return reserveDedicated(p.DB) }

// DedicatedReserved is Dedicated in room held by ReserveDedicated (Reserver).
func (p *StdPool) DedicatedReserved(ctx context.Context) (Conn, error) { return p.dedicated(ctx, nil) }

// dedicated takes the connection of Dedicated; unreserve, if not nil, is called when it is
// destroyed.
func (p *StdPool) dedicated(ctx context.Context, unreserve func()) (Conn, error) {
	c, err := p.DB.Conn(ctx)
	if err != nil {
		return nil, err
	}
	sc := &stdConn{stdQ: stdQ{c}, c: c, untracked: true, pool: p.DB, prep: p.prep}
	if _, err := sc.PID(ctx); err != nil {
		sc.Destroy()
		return nil, err
	}
	sc.unreserve = unreserve
	return sc, nil
}

// StdSpareConns is how many connections of a bounded *sql.DB dedicated connections always
// leave to the other statements of the library (settlements, releases, publishing) and to
// the application: one long statement or transaction elsewhere then never stalls them all.
const StdSpareConns = 2

// ErrPoolTooSmall says that a bounded pool has no room for another dedicated connection.
var ErrPoolTooSmall = errors.New("the pool is too small for another lock connection")

// dedicated counts the dedicated connections open on each *sql.DB, across every user of it
// in the process.
var dedicated = struct {
	sync.Mutex
	n map[*sql.DB]int
}{n: map[*sql.DB]int{}}

// reserveDedicated counts one more dedicated connection of db, if a bounded db has room for
// it, and returns the function that counts it out.
func reserveDedicated(db *sql.DB) (func(), error) {
	dedicated.Lock()
	defer dedicated.Unlock()
	held := dedicated.n[db]
	if max := db.Stats().MaxOpenConnections; max > 0 && held+1+StdSpareConns > max {
		return nil, fmt.Errorf("%w: the *sql.DB allows %d open connections (SetMaxOpenConns) and %d of them are kept by advisory-lock subscriptions, one each, for their locks; "+
			"another subscription needs one more of its own and %d left for the statements of all of them (acks, nacks, releases, publishing): "+
			"raise SetMaxOpenConns to at least %d, or pass a pgx pool (its lock connections are opened outside the pool), or use the lease claim mode",
			ErrPoolTooSmall, max, held, StdSpareConns, held+1+StdSpareConns)
	}
	dedicated.n[db] = held + 1
	var once sync.Once
	return func() {
		once.Do(func() {
			dedicated.Lock()
			defer dedicated.Unlock()
			if dedicated.n[db]--; dedicated.n[db] <= 0 {
				delete(dedicated.n, db)
			}
		})
	}, nil
}

func (p *StdPool) Close() { _ = p.DB.Close() }

type stdConn struct {
	stdQ
	c    *sql.Conn
	pid  uint32
	prep *stmtCache // statements with arguments run prepared (NewStdPoolPrepared)

	untracked bool    // Dedicated: statements run under the caller's context; Cancel goes through pool
	pool      *sql.DB // Dedicated: the pool that sends its cancels
	unreserve func()  // Dedicated: counts it out of the pool's dedicated connections
	mu        sync.Mutex
	running   context.CancelFunc // cancels the statement running now
}

// Exec and Query run under a context of the connection's own, which Cancel cancels: lib/pq
// then sends the server a cancel request and returns the statement's own error, and marks
// the connection bad so that database/sql closes it.
func (c *stdConn) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	ctx, done := c.track(ctx)
	defer done()
	if c.prep != nil && len(args) > 0 {
		_, n, err := c.prep.run(ctx, c.c, query, stdArgs(args), true)
		return n, err
	}
	return c.stdQ.Exec(ctx, query, args...)
}

func (c *stdConn) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	ctx, done := c.track(ctx)
	if c.prep != nil && len(args) > 0 {
		// Read whole before it returns: the statement is over, and so is its context.
		rows, _, err := c.prep.run(ctx, c.c, query, stdArgs(args), false)
		done()
		if err != nil {
			return nil, err
		}
		return rows, nil
	}
	rows, err := c.stdQ.Query(ctx, query, args...)
	if err != nil {
		done()
		return nil, err
	}
	return &trackedRows{Rows: rows, done: done}, nil
}

func (c *stdConn) track(ctx context.Context) (context.Context, func()) {
	if c.untracked {
		return ctx, func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	c.mu.Lock()
	c.running = cancel
	c.mu.Unlock()
	return ctx, func() {
		c.mu.Lock()
		c.running = nil
		c.mu.Unlock()
		cancel()
	}
}

// trackedRows ends the statement's own context when closed. Err after Close is the error
// read before that context ended: database/sql reports a context cancelled after the rows
// were closed as their error when they did not reach their end (one row read of several).
type trackedRows struct {
	Rows
	done   func()
	closed bool
	err    error
}

func (r *trackedRows) Close() {
	if r.closed {
		return
	}
	r.Rows.Close()
	r.err = r.Rows.Err()
	r.closed = true
	r.done()
}

func (r *trackedRows) Err() error {
	if r.closed {
		return r.err
	}
	return r.Rows.Err()
}

func (c *stdConn) Cancel(ctx context.Context) (bool, error) {
	if c.untracked {
		if c.pid == 0 {
			return false, errors.New("dbx: the connection's backend is not known")
		}
		_, err := c.pool.ExecContext(ctx, "SELECT pg_cancel_backend($1)", int64(c.pid))
		return false, err
	}
	c.mu.Lock()
	cancel := c.running
	c.mu.Unlock()
	if cancel == nil {
		return false, nil
	}
	cancel()
	return true, nil
}

func (c *stdConn) Begin(ctx context.Context) (Tx, error) {
	tx, err := c.c.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	if c.untracked {
		return stdTx{stdQ{tx}, tx}, nil
	}
	return stdConnTx{stdTx{stdQ{tx}, tx}, c}, nil
}

// stdConnTx is a transaction on a tracked connection: its statements run under the
// connection's own context too, so that Cancel reaches them.
type stdConnTx struct {
	stdTx
	c *stdConn
}

func (t stdConnTx) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	ctx, done := t.c.track(ctx)
	defer done()
	return t.stdTx.Exec(ctx, query, args...)
}

func (t stdConnTx) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	ctx, done := t.c.track(ctx)
	rows, err := t.stdTx.Query(ctx, query, args...)
	if err != nil {
		done()
		return nil, err
	}
	return &trackedRows{Rows: rows, done: done}, nil
}

// pids remembers the backend pid of each driver connection database/sql has handed out, so
// that asking costs one round trip per physical connection, not per use. database/sql does
// not say when it closes a connection on its own (idle time, lifetime, an error elsewhere),
// and each entry keeps its driver connection from being collected: past maxPIDs entries the
// map starts anew, and the connections still open are asked once more.
var (
	pids  sync.Map // driver connection -> uint32
	npids atomic.Int64
)

const maxPIDs = 512

func (c *stdConn) PID(ctx context.Context) (uint32, error) {
	if c.pid != 0 {
		return c.pid, nil
	}
	pid, err := cachedPID(ctx, c.c, c, "SELECT pg_backend_pid()")
	c.pid = pid
	return pid, err
}

// cachedPID is the server's id of the driver connection under c: remembered in pids, or read
// with sql (one bigint) through q, a querier of c, and remembered.
func cachedPID(ctx context.Context, c *sql.Conn, q Querier, sql string) (uint32, error) {
	var key any
	_ = c.Raw(func(dc any) error { key = dc; return nil })
	if v, ok := pids.Load(key); ok && key != nil {
		return v.(uint32), nil
	}
	var id int64
	if err := QueryRow(ctx, q, sql, nil, &id); err != nil {
		return 0, err
	}
	pid := uint32(id)
	if key != nil {
		if _, had := pids.LoadOrStore(key, pid); !had && npids.Add(1) > maxPIDs {
			pids.Clear()
			npids.Store(0)
		}
	}
	return pid, nil
}

func (c *stdConn) Release() {
	if c.untracked {
		c.Destroy() // a dedicated connection never goes back to the pool with its session state
		return
	}
	_ = c.c.Close()
}

// Destroy marks the driver connection bad so that database/sql closes it instead of pooling it.
func (c *stdConn) Destroy() {
	_ = c.c.Raw(func(dc any) error {
		if _, had := pids.LoadAndDelete(dc); had {
			npids.Add(-1)
		}
		if c.prep != nil {
			c.prep.forget(dc)
		}
		return driver.ErrBadConn
	})
	_ = c.c.Close()
	if c.unreserve != nil {
		c.unreserve()
	}
}

// IsBadConn reports whether err says that the connection is gone.
func IsBadConn(err error) bool { return errors.Is(err, driver.ErrBadConn) }

func (p *StdPool) OpenConns() int { return p.DB.Stats().OpenConnections }
