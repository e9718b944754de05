package offsets_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
	"github.com/sqlbroker/watermill-sqlbroker/offsets"
)

func TestDiagDrain(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("DIAG_N"))
	if n == 0 {
		t.Skip()
	}
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	tables := offsets.NewTables("", "sqlbroker_", topic)
	pool := testdb.Pgx(t)
	db := dbx.NewPgxPool(pool)
	if err := tables.Create(ctx, db); err != nil {
		t.Fatal(err)
	}
	if os.Getenv("DIAG_NOAV") != "" {
		pool.Exec(ctx, "ALTER TABLE "+tables.Claims+" SET (autovacuum_enabled = false)")
	}
	store := offsets.NewStore(tables, true)
	for done := 0; done < n; done += 10000 {
		rows := make([]offsets.Row, 10000)
		for i := range rows {
			rows[i] = offsets.Row{UUID: fmt.Sprint(i), Payload: make([]byte, 256), Metadata: "{}"}
		}
		if err := store.Insert(ctx, db, rows, ""); err != nil {
			t.Fatal(err)
		}
	}
	pool.Exec(ctx, "ANALYZE "+tables.Messages)
	conn, plans := explainedConn(t, ctx)
	q := dbx.PgxConn(conn)
	gid, _ := store.EnsureGroup(ctx, q, "g", false)
	conn.Exec(ctx, "SET auto_explain.log_min_duration = 1000000")
	var tc, ta time.Duration
	start := time.Now()
	for i := 0; ; i++ {
		if i%500 == 499 {
			conn.Exec(ctx, "SET auto_explain.log_min_duration = 0")
			conn.Exec(ctx, "SET auto_explain.log_buffers = on")
			
		}
		t0 := time.Now()
		c, err := store.Claim(ctx, q, gid, int64(i+1), time.Minute, 100, i%100 == 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(c) == 0 {
			break
		}
		t1 := time.Now()
		fs := make([]offsets.Fenced, len(c))
		for j := range c {
			fs[j] = offsets.Fenced{Offset: c[j].Offset, Token: int64(i + 1)}
		}
		if _, err := store.Ack(ctx, q, gid, fs); err != nil {
			t.Fatal(err)
		}
		tc += t1.Sub(t0)
		ta += time.Since(t1)
		if i%500 == 499 {
			for _, p := range plans() {
				t.Log(p)
			}
			conn.Exec(ctx, "SET auto_explain.log_min_duration = 1000000")
			t.Logf("after %d: claim %.2fms ack %.2fms per batch, %.0f msg/s", (i+1)*100, float64(tc.Microseconds())/500/1000, float64(ta.Microseconds())/500/1000, 50000/time.Since(start).Seconds())
			tc, ta, start = 0, 0, time.Now()
		}
	}
}
