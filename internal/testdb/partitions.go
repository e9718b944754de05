package testdb

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// SmallPartitions replaces the partitions of the messages table of tables, which must hold
// no message yet, with k partitions of size offsets each from the sequence's next offset,
// so that a test fills partitions with a few messages (size 1: one message a partition).
// The library adds its own partitions after them.
func SmallPartitions(t testing.TB, tables offsets.Tables, size, k int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool := Pgx(t)
	rows, err := pool.Query(ctx, `SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = to_regclass($1)`, tables.Messages)
	must(t, err)
	var parts []string
	for rows.Next() {
		var name string
		must(t, rows.Scan(&name))
		parts = append(parts, name)
	}
	must(t, rows.Err())
	for _, name := range parts {
		_, err := pool.Exec(ctx, "DROP TABLE "+ident.Qualified(tables.Schema, name))
		must(t, err)
	}
	var seq string
	must(t, pool.QueryRow(ctx, `SELECT pg_get_serial_sequence($1, 'offset')`, tables.Messages).Scan(&seq))
	var lo int64
	must(t, pool.QueryRow(ctx, `SELECT CASE WHEN s.is_called THEN s.last_value + 1 ELSE s.last_value END FROM `+seq+` s`).Scan(&lo))
	for range k {
		name := ident.Qualified(tables.Schema, tables.PartitionName(lo))
		_, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s (LIKE %s);
ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM (%d) TO (%d)`, name, tables.Messages, tables.Messages, name, lo, lo+int64(size)))
		must(t, err)
		lo += int64(size)
	}
}

// Int runs a query of one integer on the test database.
func Int(t testing.TB, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	must(t, Pgx(t).QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// Count counts the rows of table (quoted).
func Count(t testing.TB, table string) int64 {
	t.Helper()
	return Int(t, "SELECT count(*) FROM "+table)
}
