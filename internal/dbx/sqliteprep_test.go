package dbx_test

import (
	"bytes"
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// On SQLite a statement with arguments is prepared once per connection and its rows scan as
// database/sql's would; a statement that Cancel interrupts ends with an InterruptedError and
// leaves the connection and its prepared statements usable.
func TestSQLitePrepared_oncePerConnectionAndKeptThroughACancel(t *testing.T) {
	h := testdb.SQLite(t)
	h.SetMaxOpenConns(1)
	pool := dbx.NewSQLitePool(h)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE t (i INTEGER, s TEXT, b BLOB, f REAL, n TEXT)`); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if _, err := pool.Exec(ctx, `INSERT INTO t VALUES ($1, $2, $3, $4, NULL)`, i, "s", []byte{byte(i), 0}, 0.5); err != nil {
			t.Fatal(err)
		}
	}
	before := dbx.SQLitePrepares(pool)
	const q = `SELECT i, s, b, f, n FROM t WHERE i >= $1 ORDER BY i`
	for range 3 {
		rows, err := pool.Query(ctx, q, 3)
		if err != nil {
			t.Fatal(err)
		}
		var got []int64
		for rows.Next() {
			var i int64
			var s string
			var b []byte
			var f float64
			var n sql.NullString
			if err := rows.Scan(&i, &s, &b, &f, &n); err != nil {
				t.Fatal(err)
			}
			if s != "s" || !bytes.Equal(b, []byte{byte(i), 0}) || f != 0.5 || n.Valid {
				t.Fatalf("row %d: %q %v %v %v", i, s, b, f, n)
			}
			got = append(got, i)
		}
		rows.Close()
		if err := rows.Err(); err != nil || len(got) != 2 || got[0] != 3 || got[1] != 4 {
			t.Fatalf("rows %v, %v", got, err)
		}
	}
	if n := dbx.SQLitePrepares(pool) - before; n != 1 {
		t.Fatalf("%d statements prepared for three runs on one connection, want 1", n)
	}

	c, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	done := make(chan error, 1)
	go func() {
		// Long enough to be interrupted: a count to a billion.
		var n int64
		done <- dbx.QueryRow(ctx, c, `WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r WHERE x < $1) SELECT count(*) FROM r`, []any{int64(1e9)}, &n)
	}()
	// Cancel interrupts the statement running now, if any: sent until the statement ends,
	// since it may not have begun at the first.
	deadline := time.After(10 * time.Second)
wait:
	for {
		if _, err := c.Cancel(ctx); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-done:
			if dbx.SQLState(err) != dbx.CodeQueryCanceled {
				t.Fatalf("interrupted statement: %v", err)
			}
			break wait
		case <-time.After(20 * time.Millisecond):
		case <-deadline:
			t.Fatal("the interrupt did not end the statement")
		}
	}
	prepared := dbx.SQLitePrepares(pool)
	rows, err := c.Query(ctx, q, 4)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for rows.Next() {
		n++
	}
	rows.Close()
	if n != 1 {
		t.Fatalf("%d rows after the interrupt, want 1", n)
	}
	if dbx.SQLitePrepares(pool) != prepared {
		t.Fatal("the connection's statements were prepared again after the interrupt: it was closed")
	}
}
