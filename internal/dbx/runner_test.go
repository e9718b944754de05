package dbx_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// observed is a connection that reports each cancel request it sent.
type observed struct {
	dbx.Conn
	sent chan struct{}
}

func (o observed) Cancel(ctx context.Context) (bool, error) {
	closes, err := o.Conn.Cancel(ctx)
	if err == nil {
		select {
		case o.sent <- struct{}{}:
		default:
		}
	}
	return closes, err
}

// A statement on a dedicated connection whose context ends is cancelled on the server, and
// RunOn returns once the server has ended it; the connection, kept, runs the next statement
// as the same session.
func TestRunOn_S11_cancelsOnTheServerAndWaits(t *testing.T) {
	for name, pool := range pools(t) {
		t.Run(name, func(t *testing.T) {
			table := lockedTable(t, pool)
			conn, err := pool.Dedicated(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Destroy()
			pid, err := conn.PID(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			go func() {
				testdb.Eventually(t, 10*time.Second, "the insert waiting on the lock", func() bool { return waiting(t, pool, table) == 1 })
				cancel()
			}()
			cancelled, err := dbx.RunOn(ctx, conn, 100*time.Millisecond, func() error {
				_, err := conn.Exec(context.Background(), fmt.Sprintf(`INSERT INTO %q VALUES (1)`, table))
				return err
			})
			if !cancelled || dbx.SQLState(err) != dbx.CodeQueryCanceled {
				t.Fatalf("RunOn: cancelled %t, %v; want the server's cancel", cancelled, err)
			}
			if got := waiting(t, pool, table); got != 0 {
				t.Fatalf("%d backends still wait on the lock after RunOn returned", got)
			}
			again, err := conn.PID(context.Background())
			if err != nil || again != pid {
				t.Fatalf("after the cancel: pid %d, %v; want the same session %d", again, err, pid)
			}
		})
	}
}

// A cancel request that reaches the server before the statement does is sent again until
// the statement ends.
func TestRunOn_S11_cancelSentAgainUntilTheStatementEnds(t *testing.T) {
	pool := dbx.NewPgxPool(testdb.Pgx(t))
	table := lockedTable(t, pool)
	raw, err := pool.Dedicated(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Destroy()
	conn := observed{Conn: raw, sent: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	cancelled, err := dbx.RunOn(ctx, conn, 100*time.Millisecond, func() error {
		cancel()
		<-conn.sent // the first request met an idle backend
		qctx, qcancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer qcancel()
		_, err := conn.Exec(qctx, fmt.Sprintf(`INSERT INTO %q VALUES (1)`, table))
		return err
	})
	if !cancelled || dbx.SQLState(err) != dbx.CodeQueryCanceled {
		t.Fatalf("RunOn: cancelled %t, %v; want the server's cancel", cancelled, err)
	}
}

// Without a context that can end, or with one that has ended, no cancel is ever sent.
func TestRunOn_contextThatCannotEndOrHasEnded(t *testing.T) {
	pool := dbx.NewPgxPool(testdb.Pgx(t))
	conn, err := pool.Dedicated(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Destroy()
	ran := false
	cancelled, err := dbx.RunOn(context.Background(), conn, time.Millisecond, func() error { ran = true; return nil })
	if cancelled || err != nil || !ran {
		t.Fatalf("RunOn: cancelled %t, %v, ran %t", cancelled, err, ran)
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	why := fmt.Errorf("stopped")
	cancel(why)
	ran = false
	cancelled, err = dbx.RunOn(ctx, conn, time.Millisecond, func() error { ran = true; return nil })
	if cancelled || err != why || ran {
		t.Fatalf("RunOn: cancelled %t, %v, ran %t; want %v without running", cancelled, err, ran, why)
	}
}
