package dbx_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// Every pool, connection and transaction says its dialect once; nothing reads it from a type
// switch of its callers.
func TestDialectOf_eachAdapterSaysItsDatabase(t *testing.T) {
	ctx := context.Background()
	lite := dbx.NewSQLitePool(testdb.SQLite(t))
	conn, err := lite.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	tx, err := lite.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for name, q := range map[string]any{"sqlite pool": lite, "sqlite conn": conn, "sqlite tx": tx, "sqlite caller tx": dbx.NewSQLiteCallerTx(nil)} {
		if got := dbx.DialectOf(q); got != dbx.SQLite {
			t.Errorf("%s: dialect %q, want SQLite", name, got.Name)
		}
	}
	pg := dbx.NewPgxPool(testdb.Pgx(t))
	std := dbx.NewStdPool(testdb.Std(t))
	for name, q := range map[string]any{"pgx pool": pg, "database/sql pool": std, "none": nil} {
		if got := dbx.DialectOf(q); got != dbx.Postgres {
			t.Errorf("%s: dialect %q, want PostgreSQL", name, got.Name)
		}
	}
	if dbx.SQLite.Schemas || dbx.SQLite.AdvisoryLocks || dbx.SQLite.Notify || dbx.SQLite.BackendPIDs || !dbx.SQLite.InProcess || dbx.Postgres.InProcess || !dbx.Postgres.Schemas {
		t.Errorf("capabilities: SQLite %+v, PostgreSQL %+v", dbx.SQLite, dbx.Postgres)
	}
}

// On SQLite a statement says itself whether it writes: Query reads and passes no write gate,
// QueryWrite and Exec write and wait for the process's writer. A read that begins with WITH
// is no write.
func TestSQLite_statementSaysWhetherItWrites(t *testing.T) {
	ctx := context.Background()
	pool := dbx.NewSQLitePool(testdb.SQLite(t))
	if _, err := pool.Exec(ctx, `CREATE TABLE t (v INTEGER)`); err != nil {
		t.Fatal(err)
	}
	writer, err := pool.Begin(ctx) // holds the write gate until it ends
	if err != nil {
		t.Fatal(err)
	}
	if _, err := writer.Exec(ctx, `INSERT INTO t VALUES (1)`); err != nil {
		t.Fatal(err)
	}

	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var n int64
	if err := dbx.QueryRow(rctx, pool, `WITH x AS (SELECT v FROM t) SELECT count(*) FROM x`, nil, &n); err != nil {
		t.Fatalf("a read waited for the writer: %v", err)
	}
	if n != 0 {
		t.Fatalf("the read saw %d uncommitted rows", n)
	}

	wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	err = dbx.QueryRowWrite(wctx, pool, `INSERT INTO t VALUES (2) RETURNING v`, nil, &n)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a write returning rows did not wait for the writer: %v", err)
	}
	if _, err := pool.Exec(wctx, `INSERT INTO t VALUES (3)`); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("an Exec did not wait for the writer: %v", err)
	}

	if err := writer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := dbx.QueryRowWrite(ctx, pool, `INSERT INTO t VALUES (4) RETURNING v`, nil, &n); err != nil || n != 4 {
		t.Fatalf("the write after the writer ended: %v, %d", err, n)
	}
}

// SetTxTimeouts bounds a PostgreSQL transaction on the server and sets its access mode, and
// does nothing on SQLite, where ctx bounds a statement.
func TestSetTxTimeouts(t *testing.T) {
	ctx := context.Background()
	pg := dbx.NewPgxPool(testdb.Pgx(t))
	err := dbx.InTx(ctx, pg, func(tx dbx.Tx) error {
		if err := dbx.SetTxTimeouts(ctx, tx, 1234, dbx.TxAccessReadOnly); err != nil {
			return err
		}
		var st, lt, ro string
		if err := dbx.QueryRow(ctx, tx, `SELECT current_setting('statement_timeout'), current_setting('lock_timeout'), current_setting('transaction_read_only')`, nil, &st, &lt, &ro); err != nil {
			return err
		}
		if st != "1234ms" || lt != "1234ms" || ro != "on" {
			t.Errorf("statement_timeout %s, lock_timeout %s, transaction_read_only %s", st, lt, ro)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	lite := dbx.NewSQLitePool(testdb.SQLite(t))
	err = dbx.InTx(ctx, lite, func(tx dbx.Tx) error { return dbx.SetTxTimeouts(ctx, tx, 1234, dbx.TxAccessReadOnly) })
	if err != nil {
		t.Fatalf("on SQLite: %v", err)
	}
}
