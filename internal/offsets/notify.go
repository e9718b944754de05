package offsets

import (
	"context"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// NotifyTable sends a NOTIFY of the messages table named table on channel through q, as
// Insert's statement does: the payload is the table's quoted name, which is how listeners
// tell the topics apart. It does nothing where the database has no NOTIFY
// (dbx.Dialect.Notify).
func NotifyTable(ctx context.Context, q dbx.Querier, channel, table string) error {
	return databaseOf(dbx.DialectOf(q)).notify(ctx, q, channel, table)
}
