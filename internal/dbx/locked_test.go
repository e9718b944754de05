package dbx_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// LockedQuery runs its query with a snapshot taken once the lock is had, so that the query
// sees what the lock's previous holder committed; both statements form one transaction,
// ended when it returns (the lock, a transaction's, is free again) and rolled back whole when
// the query fails. Through a pgx pool (one round trip), a pgx pool's connection, and
// database/sql (an explicit transaction).
func TestLockedQuery_seesWhatTheLockHolderCommitted(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pg := dbx.NewPgxPool(testdb.Pgx(t))
	conn, err := pg.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	for name, b := range map[string]dbx.Beginner{"pgx pool": pg, "pgx conn": conn, "database/sql": dbx.NewStdPool(testdb.Std(t))} {
		t.Run(name, func(t *testing.T) {
			table := fmt.Sprintf("locked_%d", time.Now().UnixNano())
			_, err := pg.Exec(ctx, "CREATE TABLE "+table+" (n int)")
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = pg.Exec(context.Background(), "DROP TABLE "+table) })
			key := time.Now().UnixNano()
			const lockSQL = "SELECT pg_advisory_xact_lock($1)"

			holder, err := pg.Begin(ctx)
			require.NoError(t, err)
			_, err = holder.Exec(ctx, lockSQL, key)
			require.NoError(t, err)
			_, err = holder.Exec(ctx, "INSERT INTO "+table+" VALUES (1)")
			require.NoError(t, err)
			// The holder commits once the call waits for its lock: the call's query must then see
			// the row committed while it waited.
			committed := make(chan struct{})
			go func() {
				defer close(committed)
				for ctx.Err() == nil {
					var waiting bool
					if dbx.QueryRow(ctx, pg, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
						AND ((classid::bigint << 32) | objid::bigint) = $1)`, []any{key}, &waiting) == nil && waiting {
						break
					}
					time.Sleep(5 * time.Millisecond)
				}
				_ = holder.Commit(ctx)
			}()
			defer func() { <-committed }()
			var seen int
			err = dbx.LockedQuery(ctx, b, lockSQL, []any{key}, "SELECT count(*) FROM "+table, nil, func(rows dbx.Rows) error {
				defer rows.Close()
				for rows.Next() {
					if err := rows.Scan(&seen); err != nil {
						return err
					}
				}
				return rows.Err()
			})
			require.NoError(t, err)
			assert.Equal(t, 1, seen, "the query's snapshot came before the lock was had")
			var free bool
			require.NoError(t, dbx.QueryRow(ctx, pg, "SELECT pg_try_advisory_xact_lock($1)", []any{key}, &free))
			assert.True(t, free, "the lock is still held: the transaction did not end")

			// A query that fails rolls the lock statement back with it.
			err = dbx.LockedQuery(ctx, b, "INSERT INTO "+table+" VALUES (2)", nil, "SELECT 1/0", nil, func(rows dbx.Rows) error {
				defer rows.Close()
				for rows.Next() {
				}
				return rows.Err()
			})
			require.Error(t, err)
			var n int
			require.NoError(t, dbx.QueryRow(ctx, pg, "SELECT count(*) FROM "+table+" WHERE n = 2", nil, &n))
			assert.Zero(t, n, "the first statement's write stayed after the query failed")
		})
	}
}
