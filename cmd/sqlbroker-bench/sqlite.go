package main

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"time"

	_ "modernc.org/sqlite"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// The SQLite contender: the library's lease mode on a database file of its own per scenario,
// in -sqlite-dir, built as a program builds it: sqlbroker.Open on a sqlite: URL, which sets
// journal_mode=WAL, synchronous=NORMAL and a busy timeout on every connection.

// sqliteFiles numbers the database files of a run.
var sqliteFiles atomic.Int64

// openSQLiteEnv opens a broker on a new database file in cfg.sqliteDir, or, with share set, on
// that existing file (another consumer of the same database, with a pool of its own).
func openSQLiteEnv(cfg *config, share string) (*env, error) {
	file, owner := share, false
	if file == "" {
		file, owner = filepath.Join(cfg.sqliteDir, fmt.Sprintf("bench-%d.db", sqliteFiles.Add(1))), true
	}
	broker, err := sqlbroker.Open("sqlite:"+file+"?mode=rwc", sqlbroker.BrokerConfig{MaxConns: cfg.poolSize}, nil)
	if err != nil {
		return nil, fmt.Errorf("sqlite: %w", err)
	}
	// The second pool has the settings Open puts in its DSN, so that the statements run on it
	// see the database as the broker's do; it shares the broker's in-process write gate (one
	// per file).
	q := url.Values{}
	q.Set("mode", "rwc")
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous(NORMAL)")
	q.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", dbx.SQLiteBusyTimeoutMS))
	db, err := dbx.OpenSQLitePool("file:"+file+"?"+q.Encode(), file, cfg.poolSize, false)
	if err != nil {
		_ = broker.Close()
		return nil, fmt.Errorf("sqlite: %w", err)
	}
	e := &env{c: sqliteLease, cfg: cfg, db: db, broker: broker, file: file, owner: owner}
	// Connect now, so that a file that cannot be created fails here rather than in a scenario.
	if _, err := db.Exec(context.Background(), "SELECT 1"); err != nil {
		e.close()
		return nil, fmt.Errorf("sqlite: open %s: %w", file, err)
	}
	return e, nil
}

// closeSQLite closes the broker (which closes its publishers, subscribers and pool) and the
// second pool, and removes the file when this env made it.
func (e *env) closeSQLite() {
	_ = e.broker.Close()
	e.db.Close()
	if e.owner {
		for _, suffix := range []string{"", "-wal", "-shm", "-journal"} {
			_ = os.Remove(e.file + suffix)
		}
	}
}

// drainedSQLite is drained on SQLite: no claim of the group left and its position at the last
// message.
func (e *env) drainedSQLite(ctx context.Context, topic string) (bool, error) {
	t := e.tables(topic)
	var ok int64
	err := dbx.QueryRow(ctx, e.db, fmt.Sprintf(`WITH g AS (SELECT "group_id", "last_offset" FROM %[2]s WHERE "consumer_group" = ?)
		SELECT NOT EXISTS (SELECT 1 FROM %[1]s c, g WHERE c."group_id" = g."group_id")
		AND coalesce((SELECT "last_offset" FROM g), -1) = coalesce((SELECT max("offset") FROM %[3]s), 0)`,
		t.Claims, t.Groups, t.Messages), []any{group}, &ok)
	return ok != 0, err
}

// sqliteDescription names the SQLite library and version, the directory of the files and its
// file system, for the head of the output.
func sqliteDescription(dir string) string {
	version := "unknown"
	if db, err := sql.Open("sqlite", ":memory:"); err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = db.QueryRowContext(ctx, "SELECT sqlite_version()").Scan(&version)
		cancel()
		_ = db.Close()
	}
	return fmt.Sprintf("SQLite %s (%s) in %s (%s), journal_mode=WAL, synchronous=NORMAL, a fresh file per scenario",
		version, moduleVersion("modernc.org/sqlite"), dir, fileSystem(dir))
}

// moduleVersion is module's path and the version this program was built with.
func moduleVersion(module string) string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == module {
				return module + " " + d.Version
			}
		}
	}
	return module
}

// fileSystem is the type of the file system dir is on, read from /proc/mounts (the longest
// mount point that holds dir).
func fileSystem(dir string) string {
	b, err := os.ReadFile("/proc/mounts")
	if err != nil {
		return "file system unknown"
	}
	best, fs := "", "file system unknown"
	for _, line := range strings.Split(string(b), "\n") {
		var dev, mnt, typ string
		if n, _ := fmt.Sscanf(line, "%s %s %s", &dev, &mnt, &typ); n != 3 {
			continue
		}
		if (dir == mnt || mnt == "/" || strings.HasPrefix(dir, strings.TrimSuffix(mnt, "/")+"/")) && len(mnt) >= len(best) {
			best, fs = mnt, typ+" on "+dev
		}
	}
	return fs
}
