package dbx_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The pid cache of database/sql connections stays bounded when database/sql closes its
// connections on its own: here none is kept idle, so every use is a new physical connection
// that database/sql closes without the library knowing, and each would stay in the cache.
func TestStdPIDCacheBounded(t *testing.T) {
	db, err := sql.Open("postgres", testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxIdleConns(0)
	pool := dbx.NewStdPool(db)
	ctx := context.Background()
	pids := map[uint32]bool{}
	for range dbx.MaxPIDs + 50 {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pid, err := c.PID(ctx)
		if err != nil || pid == 0 {
			t.Fatalf("pid %d, %v", pid, err)
		}
		pids[pid] = true
		c.Release()
		if n := dbx.PIDsRemembered(); n > dbx.MaxPIDs {
			t.Fatalf("%d pids remembered, more than %d", n, dbx.MaxPIDs)
		}
	}
	if len(pids) < 2 {
		t.Fatalf("%d distinct backends: the connections were not new ones", len(pids))
	}
}
