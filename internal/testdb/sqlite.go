package testdb

import (
	"database/sql"
	"path/filepath"
	"testing"

	_ "modernc.org/sqlite" // the SQLite driver under test
)

// SQLitePath returns the path of a new SQLite database file in a directory t removes.
func SQLitePath(t testing.TB) string {
	t.Helper()
	return filepath.Join(t.TempDir(), "sqlbroker.db")
}

// SQLiteURL returns a sqlite: URL for Open naming a new database file.
func SQLiteURL(t testing.TB) string {
	t.Helper()
	return "sqlite:" + SQLitePath(t) + "?mode=rwc"
}

// SQLite opens a *sql.DB on a new SQLite database file, with none of the settings the library
// needs (no WAL, no busy timeout): sqlbroker.SQLite must set them up itself. It is closed
// when t ends.
func SQLite(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+SQLitePath(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}
