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

// onePool returns a pgx pool of one connection, closed when the test ends, and a tracker on it.
func onePool(t *testing.T) (*pgxpool.Pool, dbx.Pool, *dbx.Tracker) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pp, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	pool := dbx.NewPgxPool(pp)
	tr := dbx.NewTracker(pool)
	t.Cleanup(func() {
		tr.Stop(context.Background())
		pp.Close()
	})
	return pp, pool, tr
}

// A time limit, or the caller's context, ends a wait for a connection of an exhausted pool:
// Run returns the deadline's error, takes nothing from the pool, and the next call runs.
func TestTracker_limitAndContextBoundTheAcquire(t *testing.T) {
	pp, pool, tr := onePool(t)
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

// RunWaiting waits for a connection longer than its statement's limit: it gets the
// connection freed after 300 ms (where Run with the same limit gives up), and its statement's
// limit counts from then, so a statement that runs past it is still cancelled on the server.
func TestTracker_runWaitingWaitsLongerForAConnection(t *testing.T) {
	pp, pool, tr := onePool(t)
	hold := func() {
		t.Helper()
		held, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		time.AfterFunc(300*time.Millisecond, held.Release)
	}
	sleep := func(d string) func(ctx context.Context, q dbx.Querier) error {
		return func(ctx context.Context, q dbx.Querier) error {
			_, err := q.Exec(ctx, "SELECT pg_sleep("+d+")")
			return err
		}
	}

	hold()
	if err := tr.Run(context.Background(), "select", 150*time.Millisecond, sleep("0")); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Run with a 150ms limit on a pool held 300ms: %v, want the deadline's error", err)
	}
	for deadline := time.Now().Add(5 * time.Second); pp.Stat().AcquiredConns() > 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the held connection was not given back")
		}
	}

	hold()
	start := time.Now()
	if err := tr.RunWaiting(context.Background(), "select", 5*time.Second, 150*time.Millisecond, sleep("0.1")); err != nil {
		t.Fatalf("RunWaiting on a pool held 300ms, a 100ms statement with a 150ms limit: %v", err)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Fatalf("RunWaiting returned after %v, before the connection was freed", d)
	}

	hold()
	start = time.Now()
	err := tr.RunWaiting(context.Background(), "select", 5*time.Second, 150*time.Millisecond, sleep("10"))
	if !errors.Is(err, dbx.ErrLimit) {
		t.Fatalf("RunWaiting, a 10s statement with a 150ms limit: %v, want it cancelled on the server", err)
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Fatalf("the statement was cancelled %v after the call began: its limit counted from the 5s wait, not from the connection", d)
	}
	if got := pp.Stat().AcquiredConns(); got != 0 {
		t.Fatalf("%d connections still acquired", got)
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
