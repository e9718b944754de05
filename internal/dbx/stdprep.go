package dbx

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"reflect"
	"sync"
	"sync/atomic"
	"time"
)

// Prepared statements on a database/sql pool: lib/pq's when the caller asks for them
// (NewStdPoolPrepared), SQLite's always (see newSQLiteStmtCache).
//
// lib/pq sends every statement with arguments as an unnamed one: a round trip to parse it, one
// to run it, and the server plans it again each time. pgx prepares each statement once per
// connection and the server reuses the plan. database/sql prepares per connection only through
// a *sql.Stmt of the whole pool, which the library's statements cannot use: they run on a
// *sql.Conn taken for them (so that they can be cancelled, and their backend known). So the
// statements of a *sql.Conn go to the driver's own connection (sql.Conn.Raw), prepared once per
// driver connection and kept in a cache, and their rows are read whole before Raw returns
// (database/sql does not let a driver connection out of Raw).
//
// On PostgreSQL a named prepared statement belongs to the server session that prepared it:
// behind a transaction-mode pooler (PgBouncer with pool_mode = transaction and no
// max_prepared_statements), the next statement of a client connection may go to another
// session, which knows no such statement or has another one of that name. That is why lib/pq's
// pools prepare only when the caller asks. SQLite runs in the process, with no pooler between.

// maxStmtsPerConn bounds the statements kept prepared on one driver connection: the library's
// statements name their tables, so a process with many topics has many texts. Past it, the
// least recently used one is closed on the server.
const maxStmtsPerConn = 256

// maxPreparedConns bounds the driver connections the cache remembers. database/sql does not say
// when it closes a connection (idle time, lifetime, an error elsewhere), and an entry keeps its
// driver connection from being collected: past the bound the cache starts anew. The statements
// of connections still open are then prepared again under new names; the old ones stay on
// their sessions until those end.
const maxPreparedConns = 512

// stmtCache holds the statements prepared on each driver connection of one pool.
type stmtCache struct {
	mu    sync.Mutex
	conns map[any]*connStmts
	// keepOnCancel keeps a connection whose statement's context ended (SQLite, where an
	// interrupted statement leaves the connection as it was); otherwise it is closed.
	keepOnCancel bool
	prepares     atomic.Int64 // statements prepared, for tests
}

// connStmts are the statements of one driver connection. They are used only inside Raw on
// that connection, which database/sql runs one at a time: they need no lock of their own.
type connStmts struct {
	stmts    map[string]*preparedStmt
	tick     uint64
	prepares *atomic.Int64 // the cache's count
}

type preparedStmt struct {
	st   driver.Stmt
	used uint64
}

func newStmtCache() *stmtCache { return &stmtCache{conns: map[any]*connStmts{}} }

// of returns the statements of driver connection dc.
func (c *stmtCache) of(dc any) *connStmts {
	c.mu.Lock()
	defer c.mu.Unlock()
	cs := c.conns[dc]
	if cs == nil {
		if len(c.conns) >= maxPreparedConns {
			clear(c.conns)
		}
		cs = &connStmts{stmts: map[string]*preparedStmt{}, prepares: &c.prepares}
		c.conns[dc] = cs
	}
	return cs
}

// forget drops driver connection dc, which is gone.
func (c *stmtCache) forget(dc any) {
	c.mu.Lock()
	delete(c.conns, dc)
	c.mu.Unlock()
}

// prepared returns query prepared on dc, preparing it if it is not.
func (cs *connStmts) prepared(ctx context.Context, dc any, query string) (driver.Stmt, error) {
	cs.tick++
	if p := cs.stmts[query]; p != nil {
		p.used = cs.tick
		return p.st, nil
	}
	pc, ok := dc.(driver.ConnPrepareContext)
	if !ok {
		return nil, fmt.Errorf("dbx: the driver's connection (%T) cannot prepare statements", dc)
	}
	if len(cs.stmts) >= maxStmtsPerConn {
		var oldest string
		var at uint64 = ^uint64(0)
		for q, p := range cs.stmts {
			if p.used < at {
				oldest, at = q, p.used
			}
		}
		cs.drop(oldest)
	}
	st, err := pc.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	cs.prepares.Add(1)
	cs.stmts[query] = &preparedStmt{st: st, used: cs.tick}
	return st, nil
}

// drop closes query's statement on the server and forgets it.
func (cs *connStmts) drop(query string) {
	if p := cs.stmts[query]; p != nil {
		delete(cs.stmts, query)
		_ = p.st.Close()
	}
}

// staleStatement reports whether err says that a prepared statement cannot run as prepared:
// the session does not know it (26000: it went with a pooler's session), or a change of the
// tables it reads changed its result's columns (0A000, "cached plan must not change result
// type"). The statement did not run: it is prepared again and run once more.
func staleStatement(err error) bool {
	switch SQLState(err) {
	case "26000", "0A000":
		return true
	}
	return false
}

// run runs query on c's driver connection as a statement prepared there, and returns its
// rows, read whole; with exec, the rows it affected instead. Unless keepOnCancel, and as
// lib/pq does for a statement it was not asked to prepare, a statement whose context ended
// while it ran leaves its connection broken, to be closed: the server may yet act on the
// cancel request, and it must not reach the connection's next statement.
func (p *stmtCache) run(ctx context.Context, c *sql.Conn, query string, args []any, exec bool) (rows *memRows, affected int64, err error) {
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}
	err = c.Raw(func(dc any) error {
		cs := p.of(dc)
		var err error
		for try := 0; ; try++ {
			rows, affected, err = cs.runOnce(ctx, dc, query, args, exec)
			if err != nil && try == 0 && staleStatement(err) && ctx.Err() == nil {
				cs.drop(query)
				continue
			}
			break
		}
		if v, ok := dc.(driver.Validator); ok && !v.IsValid() && !p.keepOnCancel {
			// Broken: database/sql discards it when it goes back to the pool. (SQLite's
			// reports itself invalid for a moment after an interrupt, and is kept.)
			p.forget(dc)
		}
		if ctx.Err() != nil && !p.keepOnCancel {
			p.forget(dc)
			// database/sql closes a connection whose Raw returns ErrBadConn; the statement's
			// own outcome is kept for the caller.
			return &badConnError{err}
		}
		return err
	})
	var bad *badConnError
	if errors.As(err, &bad) {
		err = bad.err
	}
	return rows, affected, err
}

// badConnError carries a statement's outcome (its error, or nil) out of Raw while telling
// database/sql that the connection is broken.
type badConnError struct{ err error }

func (e *badConnError) Error() string {
	if e.err == nil {
		return driver.ErrBadConn.Error()
	}
	return e.err.Error()
}
func (e *badConnError) Is(target error) bool { return target == driver.ErrBadConn }

func (cs *connStmts) runOnce(ctx context.Context, dc any, query string, args []any, exec bool) (*memRows, int64, error) {
	st, err := cs.prepared(ctx, dc, query)
	if err != nil {
		return nil, 0, err
	}
	nvs, err := namedValues(dc, st, args)
	if err != nil {
		return nil, 0, err
	}
	if exec {
		se, ok := st.(driver.StmtExecContext)
		if !ok {
			return nil, 0, fmt.Errorf("dbx: the driver's statement (%T) cannot run with a context", st)
		}
		res, err := se.ExecContext(ctx, nvs)
		if err != nil {
			return nil, 0, err
		}
		n, err := res.RowsAffected()
		return nil, n, err
	}
	sq, ok := st.(driver.StmtQueryContext)
	if !ok {
		return nil, 0, fmt.Errorf("dbx: the driver's statement (%T) cannot run with a context", st)
	}
	dr, err := sq.QueryContext(ctx, nvs)
	if err != nil {
		return nil, 0, err
	}
	rows, err := readRows(dr)
	if cerr := dr.Close(); err == nil {
		err = cerr
	}
	return rows, 0, err
}

// namedValues converts args as database/sql would for this statement: the statement's or the
// connection's own check first (lib/pq's), then database/sql's default conversion (which calls
// a driver.Valuer, such as pq.Array's).
func namedValues(dc any, st driver.Stmt, args []any) ([]driver.NamedValue, error) {
	var check driver.NamedValueChecker
	if c, ok := st.(driver.NamedValueChecker); ok {
		check = c
	} else if c, ok := dc.(driver.NamedValueChecker); ok {
		check = c
	}
	nvs := make([]driver.NamedValue, len(args))
	for i, a := range args {
		nv := &nvs[i]
		nv.Ordinal, nv.Value = i+1, a
		if check != nil {
			err := check.CheckNamedValue(nv)
			if err == nil {
				continue
			}
			if !errors.Is(err, driver.ErrSkip) {
				return nil, fmt.Errorf("dbx: argument $%d: %w", i+1, err)
			}
			nv.Value = a
		}
		v, err := driver.DefaultParameterConverter.ConvertValue(a)
		if err != nil {
			return nil, fmt.Errorf("dbx: argument $%d: %w", i+1, err)
		}
		nv.Value = v
	}
	return nvs, nil
}

// memRows are rows read whole.
type memRows struct {
	rows [][]driver.Value
	i    int
}

// readRows reads r to its end. A driver may reuse the memory of a []byte value at its next
// row: each is copied.
func readRows(r driver.Rows) (*memRows, error) {
	n := len(r.Columns())
	out := &memRows{i: -1}
	for {
		row := make([]driver.Value, n)
		if err := r.Next(row); err != nil {
			if err == io.EOF {
				return out, nil
			}
			return nil, err
		}
		for j, v := range row {
			if b, ok := v.([]byte); ok {
				row[j] = append([]byte(nil), b...)
			}
		}
		out.rows = append(out.rows, row)
	}
}

func (r *memRows) Next() bool {
	if r.i+1 >= len(r.rows) {
		r.i = len(r.rows)
		return false
	}
	r.i++
	return true
}

func (r *memRows) Err() error { return nil }
func (r *memRows) Close()     { r.i = len(r.rows) }

// Scan converts as database/sql's Rows.Scan does, for the destinations the library scans
// into: sql.Scanner, any, time.Time, a type whose kind is a number, string, bool or byte
// slice, and a pointer to one of those, set to nil by NULL.
func (r *memRows) Scan(dest ...any) error {
	if r.i < 0 || r.i >= len(r.rows) {
		return errors.New("dbx: Scan called without a row")
	}
	row := r.rows[r.i]
	if len(dest) != len(row) {
		return fmt.Errorf("dbx: %d destinations for %d columns", len(dest), len(row))
	}
	for i, d := range dest {
		if err := assign(d, row[i]); err != nil {
			return fmt.Errorf("dbx: column %d: %w", i+1, err)
		}
	}
	return nil
}

// assign stores src, a value of the driver, in dest.
func assign(dest, src any) error {
	switch d := dest.(type) {
	case sql.Scanner:
		return d.Scan(src)
	case *any:
		if b, ok := src.([]byte); ok {
			src = append([]byte(nil), b...)
		}
		*d = src
		return nil
	case *[]byte:
		if src == nil {
			*d = nil
			return nil
		}
		return via(d, src)
	case *string:
		return via(d, src)
	case *int64: // the most common, without reflection
		return via(d, src)
	case *time.Time:
		return via(d, src)
	}
	pv := reflect.ValueOf(dest)
	if pv.Kind() != reflect.Pointer || pv.IsNil() {
		return fmt.Errorf("cannot scan into %T: not a pointer", dest)
	}
	dv := pv.Elem()
	switch dv.Kind() {
	case reflect.Pointer:
		// A pointer to a pointer: nil for NULL, else the value assigned to a new one.
		if src == nil {
			dv.SetZero()
			return nil
		}
		nv := reflect.New(dv.Type().Elem())
		if err := assign(nv.Interface(), src); err != nil {
			return err
		}
		dv.Set(nv)
		return nil
	// A type of the library's or the caller's over a basic kind, as database/sql converts it.
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return viaSet(src, func(n int64) error {
			if dv.OverflowInt(n) {
				return fmt.Errorf("value %d overflows %s", n, dv.Type())
			}
			dv.SetInt(n)
			return nil
		})
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return viaSet(src, func(n uint64) error {
			if dv.OverflowUint(n) {
				return fmt.Errorf("value %d overflows %s", n, dv.Type())
			}
			dv.SetUint(n)
			return nil
		})
	case reflect.Float32, reflect.Float64:
		return viaSet(src, func(f float64) error { dv.SetFloat(f); return nil })
	case reflect.String:
		return viaSet(src, func(v string) error { dv.SetString(v); return nil })
	case reflect.Bool:
		return viaSet(src, func(b bool) error { dv.SetBool(b); return nil })
	case reflect.Slice:
		if dv.Type().Elem().Kind() == reflect.Uint8 {
			var b []byte
			if src != nil {
				if err := via(&b, src); err != nil {
					return err
				}
			}
			dv.SetBytes(b)
			return nil
		}
	}
	return fmt.Errorf("cannot scan %T into %T", src, dest)
}

// viaSet converts src into a T (see via) and hands it to set.
func viaSet[T any](src any, set func(T) error) error {
	var v T
	if err := via(&v, src); err != nil {
		return err
	}
	return set(v)
}

// via converts src into *d by database/sql's own rules, which sql.Null's Scan applies.
func via[T any](d *T, src any) error {
	if src == nil {
		return fmt.Errorf("converting NULL to %T is unsupported", *d)
	}
	var n sql.Null[T]
	if err := n.Scan(src); err != nil {
		return err
	}
	*d = n.V
	return nil
}
