package advisory

import (
	"context"
	"fmt"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// checkPinned is the second half of the session check (A5). The probe of setup passes
// through a transaction-mode pooler whenever the pooler happens to hand the same server
// connection to each of its statements, which an idle pooler does (PgBouncer reuses the
// server connection released last). So this check pins a server connection with an open
// transaction on another client connection, taken from the pool: on a session connection (direct,
// or through session pooling) that one is a server session of its own and the lock
// connection keeps its backend; through transaction pooling, either the other client got
// the lock connection's server connection (the one released last), or the lock connection's
// next statement runs on another one.
func checkPinned(ctx context.Context, pool dbx.Pool, conn dbx.Conn) error {
	var pid1, pidOther, pid2 int64
	if err := dbx.QueryRow(ctx, conn, pidSQL, nil, &pid1); err != nil {
		return fmt.Errorf("advisory: check the lock connection: %w", err)
	}
	// A connection of the pool's own: on a bounded *sql.DB a second dedicated connection
	// would count against the lock connections' share of the pool.
	other, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("advisory: check the lock connection: take a second connection: %w", err)
	}
	defer other.Release()
	err = dbx.InTx(ctx, other, func(tx dbx.Tx) error {
		if err := dbx.QueryRow(ctx, tx, pidSQL, nil, &pidOther); err != nil {
			return err
		}
		return dbx.QueryRow(ctx, conn, pidSQL, nil, &pid2)
	})
	if err != nil {
		return fmt.Errorf("advisory: check the lock connection: %w", err)
	}
	if pidOther == pid1 || pid2 != pid1 {
		return fmt.Errorf("%w (backend pid %d, then %d while another connection's transaction ran on backend %d)",
			ErrNotSessionConnection, pid1, pid2, pidOther)
	}
	return nil
}
