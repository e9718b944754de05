package offsets_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// TestCreateConcurrent creates each topic's tables from several sessions at once while others
// check for them in a loop: every creator must succeed, and no check may see the tables half
// made (a table without its schema version, VersionError) while another session commits them.
func TestCreateConcurrent(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := dbx.NewPgxPool(testdb.Pgx(t))
	for range 20 {
		tables := offsets.NewTables("", "sqlbroker_", testdb.Topic(t, ""))
		var wg sync.WaitGroup
		errs := make(chan error, 16)
		for range 4 {
			wg.Go(func() { errs <- tables.Create(ctx, db) })
		}
		for range 6 {
			wg.Go(func() {
				for ctx.Err() == nil {
					err := tables.Check(ctx, db)
					if !offsets.IsMissing(err) {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("%s: %v", tables.Messages, err)
			}
		}
	}
}
