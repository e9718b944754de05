package offsets_test

import (
	"context"
	"database/sql"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// BenchmarkSQLiteIdleLook compares what an idle subscription on SQLite could run, once per
// poll, to notice a commit of another process:
//
//   - claim: a claim of a group with nothing waiting and nothing due (the read-only look that
//     comes before the write transaction, through the pool), which every idle subscription
//     ran every PollInterval before the library watched data_version;
//   - data_version: PRAGMA data_version on a connection held for it (it changes when another
//     connection commits);
//   - stat-wal: os.Stat of the -wal file (a commit appends to it in WAL mode), no SQL at all.
//
// The file holds 10000 messages, all consumed by the group. ns/op is per look.
func BenchmarkSQLiteIdleLook(b *testing.B) {
	ctx := context.Background()
	path := testdb.SQLitePath(b)
	raw, err := sql.Open("sqlite", "file:"+path+"?_pragma=journal_mode(WAL)&_pragma=busy_timeout(5000)")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = raw.Close() })
	pool := dbx.NewSQLitePool(raw)
	tables := offsets.NewTables("", "sqlbroker_", "idle").OnSQLite()
	if err := tables.Create(ctx, pool); err != nil {
		b.Fatal(err)
	}
	store := offsets.NewStore(tables, false)
	rows := make([]offsets.Row, 1000)
	for range 10 {
		for j := range rows {
			rows[j] = offsets.Row{UUID: uuid.NewString(), Payload: []byte("x"), Metadata: `{}`}
		}
		if err := store.Insert(ctx, pool, rows, ""); err != nil {
			b.Fatal(err)
		}
	}
	group, err := store.EnsureGroup(ctx, pool, "g", true) // after every message: nothing waiting
	if err != nil {
		b.Fatal(err)
	}

	b.Run("claim", func(b *testing.B) {
		for b.Loop() {
			cs, err := store.Claim(ctx, pool, group, 1, time.Second, 100, offsets.DueAll, nil)
			if err != nil || len(cs) != 0 {
				b.Fatal(len(cs), err)
			}
		}
	})
	b.Run("data_version", func(b *testing.B) {
		conn, err := raw.Conn(ctx)
		if err != nil {
			b.Fatal(err)
		}
		defer conn.Close()
		for b.Loop() {
			var v int64
			if err := conn.QueryRowContext(ctx, "PRAGMA data_version").Scan(&v); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("stat-wal", func(b *testing.B) {
		for b.Loop() {
			fi, err := os.Stat(path + "-wal")
			if err != nil {
				b.Fatal(err)
			}
			_ = fi.Size() + fi.ModTime().UnixNano()
		}
	})
}
