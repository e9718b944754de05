// Package dbx is the seam between the library and its database drivers: pgx/v5 and
// database/sql (lib/pq, pgx's stdlib) on PostgreSQL, database/sql with modernc.org/sqlite on
// SQLite and with github.com/go-sql-driver/mysql on MySQL. Above it, code speaks only these
// interfaces and asks a Dialect what the database can do; every driver detail (argument
// conversion, cancellation, connection identity, isolation, SQLite's write gate) stays in the
// adapter files (pgx.go, std.go, sqlite.go, mysql.go).
package dbx

import (
	"context"
	"errors"
)

// Querier runs statements. SQL text uses the placeholders of its database: $n on PostgreSQL,
// $n or ? on SQLite, ? on MySQL.
//
// A statement says itself whether it writes: Exec runs one that writes, Query one that only
// reads, and QueryWrite (below) one that writes and returns rows. SQLite lets one writer of the
// process at a time through (see SQLitePool); PostgreSQL makes no difference.
type Querier interface {
	// Exec runs a statement that writes and returns the number of rows it affected.
	Exec(ctx context.Context, sql string, args ...any) (int64, error)
	// Query runs a statement that reads and returns rows. The caller must Close the rows.
	Query(ctx context.Context, sql string, args ...any) (Rows, error)
}

// writeQuerier is a Querier whose row-returning writes differ from its reads.
type writeQuerier interface {
	QueryWrite(ctx context.Context, sql string, args ...any) (Rows, error)
}

// QueryWrite runs on q a statement that writes and returns rows (RETURNING). The caller must
// Close the rows.
func QueryWrite(ctx context.Context, q Querier, sql string, args ...any) (Rows, error) {
	if w, ok := q.(writeQuerier); ok {
		return w.QueryWrite(ctx, sql, args...)
	}
	return q.Query(ctx, sql, args...)
}

// Rows is the result of Query.
type Rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
	Close()
}

// LockedQuerier runs a statement that takes a lock (its result dropped), then a query, in one
// transaction and one round trip: the statements go to the server together and run one after
// the other in an implicit transaction, which ends with the query's last row. Each statement
// has a snapshot of its own (READ COMMITTED), so the query sees every transaction that
// committed before the lock was had. The client cannot tell when the lock was had: the
// server sends the lock's result with the query's, at the end. A query that needs that time
// measures it itself, against the transaction's start (now()), which comes after the call.
// pgx connections have it; see LockedQuery for the others.
type LockedQuerier interface {
	LockedQuery(ctx context.Context, lockSQL string, lockArgs []any, sql string, args []any, scan func(Rows) error) error
}

// LockedQuery runs lockSQL then sql in one transaction of b, and scan on the rows of sql: in
// one round trip when b is a LockedQuerier, or in an explicit transaction (begin, lock, query,
// commit) otherwise.
func LockedQuery(ctx context.Context, b Beginner, lockSQL string, lockArgs []any, sql string, args []any, scan func(Rows) error) error {
	if l, ok := b.(LockedQuerier); ok {
		return l.LockedQuery(ctx, lockSQL, lockArgs, sql, args, scan)
	}
	return InTx(ctx, b, func(tx Tx) error {
		if _, err := tx.Exec(ctx, lockSQL, lockArgs...); err != nil {
			return err
		}
		rows, err := QueryWrite(ctx, tx, sql, args...)
		if err != nil {
			return err
		}
		return scan(rows)
	})
}

// Tx is a transaction.
type Tx interface {
	Querier
	Commit(ctx context.Context) error
	Rollback(ctx context.Context) error
}

// Beginner starts transactions.
type Beginner interface {
	Begin(ctx context.Context) (Tx, error)
}

// Conn is one connection taken out of a pool for the caller's exclusive use.
type Conn interface {
	Querier
	Beginner
	// PID is the server process id of the connection's backend.
	PID(ctx context.Context) (uint32, error)
	// Cancel asks the server to cancel the statement the connection is running now; that
	// statement then returns the server's own error (SQLSTATE 57014) once the server has ended
	// it. It reports whether the driver closes the connection after such a cancel (lib/pq
	// does), so callers can count it.
	Cancel(ctx context.Context) (closesConn bool, err error)
	// Release hands a healthy connection back to its pool.
	Release()
	// Destroy closes the connection instead of handing it back, so that no session state
	// (an advisory lock, a LISTEN) can ever reach another borrower.
	Destroy()
}

// Pool is a connection pool: the caller's, or one the library built.
type Pool interface {
	Querier
	Beginner
	// Acquire takes a connection for exclusive use.
	Acquire(ctx context.Context) (Conn, error)
	// Dedicated opens a connection outside the pool's accounting for a long-lived purpose
	// (advisory locks, LISTEN). Closing it never returns it to the pool.
	Dedicated(ctx context.Context) (Conn, error)
	// Close closes the pool. Only a pool the library built is ever closed by the library.
	Close()
	// OpenConns is the number of connections the pool has open now.
	OpenConns() int
	// Driver names the driver: "pgx", "database/sql" or "sqlite".
	Driver() string
	// Dialect says what the database can do.
	Dialect() Dialect
}

// Reserver is a pool whose dedicated connections count against its bound (a *sql.DB with
// SetMaxOpenConns): a user that keeps one for long holds the room for it from the start,
// whether the connection is open yet or not, and across its reconnects.
type Reserver interface {
	// ReserveDedicated holds room for one dedicated connection, or fails with
	// ErrPoolTooSmall; release gives it back.
	ReserveDedicated() (release func(), err error)
	// DedicatedReserved is Dedicated in room held already: the connection does not count
	// itself in or out.
	DedicatedReserved(ctx context.Context) (Conn, error)
}

// Listenable is a pool that can keep a LISTEN connection (pgx; database/sql cannot receive
// notifications through its pool).
type Listenable interface {
	// ListenKey identifies the underlying pool, so that wrappers of one pool share a listener.
	ListenKey() any
	Listen(ctx context.Context, channel string, onOpen, onConnect func(), onNotify func(payload string)) error
}

// ErrNoRows is returned by QueryRow-style helpers when the statement returned no row.
var ErrNoRows = errors.New("dbx: no rows in result set")

// QueryRow runs a statement that reads, expected to return one row, and scans it into dest.
func QueryRow(ctx context.Context, q Querier, sql string, args []any, dest ...any) error {
	rows, err := q.Query(ctx, sql, args...)
	return scanOne(rows, err, dest)
}

// QueryRowWrite is QueryRow for a statement that writes and returns one row.
func QueryRowWrite(ctx context.Context, q Querier, sql string, args []any, dest ...any) error {
	rows, err := QueryWrite(ctx, q, sql, args...)
	return scanOne(rows, err, dest)
}

func scanOne(rows Rows, err error, dest []any) error {
	if err != nil {
		return err
	}
	defer rows.Close()
	if !rows.Next() {
		if err := rows.Err(); err != nil {
			return err
		}
		return ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

// InTx runs fn in a transaction on b, committing when fn returns nil and rolling back otherwise.
// The rollback runs without the caller's cancellation, bounded by a short timeout, so that a
// cancelled context never leaves a transaction open on the server.
func InTx(ctx context.Context, b Beginner, fn func(Tx) error) error {
	tx, err := b.Begin(ctx)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		rctx, cancel := CleanupContext(ctx)
		defer cancel()
		_ = tx.Rollback(rctx)
		return err
	}
	return tx.Commit(ctx)
}

// ScanInt64s reads the one bigint column of every row of a Query's result.
func ScanInt64s(rows Rows, err error) ([]int64, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var v int64
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// Copier is a Querier that can load rows with COPY FROM STDIN (the pgx adapters: pool,
// connection and transaction). database/sql adapters are not Copiers.
type Copier interface {
	// CopyFrom copies rows into table (its unquoted schema and name parts) and returns the
	// number of rows copied. Like any single statement, it is all or none.
	CopyFrom(ctx context.Context, table []string, columns []string, rows [][]any) (int64, error)
}
