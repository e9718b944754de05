package offsets_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/google/uuid"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// BenchmarkInsertVsCopy compares the multi-row INSERT with COPY (pgx pool, 256-byte payloads)
// per statement size: it is where offsets.CopyMinRows comes from. ns/op is per row.
func BenchmarkInsertVsCopy(b *testing.B) {
	ctx := context.Background()
	pool := dbx.NewPgxPool(testdb.Pgx(b))
	payload := make([]byte, 256)
	for _, n := range []int{100, 250, 500, 1000, 2000} {
		for _, mode := range []string{"insert", "copy"} {
			b.Run(fmt.Sprintf("rows=%d/%s", n, mode), func(b *testing.B) {
				topic := testdb.Topic(b, "")
				tables := offsets.NewTables("", "sqlbroker_", topic)
				if err := tables.Create(ctx, pool); err != nil {
					b.Fatal(err)
				}
				store := offsets.NewStore(tables, false)
				rows := make([]offsets.Row, n)
				b.ResetTimer()
				for i := 0; i < b.N; i += n {
					for j := range rows {
						rows[j] = offsets.Row{UUID: uuid.NewString(), Payload: payload, Metadata: `{"k":"v"}`}
					}
					var err error
					if mode == "copy" {
						err = store.Copy(ctx, pool, rows)
					} else {
						err = store.Insert(ctx, pool, rows, "")
					}
					if err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
