package dbx_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

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

// A time limit, or the caller's context, ends a wait for a connection of an exhausted pool:
// Run returns the deadline's error, takes nothing from the pool, and the next call runs.
func TestTracker_limitAndContextBoundTheAcquire(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pp, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pp.Close()
	pool := dbx.NewPgxPool(pp)
	tr := dbx.NewTracker(pool)
	defer tr.Stop(context.Background())
	held, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ran := false
	fn := func(ctx context.Context, q dbx.Querier) error { ran = true; return nil }

	start := time.Now()
	err = tr.Run(context.Background(), "select", 200*time.Millisecond, fn)
	if !errors.Is(err, context.DeadlineExceeded) || ran {
		t.Fatalf("Run past its limit while the pool is exhausted: %v (fn ran: %v), want the deadline's error", err, ran)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("Run returned after %v, its limit was 200ms", d)
	}
	cause := errors.New("the caller gave up")
	ctx, cancel := context.WithTimeoutCause(context.Background(), 200*time.Millisecond, cause)
	defer cancel()
	err = tr.Run(ctx, "select", time.Minute, fn)
	if !errors.Is(err, context.DeadlineExceeded) || ran {
		t.Fatalf("Run under an ending context while the pool is exhausted: %v (fn ran: %v), want the context's error", err, ran)
	}
	if got := pp.Stat().AcquiredConns(); got != 1 {
		t.Fatalf("%d connections acquired, want only the one the test holds", got)
	}
	held.Release()
	if err := tr.Run(context.Background(), "select", time.Minute, fn); err != nil || !ran {
		t.Fatalf("Run once a connection is free: %v (fn ran: %v)", err, ran)
	}
}

// Calls that follow one another on the same tracker, some cancelled while they wait for a
// connection, some while their statement runs, some not at all, each end for their own
// reason: what one call's context or limit did never reaches another's, and every
// connection goes back.
func TestTracker_eachCallEndsForItsOwnReason(t *testing.T) {
	for name, pool := range pools(t) {
		t.Run(name, func(t *testing.T) {
			tr := dbx.NewTracker(pool)
			defer tr.Stop(context.Background())
			const workers, calls = 4, 60
			causes := make([]error, workers*calls)
			for i := range causes {
				causes[i] = fmt.Errorf("cause %d", i)
			}
			errs := make(chan error, workers)
			for w := range workers {
				go func() {
					for j := range calls {
						i := w*calls + j
						ctx, cancel := context.WithTimeoutCause(context.Background(), time.Duration(j%4)*time.Millisecond, causes[i])
						limit := time.Duration(0)
						if j%5 == 0 {
							limit = 2 * time.Millisecond
						}
						err := tr.Run(ctx, "sleep", limit, func(ctx context.Context, q dbx.Querier) error {
							_, err := q.Exec(ctx, "SELECT pg_sleep(0.002)")
							return err
						})
						cancel()
						for k, c := range causes {
							if k != i && errors.Is(err, c) {
								errs <- fmt.Errorf("call %d ended with the cause of call %d: %v", i, k, err)
								return
							}
						}
						if err != nil && !errors.Is(err, causes[i]) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, dbx.ErrLimit) {
							errs <- fmt.Errorf("call %d: %v, want its own cause, its limit or its deadline", i, err)
							return
						}
					}
					errs <- nil
				}()
			}
			for range workers {
				if err := <-errs; err != nil {
					t.Fatal(err)
				}
			}
			if n := tr.Running(); n != 0 {
				t.Fatalf("%d statements still running", n)
			}
		})
	}
}
