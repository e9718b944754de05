package sqlbroker

import (
	"database/sql"
	"reflect"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// DB is the database a Publisher or Subscriber works through: the caller's pool, wrapped by
// Pgx, StdSQL, SQLite or MySQL, or, for a Publisher only, the caller's transaction, wrapped by
// PgxTx, StdTx, SQLiteTx or MySQLTx; or the pool of a Broker (Broker.DB). The library never closes a
// pool the caller passed in.
type DB struct {
	pool dbx.Pool    // set for a pool
	tx   dbx.Querier // set for a caller's transaction
	err  error       // set when the wrapper refused what it was given: every constructor returns it
}

// Pgx wraps a pgx/v5 pool.
func Pgx(pool *pgxpool.Pool) DB {
	if pool == nil {
		return DB{}
	}
	return DB{pool: dbx.NewPgxPool(pool)}
}

// StdSQL wraps a database/sql pool opened with lib/pq ("postgres") or pgx's stdlib ("pgx").
// A pool of a SQLite driver is refused: every constructor given the result returns a
// ConfigError that says to use SQLite instead.
func StdSQL(db *sql.DB) DB {
	return stdSQL(db, "StdSQL", dbx.NewStdPool)
}

// StdSQLPrepared is StdSQL whose statements are prepared once on each connection of the pool
// and then run as prepared, as pgx runs them by default. Through lib/pq, which otherwise sends
// every statement with arguments unprepared, the server then plans each of the library's
// statements once per connection instead of at every run, and a statement costs one round trip
// instead of two: drains and publishing are markedly faster (see BENCHMARKS.md). A connection
// keeps at most 256 of the library's statements prepared; a statement the server refuses as
// prepared after a change of its tables is prepared again.
//
// Not behind a transaction-mode pooler (PgBouncer with pool_mode = transaction) unless it keeps
// prepared statements itself (PgBouncer 1.21 and later with max_prepared_statements set): a
// prepared statement belongs to the server session that prepared it, and such a pooler sends a
// client's next statement to any session.
func StdSQLPrepared(db *sql.DB) DB {
	return stdSQL(db, "StdSQLPrepared", dbx.NewStdPoolPrepared)
}

func stdSQL(db *sql.DB, name string, wrap func(*sql.DB) *dbx.StdPool) DB {
	if db == nil {
		return DB{}
	}
	if driver, ok := sqliteDriver(db); ok {
		return DB{err: &ConfigError{Field: "db", Value: "a database/sql pool of the driver " + driver,
			Reason: "is SQLite's: use sqlbroker.SQLite, not sqlbroker." + name + ", which speaks PostgreSQL"}}
	}
	if driver, ok := mysqlDriver(db); ok {
		return DB{err: &ConfigError{Field: "db", Value: "a database/sql pool of the driver " + driver,
			Reason: "is MySQL's: use sqlbroker.MySQL, not sqlbroker." + name + ", which speaks PostgreSQL"}}
	}
	return DB{pool: wrap(db)}
}

// driverName is the Go type of db's driver, as package path and type name ("" when db has
// none): a registered name is the program's choice, the type is the driver's.
func driverName(db *sql.DB) string {
	d := db.Driver()
	if d == nil {
		return ""
	}
	t := reflect.TypeOf(d)
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return t.PkgPath() + "." + t.Name()
}

// mysqlDriver reports whether db's driver is a MySQL driver (github.com/go-sql-driver/mysql's
// *mysql.MySQLDriver), and names it.
func mysqlDriver(db *sql.DB) (string, bool) {
	name := driverName(db)
	return name, strings.Contains(strings.ToLower(name), "mysql")
}

// sqliteDriver reports whether db's driver is a SQLite driver, and names it. It reads the
// driver's Go type (modernc.org/sqlite's *sqlite.Driver, github.com/mattn/go-sqlite3's
// *sqlite3.SQLiteDriver, ...), not a registered name, which a program may choose, and
// connects to nothing.
func sqliteDriver(db *sql.DB) (string, bool) {
	name := driverName(db)
	return name, strings.Contains(strings.ToLower(name), "sqlite")
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

// MySQL wraps a database/sql pool of MySQL 8 or MariaDB 10.6 and newer, opened with the
// driver github.com/go-sql-driver/mysql (registered as "mysql": the program imports it, this
// package does not). The library never closes it. It runs the lease claim mode only, without
// order by key, and subscribers poll (MySQL has no NOTIFY). Every transaction of the library
// runs at READ COMMITTED, whatever the session's default.
//
// Open the pool with interpolateParams=true in the DSN: the driver then sends each statement
// with its arguments in one round trip, instead of preparing it, running it and closing it
// (three).
func MySQL(db *sql.DB) DB {
	if db == nil {
		return DB{}
	}
	if driver, ok := mysqlDriver(db); !ok && driver != "" {
		return DB{err: &ConfigError{Field: "db", Value: "a database/sql pool of the driver " + driver,
			Reason: "is not MySQL's: sqlbroker.MySQL takes a pool of github.com/go-sql-driver/mysql"}}
	}
	return DB{pool: dbx.NewMySQLPool(db)}
}

// MySQLTx wraps a caller's database/sql transaction on MySQL or MariaDB, for a Publisher that
// writes inside it, like StdTx. A transaction that publishes to a topic holds back the topic's
// other publishers until it ends (offsets commit in order on MySQL): keep it short.
func MySQLTx(tx *sql.Tx) DB {
	if tx == nil {
		return DB{}
	}
	return DB{tx: dbx.NewMySQLCallerTx(tx)}
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

// refused is the error of a wrapper that refused what it was given, or nil.
func (d DB) refused() error { return d.err }

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
