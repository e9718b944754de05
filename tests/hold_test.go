package tests

import (
	"context"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// holdSoakEnv turns on TestHoldSoak. The soak is scenario 11 (hold) of cmd/sqlbroker-bench
// at a small size: it holds vacuum back on the whole server for half a minute and asserts
// rates, so it runs only when asked for, never under make test.
const holdSoakEnv = "SQLBROKER_HOLD_SOAK"

// TestHoldSoak offers messages at a steady rate to one consumer group of two subscribers with
// Retention set while a REPEATABLE READ transaction on a connection of its own holds the xmin
// horizon back, so that vacuum removes no dead row. During the hold the group must handle at
// least 80% of what was offered over every 5 s, and the lag must never pass 20,000.
func TestHoldSoak(t *testing.T) {
	if os.Getenv(holdSoakEnv) != "1" {
		t.Skip("a 35 s soak that holds vacuum back on the whole server: set " + holdSoakEnv + "=1 to run it")
	}
	const (
		rate      = 1000 // msg/s offered
		duration  = 35 * time.Second
		holdAt    = 5 * time.Second
		holdFor   = 25 * time.Second
		retention = 10 * time.Second
		window    = 5 // seconds
		minShare  = 0.8
		maxLag    = 20_000
	)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pool := testdb.Pgx(t)
	db := sqlbroker.Pgx(pool)
	topic := testdb.Topic(t, "")
	tables := offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic)

	var handled atomic.Int64
	var consumers sync.WaitGroup
	var subs []message.Subscriber
	defer func() {
		for _, s := range subs {
			_ = s.Close()
		}
		consumers.Wait()
	}()
	for range 2 {
		sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
			ConsumerGroup: "hold", InitializeSchema: true, Retention: retention,
		}, watermill.NopLogger{})
		require.NoError(t, err)
		subs = append(subs, sub)
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		consumers.Add(1)
		go func() {
			defer consumers.Done()
			for m := range ch {
				handled.Add(1)
				m.Ack()
			}
		}()
	}
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	defer pub.Close()

	// The publisher: every 10 ms, what is due by then, in calls of at most 100 messages.
	var published, due atomic.Int64
	pubErr := make(chan error, 1)
	start := time.Now()
	var publishing sync.WaitGroup
	publishing.Add(1)
	go func() {
		defer publishing.Done()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		payload := make([]byte, 256)
		for ctx.Err() == nil {
			<-tick.C
			due.Store(int64(time.Since(start).Seconds() * rate))
			for n := min(due.Load()-published.Load(), 100); n > 0 && ctx.Err() == nil; n = min(due.Load()-published.Load(), 100) {
				msgs := make([]*message.Message, n)
				for i := range msgs {
					msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
				}
				if err := pub.Publish(topic, msgs...); err != nil {
					pubErr <- err
					return
				}
				published.Add(n)
			}
		}
	}()
	defer publishing.Wait()
	defer cancel()

	// The reader that holds vacuum back.
	var holdFrom, holdTo time.Duration
	var reader *pgx.Conn
	defer func() {
		if reader != nil {
			_ = reader.Close(context.Background())
		}
	}()
	openReader := func() {
		reader, err = pgx.Connect(ctx, testdb.URL())
		require.NoError(t, err)
		_, err = reader.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ")
		require.NoError(t, err)
		_, err = reader.Exec(ctx, "SELECT 1 FROM "+tables.Messages+" LIMIT 1")
		require.NoError(t, err)
		var holds bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT backend_xmin IS NOT NULL FROM pg_stat_activity WHERE pid = $1`,
			int64(reader.PgConn().PID())).Scan(&holds))
		require.True(t, holds, "the reader's backend_xmin is null: its transaction holds no snapshot")
		holdFrom = time.Since(start)
	}

	type sample struct {
		at                 time.Duration
		published, handled int64
		read, scans        int64 // claims table: index entries read and index scans so far
		inHold             bool
	}
	claimStats := func() (read, scans int64) {
		require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(sum(idx_tup_read), 0)::bigint, coalesce(sum(idx_scan), 0)::bigint
			FROM pg_stat_user_indexes WHERE relid = to_regclass($1)::oid`, tables.Claims).Scan(&read, &scans))
		return read, scans
	}
	samples := []sample{{}}
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for samples[len(samples)-1].at < duration-100*time.Millisecond {
		select {
		case <-tick.C:
		case err := <-pubErr:
			t.Fatalf("publish: %v", err)
		}
		now := time.Since(start)
		if reader == nil && now >= holdAt {
			openReader()
		}
		if reader != nil && holdTo == 0 && now >= holdFrom+holdFor {
			_, err := reader.Exec(ctx, "COMMIT")
			require.NoError(t, err)
			holdTo = time.Since(start)
		}
		prev := samples[len(samples)-1]
		s := sample{at: now, published: published.Load(), handled: handled.Load()}
		s.read, s.scans = claimStats()
		s.inHold = reader != nil && holdFrom <= prev.at && (holdTo == 0 || s.at <= holdTo)
		samples = append(samples, s)
		perScan := "-"
		if s.scans > prev.scans {
			perScan = fmt.Sprintf("%.1f", float64(s.read-prev.read)/float64(s.scans-prev.scans))
		}
		dt := (s.at - prev.at).Seconds()
		t.Logf("%4.0fs hold=%-5v offered %5.0f/s handled %5.0f/s lag %6d claims index entries per scan %s",
			s.at.Seconds(), s.inHold, float64(s.published-prev.published)/dt, float64(s.handled-prev.handled)/dt,
			s.published-s.handled, perScan)
	}
	cancel()

	require.GreaterOrEqual(t, published.Load(), due.Load()*95/100,
		"the publisher fell behind the offered rate of %d msg/s: the machine is too busy for the soak", rate)
	windows := 0
	for i, s := range samples {
		require.LessOrEqual(t, s.published-s.handled, int64(maxLag), "lag at %.0fs", s.at.Seconds())
		if i < window {
			continue
		}
		whole := true
		for _, w := range samples[i-window+1 : i+1] {
			whole = whole && w.inHold
		}
		if !whole {
			continue
		}
		windows++
		from := samples[i-window]
		offered, got := s.published-from.published, s.handled-from.handled
		require.GreaterOrEqual(t, float64(got), minShare*float64(offered),
			"%.0fs to %.0fs of the hold: handled %d of %d offered", from.at.Seconds(), s.at.Seconds(), got, offered)
	}
	require.Positive(t, windows, "no %d s window lay inside the hold", window)
}
