package sqlbroker

import (
	"database/sql"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// DB is the database a Publisher or Subscriber works through: the caller's pool, wrapped by
// Pgx or StdSQL, or, for a Publisher only, the caller's transaction, wrapped by PgxTx or
// StdTx. The library never closes a pool the caller passed in.
type DB struct {
	pool dbx.Pool    // set for a pool
	tx   dbx.Querier // set for a caller's transaction
}

// Pgx wraps a pgx/v5 pool.
func Pgx(pool *pgxpool.Pool) DB {
	if pool == nil {
		return DB{}
	}
	return DB{pool: dbx.NewPgxPool(pool)}
}

// StdSQL wraps a database/sql pool opened with lib/pq ("postgres") or pgx's stdlib ("pgx").
func StdSQL(db *sql.DB) DB {
	if db == nil {
		return DB{}
	}
	return DB{pool: dbx.NewStdPool(db)}
}

// SQLite wraps a database/sql pool of the SQLite driver modernc.org/sqlite (registered as
// "sqlite": the program imports it, this package does not). The library never closes it. It
// runs the lease claim mode only.
//
// Before its first use by the library, each connection is checked: the database must be in
// WAL mode (journal_mode belongs to the file: the library sets WAL when it is not, and
// refuses the database with an error when SQLite refuses it), and a connection whose
// busy_timeout is 0 gets 5 seconds. synchronous is left as the handle sets it. Every
// transaction of the library begins with BEGIN IMMEDIATE. An in-memory database is one per
// connection unless its DSN shares it (for example "file:/name?vfs=memdb"): Open's
// "sqlite::memory:" does that.
func SQLite(db *sql.DB) DB {
	if db == nil {
		return DB{}
	}
	return DB{pool: dbx.NewSQLitePool(db)}
}

// SQLiteTx wraps a caller's database/sql transaction on SQLite, for a Publisher that writes
// inside it, like StdTx. Begin it with BEGIN IMMEDIATE semantics (modernc.org/sqlite's
// _txlock=immediate DSN option) so that it never fails on a lock upgrade.
func SQLiteTx(tx *sql.Tx) DB {
	if tx == nil {
		return DB{}
	}
	return DB{tx: dbx.NewSQLiteCallerTx(tx)}
}

// PgxTx wraps a caller's pgx transaction, for a Publisher that writes inside it (the outbox
// pattern): its messages become visible exactly when the caller commits.
func PgxTx(tx pgx.Tx) DB {
	if tx == nil {
		return DB{}
	}
	return DB{tx: dbx.PgxTx(tx)}
}

// StdTx wraps a caller's database/sql transaction, like PgxTx.
func StdTx(tx *sql.Tx) DB {
	if tx == nil {
		return DB{}
	}
	return DB{tx: dbx.StdTx(tx)}
}

func (d DB) valid() bool { return d.pool != nil || d.tx != nil }

// dialect says what d's database can do.
func (d DB) dialect() dbx.Dialect {
	if d.tx != nil {
		return dbx.DialectOf(d.tx)
	}
	return dbx.DialectOf(d.pool)
}

// querier is where statements of a publisher run.
func (d DB) querier() dbx.Querier {
	if d.tx != nil {
		return d.tx
	}
	return d.pool
}
