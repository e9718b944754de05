package dbx

// MySQL and MariaDB through database/sql (the driver github.com/go-sql-driver/mysql, which
// the program imports; this package does not).
//
// Every transaction of the library runs at READ COMMITTED, whatever the session's default
// (REPEATABLE READ on both servers): each statement then sees the rows committed before it,
// and a locking read of a range takes no gap lock, which would hold back the publishers that
// append to it. A statement is cancelled on the server with KILL QUERY, sent through another
// connection of the pool, after which the connection stays usable.

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"reflect"
	"sync"
)

// MySQLPool is a database/sql pool of MySQL or MariaDB.
type MySQLPool struct {
	stdQ
	DB *sql.DB

	// sessionRC: every session of the pool runs at READ COMMITTED (OpenMySQLPool), so a
	// transaction begins without setting its level, one round trip fewer.
	sessionRC bool
}

// NewMySQLPool wraps db, a pool of the driver github.com/go-sql-driver/mysql.
func NewMySQLPool(db *sql.DB) *MySQLPool { return &MySQLPool{stdQ: stdQ{db}, DB: db} }

// OpenMySQLPool opens a pool of up to maxConns connections of the driver registered as
// "mysql" on dsn, for the library alone: each connection's session is set to READ COMMITTED
// as it connects. The caller's transactions on it begin at that level too.
func OpenMySQLPool(dsn string, maxConns int) (*MySQLPool, error) {
	probe, err := sql.Open("mysql", dsn)
	if err != nil {
		return nil, err
	}
	drv := probe.Driver()
	_ = probe.Close()
	dc, ok := drv.(driver.DriverContext)
	if !ok {
		return nil, errors.New("dbx: the driver registered as mysql cannot open a connector")
	}
	conn, err := dc.OpenConnector(dsn)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(readCommittedConnector{conn})
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	return &MySQLPool{stdQ: stdQ{db}, DB: db, sessionRC: true}, nil
}

// readCommittedConnector sets each new connection's session to READ COMMITTED.
type readCommittedConnector struct{ driver.Connector }

func (c readCommittedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	ex, ok := conn.(driver.ExecerContext)
	if !ok {
		_ = conn.Close()
		return nil, errors.New("dbx: the MySQL driver's connection cannot run a statement")
	}
	if _, err := ex.ExecContext(ctx, "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED", nil); err != nil {
		_ = conn.Close()
		return nil, err
	}
	return conn, nil
}

func (p *MySQLPool) Dialect() Dialect { return MySQL }
func (p *MySQLPool) Driver() string   { return "mysql" }
func (p *MySQLPool) OpenConns() int   { return p.DB.Stats().OpenConnections }
func (p *MySQLPool) Close()           { _ = p.DB.Close() }

// readCommitted are the options of every transaction the library begins.
var readCommitted = &sql.TxOptions{Isolation: sql.LevelReadCommitted}

// txOptions are the options of the transactions the library begins on the pool.
func (p *MySQLPool) txOptions() *sql.TxOptions {
	if p.sessionRC {
		return nil
	}
	return readCommitted
}

func (p *MySQLPool) Begin(ctx context.Context) (Tx, error) {
	tx, err := p.DB.BeginTx(ctx, p.txOptions())
	if err != nil {
		return nil, err
	}
	return mysqlTx{stdTx{stdQ{tx}, tx}}, nil
}

// Acquire takes a connection and learns its id, which Cancel needs while a statement runs:
// asked once per physical connection, remembered as StdPool's backend pids are.
func (p *MySQLPool) Acquire(ctx context.Context) (Conn, error) {
	c, err := p.DB.Conn(ctx)
	if err != nil {
		return nil, err
	}
	mc := &mysqlConn{stdQ: stdQ{c}, c: c, pool: p.DB, opts: p.txOptions()}
	if _, err := mc.PID(ctx); err != nil {
		mc.Destroy()
		return nil, err
	}
	return mc, nil
}

// Dedicated takes a connection from the pool, as StdPool's does; its session state never
// goes back to the pool (Destroy).
func (p *MySQLPool) Dedicated(ctx context.Context) (Conn, error) {
	release, err := reserveDedicated(p.DB)
	if err != nil {
		return nil, err
	}
	c, err := p.Acquire(ctx)
	if err != nil {
		release()
		return nil, err
	}
	mc := c.(*mysqlConn)
	mc.dedicated, mc.unreserve = true, release
	return mc, nil
}

// mysqlConn is one connection of a MySQLPool.
type mysqlConn struct {
	stdQ
	c         *sql.Conn
	pool      *sql.DB
	opts      *sql.TxOptions // of the transactions the library begins on it
	dedicated bool
	unreserve func()

	mu  sync.Mutex
	pid uint32
}

func (c *mysqlConn) Dialect() Dialect { return MySQL }

func (c *mysqlConn) Begin(ctx context.Context) (Tx, error) {
	tx, err := c.c.BeginTx(ctx, c.opts)
	if err != nil {
		return nil, err
	}
	return mysqlTx{stdTx{stdQ{tx}, tx}}, nil
}

// PID is the connection's CONNECTION_ID(), asked once per physical connection.
func (c *mysqlConn) PID(ctx context.Context) (uint32, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pid != 0 {
		return c.pid, nil
	}
	pid, err := cachedPID(ctx, c.c, c.stdQ, "SELECT CONNECTION_ID()")
	c.pid = pid
	return pid, err
}

// Cancel ends the statement running now on the connection with KILL QUERY, sent through
// another connection of the pool: the statement returns the server's error 1317 (query
// execution was interrupted) and the connection stays usable. Acquire has read the
// connection's id: reading it now would wait for the statement to end.
func (c *mysqlConn) Cancel(ctx context.Context) (bool, error) {
	c.mu.Lock()
	pid := c.pid
	c.mu.Unlock()
	if pid == 0 {
		return false, errors.New("dbx: the connection's id is not known")
	}
	_, err := c.pool.ExecContext(ctx, "KILL QUERY ?", int64(pid))
	return false, err
}

func (c *mysqlConn) Release() {
	if c.dedicated {
		c.Destroy()
		return
	}
	_ = c.c.Close()
}

func (c *mysqlConn) Destroy() {
	_ = c.c.Raw(func(dc any) error {
		if _, had := pids.LoadAndDelete(dc); had {
			npids.Add(-1)
		}
		return driver.ErrBadConn
	})
	_ = c.c.Close()
	if c.unreserve != nil {
		c.unreserve()
		c.unreserve = nil
	}
}

// mysqlTx is a transaction the library began.
type mysqlTx struct{ stdTx }

func (mysqlTx) Dialect() Dialect { return MySQL }

// MySQLCallerTx is a caller's transaction on MySQL or MariaDB.
type MySQLCallerTx struct{ stdQ }

// NewMySQLCallerTx wraps a caller's transaction.
func NewMySQLCallerTx(tx *sql.Tx) MySQLCallerTx { return MySQLCallerTx{stdQ{tx}} }

func (MySQLCallerTx) Dialect() Dialect { return MySQL }

// InTransaction reports whether q runs its statements inside a transaction already: one the
// library began, or a caller's; a pool or a connection runs each statement by itself.
func InTransaction(q Querier) bool {
	_, begins := q.(Beginner)
	return !begins
}

// MySQL error numbers the library branches on.
const (
	mysqlNoSuchTable      = 1146
	mysqlLockWaitTimeout  = 1205
	mysqlDeadlock         = 1213
	mysqlQueryInterrupted = 1317
	mysqlStatementTimeout = 1969 // MariaDB's max_statement_time
	mysqlExecutionTimeout = 3024 // MySQL's max_execution_time
	mysqlDuplicateKey     = 1062
)

// MySQLErrorNumber is the server's error number carried by err (the driver's *MySQLError,
// read by its field Number, so that this package does not import the driver), or 0.
func MySQLErrorNumber(err error) uint16 {
	for e := err; e != nil; e = errors.Unwrap(e) {
		v := reflect.ValueOf(e)
		for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
			if v.IsNil() {
				break
			}
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct || v.Type().Name() != "MySQLError" {
			continue
		}
		if f := v.FieldByName("Number"); f.IsValid() && f.Kind() == reflect.Uint16 {
			return uint16(f.Uint())
		}
	}
	return 0
}

// mysqlState maps a MySQL error number to the code SQLState gives.
func mysqlState(n uint16) string {
	switch n {
	case mysqlNoSuchTable:
		return CodeUndefinedTable
	case mysqlQueryInterrupted, mysqlStatementTimeout, mysqlExecutionTimeout:
		return CodeQueryCanceled
	case mysqlLockWaitTimeout:
		return CodeLockNotAvailable
	case mysqlDeadlock:
		return CodeDeadlock
	case mysqlDuplicateKey:
		return CodeUniqueViolation
	}
	return ""
}

// Retryable reports whether err ended a MySQL transaction that can be run again as it was:
// the victim of a deadlock, or a lock wait that timed out.
func Retryable(err error) bool {
	switch MySQLErrorNumber(err) {
	case mysqlDeadlock, mysqlLockWaitTimeout:
		return true
	}
	return false
}
