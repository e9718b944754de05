package dbx_test

import (
	"context"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// BenchmarkTracker compares a statement run through the tracker with the same statement on
// the pool itself (which takes and hands back a connection too), and the tracker's own cost
// around a function that sends nothing.
func BenchmarkTracker(b *testing.B) {
	pool := dbx.NewPgxPool(testdb.Pgx(b))
	ctx := context.Background()
	selectOne := func(ctx context.Context, q dbx.Querier) error {
		_, err := q.Exec(ctx, "SELECT 1")
		return err
	}
	b.Run("pool.Exec", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			if _, err := pool.Exec(cctx, "SELECT 1"); err != nil {
				b.Fatal(err)
			}
			cancel()
		}
	})
	for _, limit := range []time.Duration{0, 30 * time.Second} {
		b.Run("Run/limit="+limit.String(), func(b *testing.B) {
			tr := dbx.NewTracker(pool)
			defer tr.Stop(ctx)
			b.ReportAllocs()
			for b.Loop() {
				if err := tr.Run(ctx, "select", limit, selectOne); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("Run/cancellable-ctx", func(b *testing.B) {
		tr := dbx.NewTracker(pool)
		defer tr.Stop(ctx)
		cctx, cancel := context.WithCancel(ctx)
		defer cancel()
		b.ReportAllocs()
		for b.Loop() {
			if err := tr.Run(cctx, "select", 30*time.Second, selectOne); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("acquire+release", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			c, err := pool.Acquire(ctx)
			if err != nil {
				b.Fatal(err)
			}
			c.Release()
		}
	})
	for _, limit := range []time.Duration{0, 30 * time.Second} {
		b.Run("Run/noop/limit="+limit.String(), func(b *testing.B) {
			tr := dbx.NewTracker(pool)
			defer tr.Stop(ctx)
			b.ReportAllocs()
			for b.Loop() {
				if err := tr.Run(ctx, "noop", limit, func(context.Context, dbx.Querier) error { return nil }); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
