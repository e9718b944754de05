package dbx

import (
	"context"
	"strconv"
)

// Dialect says what a database can do. Code above this package asks it for a capability and
// never names the database; internal/offsets picks its statements by it, once.
type Dialect struct {
	// Name names the database in messages: "PostgreSQL", "SQLite" or "MySQL".
	Name string
	// Notify: NOTIFY exists, so a pool that is Listenable can wake other processes' subscribers.
	Notify bool
	// OrderedClaims: claims ordered by key exist (SubscriberConfig.OrderByKey).
	OrderedClaims bool
	// AdvisoryLocks: session advisory locks exist (the advisory claim mode).
	AdvisoryLocks bool
	// Schemas: tables live in named schemas.
	Schemas bool
	// BackendPIDs: each connection is a server process with an id that can be looked up.
	BackendPIDs bool
	// Copy: COPY FROM STDIN exists (on a Copier).
	Copy bool
	// StatementTimeouts: a transaction can bound its statements and lock waits on the server.
	StatementTimeouts bool
	// InProcess: statements run in the process, on its own CPU (an embedded database).
	InProcess bool
	// MaxParams is the most bind parameters one statement may carry.
	MaxParams int
}

var (
	// Postgres is PostgreSQL, through pgx or database/sql. Its wire protocol counts bind
	// parameters in 16 bits.
	Postgres = Dialect{Name: "PostgreSQL", Notify: true, OrderedClaims: true, AdvisoryLocks: true, Schemas: true, BackendPIDs: true, Copy: true, StatementTimeouts: true, MaxParams: 65535}
	// SQLite is SQLite through modernc.org/sqlite, whose SQLITE_MAX_VARIABLE_NUMBER is the
	// default 32766.
	SQLite = Dialect{Name: "SQLite", OrderedClaims: true, InProcess: true, MaxParams: 32766}
	// MySQL is MySQL 8 or MariaDB 10.6 and newer, through database/sql and
	// github.com/go-sql-driver/mysql: a prepared statement counts its parameters in 16 bits.
	MySQL = Dialect{Name: "MySQL", BackendPIDs: true, MaxParams: 65535}
)

// dialected is a pool, connection or transaction that says its dialect.
type dialected interface{ Dialect() Dialect }

// DialectOf is the dialect of q, a pool, connection or transaction of this package; PostgreSQL
// for one that does not say (and for nil).
func DialectOf(q any) Dialect {
	if d, ok := q.(dialected); ok {
		return d.Dialect()
	}
	return Postgres
}

// TxAccess is what SetTxTimeouts does with a transaction's access mode.
type TxAccess int

const (
	TxAccessAsIs      TxAccess = iota // leave it
	TxAccessReadWrite                 // transaction_read_only off
	TxAccessReadOnly                  // transaction_read_only on
)

// SetTxTimeouts bounds the statements and lock waits of the transaction tx to ms milliseconds
// and sets its access mode, where the database can (StatementTimeouts); elsewhere it does
// nothing, and ctx alone bounds a statement.
func SetTxTimeouts(ctx context.Context, tx Querier, ms int64, access TxAccess) error {
	if !DialectOf(tx).StatementTimeouts {
		return nil
	}
	v := strconv.FormatInt(ms, 10)
	switch access {
	case TxAccessReadWrite, TxAccessReadOnly:
		ro := "off"
		if access == TxAccessReadOnly {
			ro = "on"
		}
		_, err := tx.Exec(ctx, `SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $1, true),
	set_config('transaction_read_only', $2, true)`, v, ro)
		return err
	}
	_, err := tx.Exec(ctx, `SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $1, true)`, v)
	return err
}

// SetSessionStatementTimeout bounds the statements of connection c to ms milliseconds for the
// rest of its session, and returns the setting it had, for RestoreSessionStatementTimeout.
// Call it only where the dialect has StatementTimeouts.
func SetSessionStatementTimeout(ctx context.Context, c Querier, ms int64) (was string, err error) {
	err = QueryRowWrite(ctx, c, `SELECT current_setting('statement_timeout'), set_config('statement_timeout', $1, false)`,
		[]any{strconv.FormatInt(ms, 10)}, &was, new(string))
	return was, err
}

// RestoreSessionStatementTimeout puts back the setting SetSessionStatementTimeout returned.
func RestoreSessionStatementTimeout(ctx context.Context, c Querier, was string) error {
	_, err := c.Exec(ctx, `SELECT set_config('statement_timeout', $1, false)`, was)
	return err
}

// ReadCommitted makes the transaction tx, just begun, run at READ COMMITTED whatever the
// session's default, so that each of its statements sees the rows committed before it. On
// MySQL, where a running transaction cannot change its level, the library's transactions
// begin at READ COMMITTED already (MySQLPool).
func ReadCommitted(ctx context.Context, tx Querier) error {
	if DialectOf(tx) == MySQL {
		return nil
	}
	_, err := tx.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
	return err
}
