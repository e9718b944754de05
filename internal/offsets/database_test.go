package offsets_test

import (
	"context"
	"strings"
	"testing"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The tables' database is picked once, from the dialect: its names, DDL and capabilities.
func TestTables_onPicksTheDatabase(t *testing.T) {
	pg := offsets.NewTables("", "sqlbroker_", "Orders")
	lite := pg.On(dbx.SQLite)
	if pg.Dialect() != dbx.Postgres || lite.Dialect() != dbx.SQLite || (offsets.Tables{}).Dialect() != dbx.Postgres {
		t.Fatalf("dialects: %q, %q", pg.Dialect().Name, lite.Dialect().Name)
	}
	if lite.Messages == pg.Messages {
		t.Errorf("SQLite's name of an upper-case topic %s is PostgreSQL's", lite.Messages)
	}
	if !strings.Contains(pg.SchemaSQL(), "xid8") || strings.Contains(lite.SchemaSQL(), "xid8") {
		t.Errorf("DDL of the wrong database")
	}
	if lite != pg.OnSQLite() {
		t.Errorf("OnSQLite differs from On(dbx.SQLite)")
	}
	if !offsets.Inspects(dbx.Postgres) || !offsets.Inspects(dbx.SQLite) {
		t.Errorf("Inspects")
	}
	k := offsets.NewKeyTable(dbx.SQLite, "", "keys")
	if !strings.Contains(k.SchemaSQL(), "BLOB") {
		t.Errorf("SQLite key table DDL: %s", k.SchemaSQL())
	}
}

// BackendAlive sees a live backend and no dead one on PostgreSQL, and refuses on SQLite,
// which has no server processes; NotifyTable does nothing there.
func TestBackendAliveAndNotify(t *testing.T) {
	ctx := context.Background()
	pool := dbx.NewPgxPool(testdb.Pgx(t))
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := conn.PID(ctx)
	conn.Release()
	if err != nil {
		t.Fatal(err)
	}
	if alive, err := offsets.BackendAlive(ctx, pool, pid); err != nil || !alive {
		t.Fatalf("live backend %d: %v, %v", pid, alive, err)
	}
	if alive, err := offsets.BackendAlive(ctx, pool, 0); err != nil || alive {
		t.Fatalf("pid 0: %v, %v", alive, err)
	}
	if err := offsets.NotifyTable(ctx, pool, "sqlbroker_test_notify", "x"); err != nil {
		t.Fatal(err)
	}

	lite := dbx.NewSQLitePool(testdb.SQLite(t))
	if _, err := offsets.BackendAlive(ctx, lite, 1); err == nil {
		t.Fatal("BackendAlive on SQLite: no error")
	}
	if err := offsets.NotifyTable(ctx, lite, "c", "x"); err != nil {
		t.Fatalf("NotifyTable on SQLite: %v", err)
	}
	if found, _, err := offsets.FindTopics(ctx, lite, "", "sqlbroker_", 10); err != nil || len(found) != 0 {
		t.Fatalf("FindTopics on an empty SQLite database: %v, %v", found, err)
	}
	if h, err := offsets.ReadHorizon(ctx, lite); err != nil || !h.NotApplicable {
		t.Fatalf("ReadHorizon on SQLite: %+v, %v", h, err)
	}
	if hs, err := offsets.AdvisoryHolders(ctx, lite, 0, 1<<31); err != nil || hs != nil {
		t.Fatalf("AdvisoryHolders on SQLite: %v, %v", hs, err)
	}
}
