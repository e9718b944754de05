package offsets_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A claim with room to pass delayed messages (ClaimPassing, ClaimLockedPassing) passes the
// delayed messages ahead of and among the ones it claims without counting them against its
// limit, and stops after its limit of messages to hand out: the position advances no
// further. Without that room (pass 0) the delayed messages take the limit's places. On
// PostgreSQL in both claim modes, and on SQLite.
func TestClaimPassing_delayedDoNotTakeTheRoom(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	later := time.Now().Add(time.Hour)
	// Offsets 1-7: delayed, delayed, delayed, plain, plain, delayed, plain.
	rows := make([]offsets.Row, 7)
	for i := range rows {
		rows[i] = offsets.Row{UUID: fmt.Sprint(i + 1), Metadata: "{}"}
		if i < 3 || i == 5 {
			rows[i].DeliverAt = later
		}
	}
	type claimFn func(limit, pass int) ([]offsets.Claimed, error)
	setup := map[string]func(t *testing.T) claimFn{
		"postgres/lease": func(t *testing.T) claimFn {
			store, db, gid := pgStore(t, ctx, rows)
			return func(limit, pass int) ([]offsets.Claimed, error) {
				return store.ClaimPassing(ctx, db, gid, 7, time.Minute, limit, pass, offsets.DueNone, nil)
			}
		},
		"postgres/advisory": func(t *testing.T) claimFn {
			store, db, gid := pgStore(t, ctx, rows)
			conn, err := db.Pool.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_, _ = conn.Exec(context.Background(), "SELECT pg_advisory_unlock_all()")
				conn.Release()
			})
			return func(limit, pass int) ([]offsets.Claimed, error) {
				cs, _, err := store.ClaimLockedPassing(ctx, dbx.PgxConn(conn.Conn()), gid, 7, limit, pass, 0x50415353, nil, nil, offsets.DueNone, nil)
				return cs, err
			}
		},
		"sqlite": func(t *testing.T) claimFn {
			raw, err := sql.Open("sqlite", "file:"+testdb.SQLitePath(t)+"?_pragma=busy_timeout(5000)")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = raw.Close() })
			pool := dbx.NewSQLitePool(raw)
			tables := offsets.NewTables("", "sqlbroker_", "pass").OnSQLite()
			if err := tables.Create(ctx, pool); err != nil {
				t.Fatal(err)
			}
			store := offsets.NewStore(tables, false)
			if err := store.Insert(ctx, pool, rows, ""); err != nil {
				t.Fatal(err)
			}
			gid, err := store.EnsureGroup(ctx, pool, "g", false)
			if err != nil {
				t.Fatal(err)
			}
			return func(limit, pass int) ([]offsets.Claimed, error) {
				return store.ClaimPassing(ctx, pool, gid, 7, time.Minute, limit, pass, offsets.DueNone, nil)
			}
		},
	}
	for name, open := range setup {
		t.Run(name, func(t *testing.T) {
			claim := open(t)
			check := func(limit, pass int, wantPassed, wantClaimed string) {
				t.Helper()
				cs, err := claim(limit, pass)
				if err != nil {
					t.Fatal(err)
				}
				var passed, claimed []int64
				for _, c := range cs {
					if !c.Delayed.IsZero() {
						passed = append(passed, c.Offset)
					}
				}
				kept, delayed := offsets.TakeDelayed(cs) // in place
				for _, c := range kept {
					claimed = append(claimed, c.Offset)
				}
				if fmt.Sprint(passed) != wantPassed || fmt.Sprint(claimed) != wantClaimed || len(delayed) != len(passed) {
					t.Fatalf("limit %d pass %d: passed %v claimed %v, want passed %s claimed %s", limit, pass, passed, claimed, wantPassed, wantClaimed)
				}
			}
			check(2, 0, "[1 2]", "[]")
			check(2, 10, "[3]", "[4 5]")
			check(2, 10, "[6]", "[7]")
			check(2, 10, "[]", "[]")
		})
	}
}

// pgStore creates a topic's tables on PostgreSQL, writes rows, waits until a claim can see
// them and returns the store, the pool and the id of group "g", at the oldest message.
func pgStore(t *testing.T, ctx context.Context, rows []offsets.Row) (*offsets.Store, *dbx.PgxPool, int32) {
	t.Helper()
	tables, _, db := createTables(t, ctx)
	store := offsets.NewStore(tables, false)
	if err := store.Insert(ctx, db, rows, ""); err != nil {
		t.Fatal(err)
	}
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	testdb.WaitHorizon(t, ctx, db, tables.Messages)
	return store, db, gid
}
