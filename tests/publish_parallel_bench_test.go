package tests

import (
	"context"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

type countingTracer struct{ n atomic.Int64 }

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}
func (c *countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func cpuTime() float64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e3
}

// BenchmarkPublishParallel publishes one message per call from 16 goroutines on pgx, as the
// side-by-side benchmark's scenario 5b does. Per message: ns/op and allocations, the client's
// CPU time (cpu-µs/msg) and the statements sent (stmts/msg).
func BenchmarkPublishParallel(b *testing.B) {
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		b.Fatal(err)
	}
	tr := &countingTracer{}
	cfg.ConnConfig.Tracer = tr
	cfg.MaxConns = 20
	cfg.MinConns = 20
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	topic := testdb.Topic(b, "")
	pub, err := sqlbroker.NewPublisher(sqlbroker.Pgx(pool), sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	if err != nil {
		b.Fatal(err)
	}
	defer pub.Close()
	payload := make([]byte, 256)
	if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
		b.Fatal(err)
	}
	const workers = 16
	b.ReportAllocs()
	b.ResetTimer()
	stmts0, cpu0 := tr.n.Load(), cpuTime()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(b.N) {
				if err := pub.Publish(topic, message.NewMessage(watermill.NewUUID(), payload)); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric((cpuTime()-cpu0)/float64(b.N), "cpu-µs/msg")
	b.ReportMetric(float64(tr.n.Load()-stmts0)/float64(b.N), "stmts/msg")
}
