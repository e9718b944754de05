package dbx_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// lockedTable creates a table and holds an ACCESS EXCLUSIVE lock on it in a transaction of its
// own until the test ends, so that any statement on it waits.
func lockedTable(t *testing.T, pool dbx.Pool) string {
	t.Helper()
	ctx := context.Background()
	name := "tracker_" + uuid.NewString()[:8]
	if _, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %q (v int)`, name)); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, fmt.Sprintf(`LOCK TABLE %q IN ACCESS EXCLUSIVE MODE`, name)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = tx.Rollback(ctx)
		_, _ = pool.Exec(ctx, fmt.Sprintf(`DROP TABLE %q`, name))
	})
	return name
}

// waiting counts the server's backends waiting on a lock of table.
func waiting(t *testing.T, pool dbx.Pool, table string) int {
	t.Helper()
	var n int64
	err := dbx.QueryRow(context.Background(), pool, `SELECT count(*) FROM pg_locks l
		WHERE NOT l.granted AND l.relation = $1::regclass`, []any{table}, &n)
	if err != nil {
		t.Fatal(err)
	}
	return int(n)
}

func pools(t *testing.T) map[string]dbx.Pool {
	return map[string]dbx.Pool{"pgx": dbx.NewPgxPool(testdb.Pgx(t)), "database/sql": dbx.NewStdPool(testdb.Std(t))}
}

// A statement blocked on a table lock when the tracker stops is cancelled on the server, and
// Stop returns only once the server has ended it: no backend waits on the lock afterwards.
func TestTracker_S11_stopCancelsOnTheServerAndWaits(t *testing.T) {
	for name, pool := range pools(t) {
		t.Run(name, func(t *testing.T) {
			table := lockedTable(t, pool)
			tr := dbx.NewTracker(pool)
			ran := make(chan error, 1)
			go func() {
				ran <- tr.Run(context.Background(), "insert", time.Minute, func(ctx context.Context, q dbx.Querier) error {
					_, err := q.Exec(ctx, fmt.Sprintf(`INSERT INTO %q VALUES (1)`, table))
					return err
				})
			}()
			testdb.Eventually(t, 10*time.Second, "the insert waiting on the lock", func() bool { return waiting(t, pool, table) == 1 })

			res := tr.Stop(context.Background())
			if got := waiting(t, pool, table); got != 0 {
				t.Fatalf("%d backends still wait on the lock after Stop", got)
			}
			if res.Cancelled["insert"] != 1 || len(res.Abandoned) != 0 {
				t.Fatalf("Stop: %+v, want one insert cancelled, none abandoned", res)
			}
			err := <-ran
			if !errors.Is(err, dbx.ErrStopped) || dbx.SQLState(err) != dbx.CodeQueryCanceled {
				t.Fatalf("Run: %v, want ErrStopped and the server's cancel", err)
			}
			if err := tr.Run(context.Background(), "insert", time.Minute, func(context.Context, dbx.Querier) error { return nil }); !errors.Is(err, dbx.ErrStopped) {
				t.Fatalf("Run after Stop: %v, want ErrStopped", err)
			}
		})
	}
}

// The caller's context ending, or the time limit passing, cancels the statement on the server
// too: Run returns once the server has ended it, with the reason and the server's error.
func TestTracker_C1_contextAndLimitCancelOnTheServer(t *testing.T) {
	for name, pool := range pools(t) {
		t.Run(name, func(t *testing.T) {
			table := lockedTable(t, pool)
			tr := dbx.NewTracker(pool)
			defer tr.Stop(context.Background())
			insert := func(ctx context.Context, q dbx.Querier) error {
				_, err := q.Exec(ctx, fmt.Sprintf(`INSERT INTO %q VALUES (1)`, table))
				return err
			}

			ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			defer cancel()
			err := tr.Run(ctx, "insert", time.Minute, insert)
			if !errors.Is(err, context.DeadlineExceeded) || dbx.SQLState(err) != dbx.CodeQueryCanceled {
				t.Fatalf("Run under an ending context: %v, want its cause and the server's cancel", err)
			}
			if got := waiting(t, pool, table); got != 0 {
				t.Fatalf("%d backends still wait on the lock after Run returned", got)
			}

			err = tr.Run(context.Background(), "insert", 200*time.Millisecond, insert)
			if !errors.Is(err, dbx.ErrLimit) || dbx.SQLState(err) != dbx.CodeQueryCanceled {
				t.Fatalf("Run past its limit: %v, want ErrLimit and the server's cancel", err)
			}
			if got := waiting(t, pool, table); got != 0 {
				t.Fatalf("%d backends still wait on the lock after Run returned", got)
			}
		})
	}
}
