package offsets

// The table of a deduplication key repository: one row a key, with the time it expires. A key
// is a byte string (Watermill's message hashers return raw checksum bytes), so it is stored as
// bytea (BLOB on SQLite), never as text.

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
)

// KeyTable names a key repository's table and holds its statements.
type KeyTable struct {
	// Name is the raw table name; Table the quoted, schema-qualified one.
	Name, Table string
	schema      string
	sqlite      bool
}

// NewKeyTable names a key table. schema and name must already be validated; schema is ""
// on SQLite.
func NewKeyTable(schema, name string, sqlite bool) KeyTable {
	return KeyTable{Name: name, Table: ident.Qualified(schema, name), schema: schema, sqlite: sqlite}
}

// SchemaSQL is the idempotent DDL of the table.
func (k KeyTable) SchemaSQL() string {
	if k.sqlite {
		return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %[1]s (
	"key"        BLOB    NOT NULL PRIMARY KEY,
	"expires_at" INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS %[2]s ON %[3]s ("expires_at");
`, k.Table, ident.Qualified(k.schema, k.Name+"_exp"), ident.Quote(k.Name))
	}
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %[1]s (
	"key"        bytea       NOT NULL,
	"expires_at" timestamptz NOT NULL,
	CONSTRAINT %[2]s PRIMARY KEY ("key")
);
CREATE INDEX IF NOT EXISTS %[3]s ON %[1]s ("expires_at");
`, k.Table, ident.Quote(k.Name+"_pkey"), ident.Quote(k.Name+"_exp"))
}

// Create creates the table unless it exists, in one transaction of b; on PostgreSQL under the
// library's schema advisory lock, so that concurrent creators do not race on the catalog.
func (k KeyTable) Create(ctx context.Context, b dbx.Beginner) error {
	if q, ok := b.(dbx.Querier); ok {
		if err := k.Check(ctx, q); err == nil {
			return nil
		}
	}
	return dbx.InTx(ctx, b, func(tx dbx.Tx) error { return k.CreateIn(ctx, tx) })
}

// CreateIn runs the DDL in a transaction the caller holds; on PostgreSQL under the library's
// schema advisory lock, held until that transaction ends.
func (k KeyTable) CreateIn(ctx context.Context, tx dbx.Querier) error {
	if !k.sqlite {
		h := fnv.New32a()
		h.Write([]byte(k.Table))
		if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1::int4, $2::int4)", SchemaLockKey1, int32(h.Sum32())); err != nil {
			return err
		}
	}
	_, err := tx.Exec(ctx, k.SchemaSQL())
	return err
}

// ErrNoKeyTable says that a key repository's table does not exist.
var ErrNoKeyTable = errors.New("the table does not exist")

// Check returns an error matching ErrNoKeyTable when the table does not exist.
func (k KeyTable) Check(ctx context.Context, q dbx.Querier) error {
	var ok bool
	var err error
	if k.sqlite {
		var n int64
		err = dbx.QueryRow(ctx, q, `SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?`, []any{k.Name}, &n)
		ok = n > 0
	} else {
		err = dbx.QueryRow(ctx, q, `SELECT to_regclass($1) IS NOT NULL`, []any{k.Table}, &ok)
	}
	if err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("table %s: %w", k.Table, ErrNoKeyTable)
	}
	return nil
}

// Claim writes key, to expire after window, unless the table holds it unexpired, and
// reports whether it wrote it (false: the key is a duplicate). A key that expired is written
// again. On PostgreSQL, a key written by a transaction not yet committed makes the statement
// wait for that transaction's end: the key is a duplicate if it committed, and is written
// here if it rolled back.
func (k KeyTable) Claim(ctx context.Context, q dbx.Querier, key []byte, window time.Duration) (bool, error) {
	var sql string
	var args []any
	if k.sqlite {
		sql = fmt.Sprintf(`INSERT INTO %[1]s ("key", "expires_at") VALUES (?1, %[2]s + ?2)
ON CONFLICT ("key") DO UPDATE SET "expires_at" = excluded."expires_at" WHERE %[1]s."expires_at" <= %[2]s
RETURNING 1`, k.Table, sqliteNow)
		args = []any{key, window.Milliseconds()}
	} else {
		sql = fmt.Sprintf(`INSERT INTO %[1]s AS k ("key", "expires_at") VALUES ($1, clock_timestamp() + $2 * interval '1 microsecond')
ON CONFLICT ("key") DO UPDATE SET "expires_at" = excluded."expires_at" WHERE k."expires_at" <= clock_timestamp()
RETURNING 1`, k.Table)
		args = []any{key, window.Microseconds()}
	}
	rows, err := q.Query(ctx, sql, args...)
	if err != nil {
		return false, err
	}
	defer rows.Close()
	wrote := rows.Next()
	rows.Close()
	return wrote, rows.Err()
}

// Prune deletes up to limit expired keys and returns how many it deleted.
func (k KeyTable) Prune(ctx context.Context, q dbx.Querier, limit int) (int64, error) {
	if k.sqlite {
		return q.Exec(ctx, fmt.Sprintf(`DELETE FROM %[1]s WHERE "key" IN (
	SELECT "key" FROM %[1]s WHERE "expires_at" <= %[2]s ORDER BY "expires_at" LIMIT ?1)`, k.Table, sqliteNow), limit)
	}
	// SKIP LOCKED: a key that a running transaction is writing again is left to it.
	return q.Exec(ctx, fmt.Sprintf(`DELETE FROM %[1]s WHERE "key" = ANY (ARRAY(
	SELECT "key" FROM %[1]s WHERE "expires_at" <= clock_timestamp() ORDER BY "expires_at" LIMIT $1 FOR UPDATE SKIP LOCKED))
	AND "expires_at" <= clock_timestamp()`, k.Table), limit)
}

// IsSQLite reports whether the table is in a SQLite database.
func (k KeyTable) IsSQLite() bool { return k.sqlite }
