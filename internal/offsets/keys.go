package offsets

// The table of a deduplication key repository: one row a key, with the time it expires. A key
// is a byte string (Watermill's message hashers return raw checksum bytes), so it is stored as
// bytea (BLOB on SQLite), never as text.

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// KeyTable names a key repository's table and holds its statements.
type KeyTable struct {
	// Name is the raw table name; Table the quoted, schema-qualified one.
	Name, Table string
	schema      string
	db          database
}

// NewKeyTable names a key table in a database of dialect d. schema and name must already be
// validated; schema is "" where the database has no schemas.
func NewKeyTable(d dbx.Dialect, schema, name string) KeyTable {
	db := databaseOf(d)
	return KeyTable{Name: name, Table: db.quote(schema, name), schema: schema, db: db}
}

// SchemaSQL is the idempotent DDL of the table.
func (k KeyTable) SchemaSQL() string { return k.db.keySchemaSQL(k) }

// Create creates the table unless it exists, in one transaction of b, serialised with other
// creators as CreateIn is.
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
	return k.db.keyCreateIn(ctx, k, tx)
}

// ErrNoKeyTable says that a key repository's table does not exist.
var ErrNoKeyTable = errors.New("the table does not exist")

// Check returns an error matching ErrNoKeyTable when the table does not exist.
func (k KeyTable) Check(ctx context.Context, q dbx.Querier) error {
	ok, err := k.db.keyExists(ctx, k, q)
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
// again.
func (k KeyTable) Claim(ctx context.Context, q dbx.Querier, key []byte, window time.Duration) (bool, error) {
	return k.db.keyClaim(ctx, k, q, key, window)
}

// wroteRow reports whether a writing statement returned a row.
func wroteRow(rows dbx.Rows, err error) (bool, error) {
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
	return k.db.keyPrune(ctx, k, q, limit)
}
