package dbx_test

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/lib/pq"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// preparedPool is a prepared lib/pq pool of one connection: every statement of the test runs on
// the same session, whose prepared statements it can count.
func preparedPool(t *testing.T) (*dbx.StdPool, *sql.DB) {
	t.Helper()
	db, err := sql.Open("postgres", testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	db.SetMaxOpenConns(1)
	return dbx.NewStdPoolPrepared(db), db
}

// onConn runs fn on a connection acquired from p, released after.
func onConn(t *testing.T, p *dbx.StdPool, fn func(c dbx.Conn)) {
	t.Helper()
	c, err := p.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Release()
	fn(c)
}

// preparedHere counts the statements prepared on c's session.
func preparedHere(t *testing.T, c dbx.Conn) int64 {
	t.Helper()
	var n int64
	// No argument: run as a simple query, not prepared, so that it does not count itself.
	if err := dbx.QueryRow(context.Background(), c, "SELECT count(*) FROM pg_prepared_statements", nil, &n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A statement with arguments on a prepared pool's connection is prepared once on its session
// and its rows scan into the destinations the library uses, as database/sql's would: numbers,
// text, bytea, bool, timestamps, NULL into a pointer and a sql.Null, arrays through pq.Array.
func TestStdPrepared_scansAsDatabaseSQLAndPreparesOnce(t *testing.T) {
	p, db := preparedPool(t)
	ctx := context.Background()
	const q = `SELECT $1::bigint, $2::int4, $3::text, $4::bytea, $5::bool, $6::float8, $7::timestamptz,
		NULL::text, NULL::bigint, $8::bigint[], 'x'::text, '{"a": 1}'::jsonb`
	at := time.Date(2026, 12, 6, 10, 0, 0, 123000, time.UTC)
	args := func() []any {
		return []any{int64(1) << 40, int32(-7), "héllo", []byte{0, 1, 2, 255}, true, 2.5, at, []int64{3, 1, 2}}
	}
	type row struct {
		i64     int64
		i32     int32
		s       string
		b       []byte
		ok      bool
		f       float64
		ts      time.Time
		ptr     *string
		null    sql.NullInt64
		arr     []int64
		any     any
		jsonRaw []byte
	}
	read := func(rows dbx.Rows) row {
		t.Helper()
		defer rows.Close()
		var r row
		if !rows.Next() {
			t.Fatalf("no row: %v", rows.Err())
		}
		if err := rows.Scan(&r.i64, &r.i32, &r.s, &r.b, &r.ok, &r.f, &r.ts, &r.ptr, &r.null, pq.Array(&r.arr), &r.any, &r.jsonRaw); err != nil {
			t.Fatal(err)
		}
		if rows.Next() {
			t.Fatal("a second row")
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return r
	}
	// The same statement through database/sql itself, unprepared.
	sqlRows, err := db.QueryContext(ctx, q, append(args()[:7:7], pq.Array([]int64{3, 1, 2}))...)
	if err != nil {
		t.Fatal(err)
	}
	var want row
	if !sqlRows.Next() {
		t.Fatal(sqlRows.Err())
	}
	if err := sqlRows.Scan(&want.i64, &want.i32, &want.s, &want.b, &want.ok, &want.f, &want.ts, &want.ptr, &want.null, pq.Array(&want.arr), &want.any, &want.jsonRaw); err != nil {
		t.Fatal(err)
	}
	_ = sqlRows.Close()

	onConn(t, p, func(c dbx.Conn) {
		before := preparedHere(t, c)
		for i := range 3 {
			rows, err := c.Query(ctx, q, args()...)
			if err != nil {
				t.Fatal(err)
			}
			got := read(rows)
			if fmt.Sprint(got.i64, got.i32, got.s, got.ok, got.f, got.ptr, got.null, got.arr, got.any) != fmt.Sprint(want.i64, want.i32, want.s, want.ok, want.f, want.ptr, want.null, want.arr, want.any) ||
				!bytes.Equal(got.b, want.b) || !got.ts.Equal(want.ts) || !bytes.Equal(got.jsonRaw, want.jsonRaw) {
				t.Fatalf("run %d: scanned %+v, database/sql scanned %+v", i, got, want)
			}
			if n := preparedHere(t, c) - before; n != 1 {
				t.Fatalf("run %d: %d statements prepared on the session, want 1", i, n)
			}
		}
		// Exec counts the rows, prepared too.
		n, err := c.Exec(ctx, "SELECT generate_series(1, $1::int)", 5)
		if err != nil || n != 5 {
			t.Fatalf("exec: %d rows, %v", n, err)
		}
		if n := preparedHere(t, c) - before; n != 2 {
			t.Fatalf("%d statements prepared on the session, want 2", n)
		}
		// A NULL into a destination that cannot hold it is an error, as in database/sql.
		var s string
		if err := dbx.QueryRow(ctx, c, "SELECT NULL::text WHERE $1::int = 1", []any{1}, &s); err == nil || !strings.Contains(err.Error(), "NULL") {
			t.Fatalf("NULL into a string: %v", err)
		}
	})
}

// A change of a table that changes a prepared statement's result columns makes the server
// refuse the statement as prepared; it is prepared again and run, once, and the caller sees
// its rows.
func TestStdPrepared_statementPreparedAgainAfterTheTableChanged(t *testing.T) {
	p, db := preparedPool(t)
	ctx := context.Background()
	table := fmt.Sprintf("dbx_prep_%d", time.Now().UnixNano())
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+table+" (a int)"); err != nil {
		t.Fatal(err)
	}
	defer db.ExecContext(context.Background(), "DROP TABLE "+table)
	if _, err := db.ExecContext(ctx, "INSERT INTO "+table+" VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	cols := func(c dbx.Conn) int {
		rows, err := c.Query(ctx, "SELECT * FROM "+table+" WHERE a = $1", 1)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		if !rows.Next() {
			t.Fatal("no row")
		}
		for n := 1; n < 4; n++ { // the destinations that fit are the columns
			dest := make([]any, n)
			for i := range dest {
				dest[i] = new(any)
			}
			if rows.Scan(dest...) == nil {
				return n
			}
		}
		t.Fatal("no destinations fit")
		return 0
	}
	onConn(t, p, func(c dbx.Conn) {
		if n := cols(c); n != 1 {
			t.Fatalf("%d columns, want 1", n)
		}
		if _, err := c.Exec(ctx, "ALTER TABLE "+table+" ADD COLUMN b int DEFAULT 2"); err != nil {
			t.Fatal(err)
		}
		if n := cols(c); n != 2 {
			t.Fatalf("%d columns after ADD COLUMN, want 2", n)
		}
	})
}

// A connection keeps at most MaxStmtsPerConn statements prepared: past it the least recently
// used is closed on the server, and one still in use stays prepared.
func TestStdPrepared_statementsPerConnectionBounded(t *testing.T) {
	p, _ := preparedPool(t)
	ctx := context.Background()
	onConn(t, p, func(c dbx.Conn) {
		before := preparedHere(t, c)
		hot := "SELECT $1::int + 0"
		for i := range dbx.MaxStmtsPerConn + 40 {
			var n int64
			if err := dbx.QueryRow(ctx, c, hot, []any{1}, &n); err != nil {
				t.Fatal(err)
			}
			if err := dbx.QueryRow(ctx, c, fmt.Sprintf("SELECT $1::int + %d", i+1), []any{1}, &n); err != nil || n != int64(i+2) {
				t.Fatalf("statement %d: %d, %v", i, n, err)
			}
		}
		if n := preparedHere(t, c) - before; n != dbx.MaxStmtsPerConn {
			t.Fatalf("%d statements prepared on the session, want %d", n, dbx.MaxStmtsPerConn)
		}
		var hotKept int64
		if err := dbx.QueryRow(ctx, c, "SELECT count(*) FROM pg_prepared_statements WHERE statement = '"+hot+"'", nil, &hotKept); err != nil || hotKept != 1 {
			t.Fatalf("the statement in use: prepared %d times, %v", hotKept, err)
		}
	})
}

// A statement cancelled while it runs ends with the server's error, and its connection is
// closed rather than used again: a cancel request the server has yet to act on must not reach
// the connection's next statement. The pool goes on with a new connection.
func TestStdPrepared_cancelledStatementClosesItsConnection(t *testing.T) {
	p, _ := preparedPool(t)
	ctx := context.Background()
	var pid uint32
	onConn(t, p, func(c dbx.Conn) {
		var err error
		if pid, err = c.PID(ctx); err != nil {
			t.Fatal(err)
		}
		sctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, err = c.Exec(sctx, "SELECT pg_sleep($1)", 30)
		if err == nil || dbx.SQLState(err) != dbx.CodeQueryCanceled {
			t.Fatalf("cancelled statement: %v (%s)", err, dbx.SQLState(err))
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Fatalf("the cancel took %s", d)
		}
	})
	onConn(t, p, func(c dbx.Conn) {
		var n int64
		if err := dbx.QueryRow(ctx, c, "SELECT $1::int", []any{7}, &n); err != nil || n != 7 {
			t.Fatalf("after the cancel: %d, %v", n, err)
		}
		again, err := c.PID(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if again == pid {
			t.Fatalf("the cancelled statement's connection (backend %d) was used again", pid)
		}
	})
}

// Destinations of a named type over a basic kind are converted as database/sql converts them;
// a value that does not fit is an error, not a silent truncation.
func TestStdPrepared_namedTypes(t *testing.T) {
	p, _ := preparedPool(t)
	ctx := context.Background()
	type small int8
	type name string
	type blob []byte
	type flag bool
	type ratio float32
	onConn(t, p, func(c dbx.Conn) {
		var (
			s small
			n name
			b blob
			f flag
			r ratio
			u uint16
		)
		err := dbx.QueryRow(ctx, c, "SELECT $1::int, $2::text, $3::bytea, $4::bool, $5::float8, $6::int",
			[]any{-5, "x", []byte{7}, true, 0.5, 65535}, &s, &n, &b, &f, &r, &u)
		if err != nil || s != -5 || n != "x" || !bytes.Equal(b, []byte{7}) || !bool(f) || r != 0.5 || u != 65535 {
			t.Fatalf("%v %q %v %v %v %v: %v", s, n, b, f, r, u, err)
		}
		if err := dbx.QueryRow(ctx, c, "SELECT $1::int", []any{300}, &s); err == nil {
			t.Fatalf("300 scanned into an int8 type: %d", s)
		}
	})
}
