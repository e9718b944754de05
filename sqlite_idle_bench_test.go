package sqlbroker_test

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"sort"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// cpuTime is the CPU time (user and system) this process has used.
func cpuTime(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkSQLiteIdleSubscriptions measures what idle subscriptions on one SQLite file cost:
// 20 subscriptions, one topic each, nothing to consume, default settings. One op is 100 ms
// of idling; cpu-µs/sub/s is the CPU time of the whole process per subscription per second.
func BenchmarkSQLiteIdleSubscriptions(b *testing.B) {
	const subs = 20
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	broker, err := sqlbroker.Open(testdb.SQLiteURL(b), sqlbroker.BrokerConfig{}, nil)
	if err != nil {
		b.Fatal(err)
	}
	sub, err := broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "idle", InitializeSchema: true})
	if err != nil {
		b.Fatal(err)
	}
	for i := range subs {
		if _, err := sub.Subscribe(ctx, fmt.Sprintf("idle_%d", i)); err != nil {
			b.Fatal(err)
		}
	}
	time.Sleep(time.Second) // every subscription's first claims are over: they idle from now on
	start, cpu0 := time.Now(), cpuTime(b)
	b.ResetTimer()
	for b.Loop() {
		time.Sleep(100 * time.Millisecond)
	}
	b.StopTimer()
	wall, cpu := time.Since(start), cpuTime(b)-cpu0
	b.ReportMetric(float64(cpu.Microseconds())/subs/wall.Seconds(), "cpu-µs/sub/s")
	cancel()
	if _, err := broker.Shutdown(context.Background()); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkSQLiteCrossProcessDelay measures the delay from a commit of another process to the
// delivery of its message, on SQLite with default settings. The other process is a connection
// of its own that inserts the message's row: for SQLite it is another writer like any other,
// and no publisher of this process wakes the subscription. Each op is one message, published
// a random 0-200 ms after the previous one was delivered, so that it falls anywhere in the
// subscription's poll; p50-ms and p99-ms are the delays' percentiles.
func BenchmarkSQLiteCrossProcessDelay(b *testing.B) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	path := testdb.SQLitePath(b)
	broker, err := sqlbroker.Open("sqlite:"+path+"?mode=rwc", sqlbroker.BrokerConfig{}, nil)
	if err != nil {
		b.Fatal(err)
	}
	const topic = "delay"
	if err := broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic); err != nil {
		b.Fatal(err)
	}
	sub, err := broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "delay"})
	if err != nil {
		b.Fatal(err)
	}
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		b.Fatal(err)
	}
	other, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	if err != nil {
		b.Fatal(err)
	}
	defer other.Close()
	insert := "INSERT INTO " + offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic).OnSQLite().Messages +
		` ("uuid", "payload", "metadata") VALUES (?, ?, '{}')`
	var delays []time.Duration
	b.ResetTimer()
	for b.Loop() {
		time.Sleep(rand.N(200 * time.Millisecond))
		sent := time.Now()
		if _, err := other.ExecContext(ctx, insert, watermill.NewUUID(), []byte(strconv.FormatInt(sent.UnixNano(), 10))); err != nil {
			b.Fatal(err)
		}
		select {
		case m := <-msgs:
			delays = append(delays, time.Since(sent))
			m.Ack()
		case <-time.After(30 * time.Second):
			b.Fatal("the message was not delivered within 30s")
		}
	}
	b.StopTimer()
	sort.Slice(delays, func(i, j int) bool { return delays[i] < delays[j] })
	pct := func(p float64) float64 {
		return float64(delays[min(len(delays)-1, int(p*float64(len(delays))))]) / float64(time.Millisecond)
	}
	b.ReportMetric(pct(0.5), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	cancel()
	if _, err := broker.Shutdown(context.Background()); err != nil {
		b.Fatal(err)
	}
}
