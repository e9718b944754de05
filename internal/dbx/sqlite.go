package dbx

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
)

// SQLiteBusyTimeoutMS is the busy timeout the library sets on every SQLite connection it uses
// that has none: a writer that finds the database locked by another one waits up to this long
// for its turn instead of failing at once.
const SQLiteBusyTimeoutMS = 5000

// SQLitePool wraps a *sql.DB of the SQLite driver modernc.org/sqlite (registered as "sqlite";
// the program imports the driver, this package does not).
//
// SQLite has one writer at a time. Every transaction the library opens on it begins with
// BEGIN IMMEDIATE, which takes the write lock at once (waiting for it up to the busy
// timeout): a transaction that read first and wrote later could otherwise fail with
// SQLITE_BUSY, without waiting, when another writer committed in between. A write outside a
// transaction (Exec, QueryWrite) passes the process's write gate of the file first; a read
// (Query) passes none.
//
// Every connection is checked once before its first use (see setUp): it must be in WAL mode
// (journal_mode is a property of the file: the library sets it when the file is not), and it
// gets a busy timeout when it has none. Statements run on connections taken from the pool
// (Acquire), so that each passes that check and so that Cancel can interrupt it.
type SQLitePool struct {
	DB *sql.DB

	preset bool      // built by the library with the settings in its DSN: nothing to check
	anchor *sql.Conn // an in-memory database: the connection that keeps it alive

	ready  sync.Map // driver connection -> struct{}: checked and set up
	nready atomic.Int64

	prep *stmtCache // the statements with arguments, prepared once per connection

	gateMu      sync.Mutex
	gate        *writeGate // the database file's, once known
	releaseGate func()     // gives back the pool's reference to gate

	closeOnce sync.Once
}

// writeGate lets one write of the process at a time at a database file: the library's
// writers of one file (every pool on it) queue in the process, in order, instead of polling
// SQLite's lock, where the busy handler's sleeps let a writer that waits long lose its turn
// to newer ones again and again until its busy timeout ends. Writers of other processes
// still meet at SQLite's lock, under the busy timeout.
type writeGate struct{ ch chan struct{} }

func newWriteGate() *writeGate { return &writeGate{ch: make(chan struct{}, 1)} }

func (g *writeGate) lock(ctx context.Context) error {
	select {
	case g.ch <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (g *writeGate) unlock() { <-g.ch }

// gates holds the write gate of each database file that pools of the process use, by
// absolute path, with the number of pools holding it: the last one to let go drops it, so
// that a process that opens and closes many databases (every sqlite::memory: broker has one
// of its own) does not keep a gate for each.
var gates = struct {
	sync.Mutex
	m map[string]*sharedGate
}{m: map[string]*sharedGate{}}

type sharedGate struct {
	g    *writeGate
	refs int
}

// gateOf returns the write gate of the database file path, and the function that gives the
// reference back (once; later calls do nothing); "" (a private in-memory or temporary
// database) gets a gate of its own.
func gateOf(path string) (*writeGate, func()) {
	if path == "" {
		return newWriteGate(), func() {}
	}
	if abs, err := filepath.Abs(path); err == nil {
		path = abs
	}
	gates.Lock()
	defer gates.Unlock()
	sg := gates.m[path]
	if sg == nil {
		sg = &sharedGate{g: newWriteGate()}
		gates.m[path] = sg
	}
	sg.refs++
	var once sync.Once
	return sg.g, func() {
		once.Do(func() {
			gates.Lock()
			defer gates.Unlock()
			if sg.refs--; sg.refs == 0 && gates.m[path] == sg {
				delete(gates.m, path)
			}
		})
	}
}

// SQLiteGatePaths lists the database files whose write gates the process keeps.
func SQLiteGatePaths() []string {
	gates.Lock()
	defer gates.Unlock()
	out := make([]string, 0, len(gates.m))
	for p := range gates.m {
		out = append(out, p)
	}
	return out
}

// NewSQLitePool wraps a caller's *sql.DB: its connections are checked and set up before first
// use; the library never closes it.
func NewSQLitePool(db *sql.DB) *SQLitePool { return &SQLitePool{DB: db, prep: newSQLiteStmtCache()} }

// newSQLiteStmtCache is the statement cache of a SQLite pool. SQLite parses and plans a
// statement each time it is prepared, which for the library's claim and settlement statements
// cost more than running them; a prepared statement stays valid through schema changes (SQLite
// prepares it again itself). A statement that Cancel interrupted leaves its connection usable:
// it is not closed (an in-memory database whose DSN does not share it lives in its one
// connection).
func newSQLiteStmtCache() *stmtCache {
	c := newStmtCache()
	c.keepOnCancel = true
	return c
}

// OpenSQLitePool opens a *sql.DB of the "sqlite" driver on dsn, whose settings the caller
// (the broker) put in the DSN. With memory set, one connection is held open for the pool's
// life, so that the in-memory database the DSN names lives as long as the pool: the pool
// opens one connection more than maxConns for it, so that maxConns stay for the statements
// (with maxConns 1, the anchor would otherwise hold the pool's only connection and every
// statement would wait for ever). The error ErrNoSQLiteDriver says that the program did not
// import the driver.
//
// path names the database file (or the in-memory database's name), for the process's write
// gate of it.
func OpenSQLitePool(dsn, path string, maxConns int, memory bool) (*SQLitePool, error) {
	if !SQLiteRegistered() {
		return nil, ErrNoSQLiteDriver
	}
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, err
	}
	if memory {
		maxConns++ // the anchor
	}
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	p := &SQLitePool{DB: db, preset: true, prep: newSQLiteStmtCache()}
	p.gate, p.releaseGate = gateOf(path)
	if memory {
		c, err := db.Conn(context.Background())
		if err != nil {
			_ = db.Close()
			p.releaseGate()
			return nil, err
		}
		p.anchor = c
	}
	return p, nil
}

// ErrNoSQLiteDriver says that no database/sql driver named "sqlite" is registered.
var ErrNoSQLiteDriver = errors.New(`no database/sql driver "sqlite" is registered: import _ "modernc.org/sqlite" in the program`)

// SQLiteRegistered reports whether a database/sql driver named "sqlite" is registered.
func SQLiteRegistered() bool {
	for _, d := range sql.Drivers() {
		if d == "sqlite" {
			return true
		}
	}
	return false
}

func (p *SQLitePool) Dialect() Dialect  { return SQLite }
func (c *sqliteConn) Dialect() Dialect  { return SQLite }
func (t *sqliteTx) Dialect() Dialect    { return SQLite }
func (SQLiteCallerTx) Dialect() Dialect { return SQLite }

// SQLiteConfigError says why a caller's *sql.DB cannot be used as the library needs it.
type SQLiteConfigError struct{ Reason string }

func (e *SQLiteConfigError) Error() string { return "sqlite: " + e.Reason }

func (p *SQLitePool) Driver() string { return "sqlite" }

// InMemory reports whether the pool is on an in-memory database the library opened, which no
// other process can write to.
func (p *SQLitePool) InMemory() bool { return p.anchor != nil }

func (p *SQLitePool) OpenConns() int { return p.DB.Stats().OpenConnections }

// Close closes the pool (a pool the library opened), and gives back its write gate.
func (p *SQLitePool) Close() {
	p.closeOnce.Do(func() {
		if p.anchor != nil {
			_ = p.anchor.Close()
		}
		_ = p.DB.Close()
		p.gateMu.Lock()
		if p.releaseGate != nil {
			p.releaseGate()
		}
		p.gateMu.Unlock()
	})
}

// setUp checks a connection before its first use: the connection has a busy timeout, and the
// database is in WAL mode (or in memory, where WAL does not exist).
func (p *SQLitePool) setUp(ctx context.Context, c *sql.Conn) error {
	if p.preset {
		return nil
	}
	if err := p.findGate(ctx, c); err != nil {
		return err
	}
	var key any
	_ = c.Raw(func(dc any) error { key = dc; return nil })
	if _, ok := p.ready.Load(key); ok {
		return nil
	}
	var busy int64
	if err := c.QueryRowContext(ctx, "PRAGMA busy_timeout").Scan(&busy); err != nil {
		return err
	}
	if busy == 0 {
		if _, err := c.ExecContext(ctx, fmt.Sprintf("PRAGMA busy_timeout = %d", SQLiteBusyTimeoutMS)); err != nil {
			return err
		}
	}
	// With the busy timeout set first: switching to WAL waits for the other connections.
	var mode string
	if err := c.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		return err
	}
	if !strings.EqualFold(mode, "wal") && !strings.EqualFold(mode, "memory") {
		if err := c.QueryRowContext(ctx, "PRAGMA journal_mode = WAL").Scan(&mode); err != nil {
			return &SQLiteConfigError{Reason: fmt.Sprintf("setting journal_mode = WAL: %v", err)}
		}
		if !strings.EqualFold(mode, "wal") {
			return &SQLiteConfigError{Reason: fmt.Sprintf("the database is in journal_mode %q and refused WAL, which a queue needs (readers and the writer must not block each other)", mode)}
		}
	}
	p.remember(key)
	return nil
}

// SQLiteMaxReady bounds the connections a pool remembers as set up. database/sql does not
// say when it closes a connection on its own (idle time, lifetime, SetMaxIdleConns), and each
// entry keeps its driver connection from being collected: past SQLiteMaxReady entries the set
// starts anew, and the connections still open are checked once more (a few PRAGMA reads
// each), as the pid cache of database/sql connections does on PostgreSQL.
const SQLiteMaxReady = 256

// remember notes the driver connection key as set up.
func (p *SQLitePool) remember(key any) {
	if key == nil {
		return
	}
	if _, had := p.ready.LoadOrStore(key, struct{}{}); !had && p.nready.Add(1) > SQLiteMaxReady {
		p.ready.Clear()
		p.nready.Store(0)
	}
}

// forget drops the driver connection key from the set of connections set up.
func (p *SQLitePool) forget(key any) {
	if _, had := p.ready.LoadAndDelete(key); had {
		p.nready.Add(-1)
	}
	p.prep.forget(key)
}

// ReadyConns counts the connections the pool remembers as set up.
func (p *SQLitePool) ReadyConns() int {
	n := 0
	p.ready.Range(func(any, any) bool { n++; return true })
	return n
}

// findGate finds the write gate of a caller's *sql.DB from the file of its main database.
func (p *SQLitePool) findGate(ctx context.Context, c *sql.Conn) error {
	p.gateMu.Lock()
	defer p.gateMu.Unlock()
	if p.gate != nil {
		return nil
	}
	rows, err := c.QueryContext(ctx, "PRAGMA database_list")
	if err != nil {
		return err
	}
	defer rows.Close()
	file := ""
	for rows.Next() {
		var seq int64
		var name, f string
		if err := rows.Scan(&seq, &name, &f); err != nil {
			return err
		}
		if name == "main" {
			file = f
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	// A caller's handle is never closed by the library: the pool's reference to the gate is
	// given back when the pool itself is collected (no publisher or subscriber uses it).
	gate, release := gateOf(file)
	p.gate, p.releaseGate = gate, release
	runtime.AddCleanup(p, func(release func()) { release() }, release)
	return nil
}

func (p *SQLitePool) conn(ctx context.Context) (*sqliteConn, error) {
	c, err := p.DB.Conn(ctx)
	if err != nil {
		return nil, err
	}
	if err := p.setUp(ctx, c); err != nil {
		_ = c.Close()
		return nil, err
	}
	return &sqliteConn{c: c, pool: p, gate: p.gate}, nil
}

func (p *SQLitePool) Acquire(ctx context.Context) (Conn, error) { return p.conn(ctx) }

// Dedicated is Acquire: SQLite has no session state the library keeps on a connection.
func (p *SQLitePool) Dedicated(ctx context.Context) (Conn, error) { return p.conn(ctx) }

func (p *SQLitePool) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	c, err := p.conn(ctx)
	if err != nil {
		return 0, err
	}
	defer c.Release()
	return c.Exec(ctx, query, args...)
}

func (p *SQLitePool) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	return p.query(ctx, false, query, args)
}

func (p *SQLitePool) QueryWrite(ctx context.Context, query string, args ...any) (Rows, error) {
	return p.query(ctx, true, query, args)
}

func (p *SQLitePool) query(ctx context.Context, write bool, query string, args []any) (Rows, error) {
	c, err := p.conn(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := c.query(ctx, write, query, args)
	if err != nil {
		c.Release()
		return nil, err
	}
	return &trackedRows{Rows: rows, done: c.Release}, nil
}

// Begin starts a write transaction (BEGIN IMMEDIATE) on a connection of its own, which goes
// back to the pool when the transaction ends.
func (p *SQLitePool) Begin(ctx context.Context) (Tx, error) {
	c, err := p.conn(ctx)
	if err != nil {
		return nil, err
	}
	tx, err := c.begin(ctx, true)
	if err != nil {
		c.Release()
		return nil, err
	}
	return tx, nil
}

// sqliteConn is one connection of a SQLitePool. Its statements run under a context of their
// own, which Cancel ends: the driver then interrupts the statement (sqlite3_interrupt) and
// returns once it has stopped.
type sqliteConn struct {
	c    *sql.Conn
	pool *SQLitePool
	gate *writeGate
	inTx bool // a transaction of the library holds the write gate

	mu          sync.Mutex
	running     context.CancelFunc
	interrupted bool // Cancel ended the statement running now
}

func (c *sqliteConn) track(ctx context.Context) (context.Context, func(err error) error) {
	ctx, cancel := context.WithCancel(ctx)
	c.mu.Lock()
	c.running = cancel
	c.interrupted = false
	c.mu.Unlock()
	return ctx, func(err error) error {
		c.mu.Lock()
		c.running = nil
		hit := c.interrupted
		c.interrupted = false
		c.mu.Unlock()
		cancel()
		if err != nil && hit {
			return &InterruptedError{Err: err}
		}
		return err
	}
}

// InterruptedError is the error of a SQLite statement that Cancel interrupted; SQLState
// reports it as CodeQueryCanceled, as PostgreSQL does a cancelled statement.
type InterruptedError struct{ Err error }

func (e *InterruptedError) Error() string { return "sqlite: statement interrupted: " + e.Err.Error() }
func (e *InterruptedError) Unwrap() error { return e.Err }

// lockWrite takes the write gate for one write statement outside a transaction of the
// library, and returns its release.
func (c *sqliteConn) lockWrite(ctx context.Context) (func(), error) {
	if c.inTx {
		return func() {}, nil
	}
	if err := c.gate.lock(ctx); err != nil {
		return nil, err
	}
	var once sync.Once
	return func() { once.Do(c.gate.unlock) }, nil
}

func (c *sqliteConn) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	ctx, done := c.track(ctx)
	unlock, err := c.lockWrite(ctx)
	if err != nil {
		return 0, done(err)
	}
	defer unlock()
	if len(args) > 0 {
		_, n, err := c.pool.prep.run(ctx, c.c, query, args, true)
		return n, done(err)
	}
	res, err := c.c.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, done(err)
	}
	n, err := res.RowsAffected()
	return n, done(err)
}

func (c *sqliteConn) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	return c.query(ctx, false, query, args)
}

func (c *sqliteConn) QueryWrite(ctx context.Context, query string, args ...any) (Rows, error) {
	return c.query(ctx, true, query, args)
}

func (c *sqliteConn) query(ctx context.Context, write bool, query string, args []any) (Rows, error) {
	ctx, done := c.track(ctx)
	unlock := func() {}
	if write {
		var err error
		if unlock, err = c.lockWrite(ctx); err != nil {
			return nil, done(err)
		}
	}
	if len(args) > 0 {
		// Read whole before it returns: the statement is over, its write done.
		rows, _, err := c.pool.prep.run(ctx, c.c, query, args, false)
		unlock()
		if err = done(err); err != nil {
			return nil, err
		}
		return rows, nil
	}
	rows, err := c.c.QueryContext(ctx, query, args...)
	if err != nil {
		unlock()
		return nil, done(err)
	}
	return &sqliteRows{r: rows, done: func(err error) error { unlock(); return done(err) }}, nil
}

// sqliteRows reports an interrupt as an InterruptedError, and ends the statement's context
// when closed.
type sqliteRows struct {
	r      *sql.Rows
	done   func(error) error
	closed bool
	err    error
}

func (r *sqliteRows) Next() bool             { return r.r.Next() }
func (r *sqliteRows) Scan(dest ...any) error { return r.r.Scan(dest...) }
func (r *sqliteRows) Err() error {
	if r.closed {
		return r.err
	}
	return r.r.Err()
}

func (r *sqliteRows) Close() {
	if r.closed {
		return
	}
	_ = r.r.Close()
	r.err = r.done(r.r.Err())
	r.closed = true
}

// Cancel interrupts the statement running now. The connection stays usable.
func (c *sqliteConn) Cancel(context.Context) (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.running != nil {
		c.interrupted = true
		c.running()
	}
	return false, nil
}

// PID is 0: SQLite runs in the process, with no server process to look at.
func (c *sqliteConn) PID(context.Context) (uint32, error) { return 0, nil }

func (c *sqliteConn) Release() { _ = c.c.Close() }

func (c *sqliteConn) Destroy() {
	_ = c.c.Raw(func(dc any) error {
		c.pool.forget(dc)
		return driver.ErrBadConn
	})
	_ = c.c.Close()
}

// Begin starts a write transaction (BEGIN IMMEDIATE) on the connection.
func (c *sqliteConn) Begin(ctx context.Context) (Tx, error) { return c.begin(ctx, false) }

func (c *sqliteConn) begin(ctx context.Context, owns bool) (*sqliteTx, error) {
	if c.inTx {
		return nil, errors.New("sqlite: a transaction is already open on the connection")
	}
	tctx, done := c.track(ctx) // Cancel ends the wait for the gate too
	err := done(c.gate.lock(tctx))
	if err != nil {
		return nil, err
	}
	c.inTx = true
	if _, err := c.Exec(ctx, "BEGIN IMMEDIATE"); err != nil {
		c.inTx = false
		c.gate.unlock()
		return nil, err
	}
	return &sqliteTx{c: c, owns: owns}, nil
}

// sqliteTx is a transaction begun with BEGIN IMMEDIATE on a connection; its end releases the
// connection when the transaction took it from the pool.
type sqliteTx struct {
	c    *sqliteConn
	owns bool
	done bool
}

func (t *sqliteTx) Exec(ctx context.Context, query string, args ...any) (int64, error) {
	return t.c.Exec(ctx, query, args...)
}

func (t *sqliteTx) Query(ctx context.Context, query string, args ...any) (Rows, error) {
	return t.c.Query(ctx, query, args...)
}

func (t *sqliteTx) QueryWrite(ctx context.Context, query string, args ...any) (Rows, error) {
	return t.c.QueryWrite(ctx, query, args...)
}

func (t *sqliteTx) Commit(ctx context.Context) error {
	if t.done {
		return errors.New("sqlite: transaction already ended")
	}
	_, err := t.c.Exec(ctx, "COMMIT")
	if err != nil {
		// A failed COMMIT leaves the transaction open (SQLITE_BUSY) or rolled back: end it.
		t.Rollback(ctx)
		return err
	}
	t.end(false)
	return nil
}

// Rollback ends the transaction, under no cancellation of ctx. A connection whose rollback
// fails is closed: it must never go back to the pool inside a transaction.
func (t *sqliteTx) Rollback(ctx context.Context) error {
	if t.done {
		return nil
	}
	rctx, cancel := CleanupContext(ctx)
	defer cancel()
	_, err := t.c.Exec(rctx, "ROLLBACK")
	if err != nil && strings.Contains(err.Error(), "no transaction is active") {
		err = nil // SQLite rolled it back itself (an interrupt, an I/O error)
	}
	t.end(err != nil)
	return err
}

func (t *sqliteTx) end(bad bool) {
	t.done = true
	t.c.inTx = false
	t.c.gate.unlock()
	switch {
	case bad:
		t.c.Destroy()
	case t.owns:
		t.c.Release()
	}
}

// SQLiteCallerTx is a caller's database/sql transaction on SQLite.
type SQLiteCallerTx struct{ stdQ }

// NewSQLiteCallerTx wraps a caller's transaction on SQLite.
func NewSQLiteCallerTx(tx *sql.Tx) SQLiteCallerTx { return SQLiteCallerTx{stdQ{tx}} }

// InSQLiteTx runs fn in a write transaction of q: a new one on a pool or connection, or the
// caller's own transaction as it is.
func InSQLiteTx(ctx context.Context, q Querier, fn func(Querier) error) error {
	if b, ok := q.(Beginner); ok {
		return InTx(ctx, b, func(tx Tx) error { return fn(tx) })
	}
	return fn(q)
}
