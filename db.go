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

// querier is where statements of a publisher run.
func (d DB) querier() dbx.Querier {
	if d.tx != nil {
		return d.tx
	}
	return d.pool
}
