package offsets

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// MissingTableError says that a table of the topic does not exist.
type MissingTableError struct {
	Topic string
	Table string
	// Database names the database where it is missing (dbx.Dialect.Name); "" is PostgreSQL.
	Database string
}

func (e *MissingTableError) Error() string {
	if e.Database == dbx.MySQL.Name {
		return fmt.Sprintf("topic %q: table %s does not exist in the MySQL database: set InitializeSchema: true, or create it with the SQL of sqlbroker.MySQLSchemaSQL(%q, ...) (sqlbroker schema -url mysql://... %s)", e.Topic, e.Table, e.Topic, e.Topic)
	}
	if e.Database == dbx.SQLite.Name {
		return fmt.Sprintf("topic %q: table %s does not exist in the SQLite database: set InitializeSchema: true, or create it with the SQL of sqlbroker.SQLiteSchemaSQL(%q, ...) (sqlbroker schema -url sqlite:FILE %s)", e.Topic, e.Table, e.Topic, e.Topic)
	}
	return fmt.Sprintf("topic %q: table %s does not exist: set InitializeSchema: true, or create it with the SQL of sqlbroker.SchemaSQL(%q, ...) in a migration", e.Topic, e.Table, e.Topic)
}

// VersionError says that the tables were created by another version of the schema.
type VersionError struct {
	Topic string
	Table string
	Found string
	Want  int
}

func (e *VersionError) Error() string {
	if e.Found == sqliteNoDeliverAt {
		return fmt.Sprintf("topic %q: table %s carries schema version v%d without its deliver_at column (delayed messages), which this library needs: set InitializeSchema: true, which adds the column in place", e.Topic, e.Table, e.Want)
	}
	if e.Found == pgNoParkedTop {
		return fmt.Sprintf("topic %q: table %s lacks its parked_top column (order by key), which this library needs: set InitializeSchema: true, which adds the column in place, or run the SQL of sqlbroker.SchemaSQL(%q, ...) in a migration", e.Topic, e.Table, e.Topic)
	}
	if e.Found == sqliteNoOrderKey {
		return fmt.Sprintf("topic %q: table %s lacks its order_key column (order by key), which this library needs: set InitializeSchema: true, which adds the column in place", e.Topic, e.Table)
	}
	if upgradable(e.Found) {
		return fmt.Sprintf("topic %q: table %s carries schema version %q, this library needs v%d: stop the consumers and publishers of the older library, then set InitializeSchema: true, or run the SQL of sqlbroker.SchemaSQL(%q, ...) in a migration (it upgrades the tables of earlier versions in place)", e.Topic, e.Table, e.Found, e.Want, e.Topic)
	}
	return fmt.Sprintf("topic %q: table %s carries schema version %q, this library needs v%d: migrate the tables or use the matching library version", e.Topic, e.Table, e.Found, e.Want)
}

// lockKey2 is the second half of the schema lock key for the tables.
func (t Tables) lockKey2() int32 {
	h := fnv.New32a()
	h.Write([]byte(t.Messages))
	return int32(h.Sum32())
}

// Create makes sure the tables exist. When they already do, with this schema version, it only
// reads the catalog: the DDL takes table locks (CREATE INDEX IF NOT EXISTS waits for every
// open writer of the table), which a running system must not queue behind. Otherwise it runs
// SchemaSQL in one transaction, under the library's schema advisory lock, so that concurrent
// creators of one topic do not race on the catalog.
func (t Tables) Create(ctx context.Context, b dbx.Beginner) error {
	if q, ok := b.(dbx.Querier); ok {
		err := t.Check(ctx, q)
		if err == nil || !IsMissing(err) && !isUpgradable(err) {
			return err
		}
	}
	return dbx.InTx(ctx, b, func(tx dbx.Tx) error { return t.CreateIn(ctx, tx) })
}

// CreateIn runs SchemaSQL inside a transaction the caller holds, serialised with other
// creators (on PostgreSQL by the schema advisory lock, on SQLite by the write transaction).
func (t Tables) CreateIn(ctx context.Context, tx dbx.Querier) error {
	return t.database().createIn(ctx, t, tx)
}

// Check verifies that the three tables exist and carry this schema version (M7).
func (t Tables) Check(ctx context.Context, q dbx.Querier) error {
	return t.database().check(ctx, t, q, false)
}

// isUpgradable reports whether err is a VersionError for tables that SchemaSQL upgrades.
func isUpgradable(err error) bool {
	var v *VersionError
	return errors.As(err, &v) && (upgradable(v.Found) || v.Found == sqliteNoDeliverAt || v.Found == sqliteNoOrderKey || v.Found == pgNoParkedTop)
}

// upgradable reports whether found is the comment of PostgreSQL tables that SchemaSQL upgrades.
func upgradable(found string) bool {
	for _, n := range upgradableVersions {
		if found == fmt.Sprintf("%s%d", schemaCommentPrefix, n) {
			return true
		}
	}
	return false
}

// IsMissing reports whether err is a MissingTableError.
func IsMissing(err error) bool {
	var m *MissingTableError
	return errors.As(err, &m)
}
