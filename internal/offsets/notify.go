package offsets

import (
	"context"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// notifySQL sends one NOTIFY on channel $1 with payload $2: a function call, so that both
// are parameters (a NOTIFY statement takes neither as one).
const notifySQL = `SELECT pg_notify($1, $2)`

// NotifyTable sends a NOTIFY of the messages table named table on channel through q, as
// Insert's statement does: the payload is the table's quoted name, which is how listeners
// tell the topics apart. PostgreSQL only: SQLite has no NOTIFY.
func NotifyTable(ctx context.Context, q dbx.Querier, channel, table string) error {
	_, err := q.Exec(ctx, notifySQL, channel, table)
	return err
}
