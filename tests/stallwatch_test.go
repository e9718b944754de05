package tests

import (
	"bytes"
	"context"
	"fmt"
	"runtime/pprof"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// stallAfter is how long a subscriber that has claimed before may claim nothing more before
// watchStall captures what it is doing.
const stallAfter = 20 * time.Second

// watchStall keeps, for a test that fails, what sub was doing once it stopped claiming: when
// its Claimed count has stood still for stallAfter after it had moved, the stats, the stacks
// of the library's and the drivers' goroutines and the test database's sessions are captured
// (at most once a stall). The capture is logged only if the test fails: a subscriber that is
// simply idle costs one capture and no output. It is there for the rare TestReconnect run
// whose subscriber stops receiving at a restart of the server.
func watchStall(t *testing.T, sub *sqlbroker.Subscriber) {
	pool := testdb.Pgx(t) // here, not in the goroutine: it may fail the test
	var mu sync.Mutex
	var captured string
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		var last int64
		since, taken := time.Now(), false
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			c := sub.Stats().Claimed
			if c != last {
				last, since, taken = c, time.Now(), false
				continue
			}
			if c == 0 || taken || time.Since(since) < stallAfter {
				continue
			}
			taken = true
			s := stallSnapshot(pool, sub, time.Since(since))
			mu.Lock()
			captured = s
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		close(stop)
		<-done
		mu.Lock()
		defer mu.Unlock()
		if t.Failed() && captured != "" {
			t.Logf("the subscriber had stopped claiming:\n%s", captured)
		}
	})
}

func stallSnapshot(pool *pgxpool.Pool, sub *sqlbroker.Subscriber, idle time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "at %s, no claim for %s; stats %+v\n", time.Now().Format(time.RFC3339Nano), idle.Round(time.Second), sub.Stats())
	var stacks bytes.Buffer
	_ = pprof.Lookup("goroutine").WriteTo(&stacks, 2)
	for _, g := range strings.Split(stacks.String(), "\n\n") {
		if strings.Contains(g, "watermill-sqlbroker.") || strings.Contains(g, "jackc/pgx") || strings.Contains(g, "lib/pq") {
			b.WriteString(g)
			b.WriteString("\n\n")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var horizon string
	if err := pool.QueryRow(ctx, `SELECT pg_current_snapshot()::text`).Scan(&horizon); err != nil {
		fmt.Fprintf(&b, "snapshot: %v\n", err)
	} else {
		fmt.Fprintf(&b, "snapshot (xmin:xmax:running): %s\n", horizon)
	}
	rows, err := pool.Query(ctx, `SELECT pid, coalesce(state, ''), coalesce(wait_event_type || '/' || wait_event, ''),
		coalesce(backend_xid::text, ''), coalesce(backend_xmin::text, ''),
		coalesce((now() - xact_start)::text, ''), left(query, 160)
		FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()`)
	if err != nil {
		fmt.Fprintf(&b, "sessions: %v\n", err)
		return b.String()
	}
	defer rows.Close()
	for rows.Next() {
		var pid int
		var state, wait, xid, xmin, age, q string
		if err := rows.Scan(&pid, &state, &wait, &xid, &xmin, &age, &q); err != nil {
			fmt.Fprintf(&b, "sessions: %v\n", err)
			break
		}
		fmt.Fprintf(&b, "session %d %s wait=%s xid=%s xmin=%s xact_age=%s: %s\n", pid, state, wait, xid, xmin, age, strings.Join(strings.Fields(q), " "))
	}
	if err := rows.Err(); err != nil {
		fmt.Fprintf(&b, "sessions: %v\n", err)
	}
	return b.String()
}
