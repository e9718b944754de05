package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// Scenario 12, retention: -retention-n messages offered at -retention-rate to one topic,
// consumed by one subscriber with Retention -retention (1 s by default), and the sizes of
// the topic's tables every second (pg_total_relation_size, the messages table's summed over
// its partitions): what the tables hold must follow what is unsettled and retained, not what
// has passed through. After the last message is handled, it waits up to -retention-settle for
// retention to drop what it can, and prints the sizes at the peak and at the end. Dropped
// partitions need no vacuum; the claims table's deleted rows do: on a server whose autovacuum
// is off, -retention-vacuum D vacuums the claims and groups tables every D in its stead.
//
// On SQLite (one table, retention deletes row by row) it prints the database file's size and
// its WAL's, the pages in use (the file's, less its free list: deleted rows free pages that
// SQLite reuses, without VACUUM) and the messages table's rows.
func scenarioRetention(ctx context.Context, b *bench, c contender) error {
	if c.isWatermillSQL() {
		return fmt.Errorf("%w: watermill-sql has no retention", errNA)
	}
	if c.onMySQL() {
		return fmt.Errorf("%w: the scenario reads the sizes of PostgreSQL's tables or of SQLite's file", errNA)
	}
	cfg := b.cfg
	e, topic, err := b.prepare(ctx, c, "retention", 0)
	if err != nil {
		return err
	}
	defer e.close()
	defer b.dropTopic(c, topic)
	tables := libTables(topic)
	pub, err := e.publisher()
	if err != nil {
		return err
	}
	defer pub.Close()
	var sub message.Subscriber
	if c.onSQLite() {
		sub, err = e.broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "retention", Retention: cfg.retention})
	} else {
		sub, err = e.poolSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "retention", Retention: cfg.retention})
	}
	if err != nil {
		return err
	}
	defer sub.Close()
	var handled atomic.Int64
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	router.AddConsumerHandler("retention", topic, sub, func(*message.Message) error {
		handled.Add(1)
		return nil
	})
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(runCtx) }()
	defer func() {
		_ = router.Close()
		select {
		case <-runErr:
		case <-time.After(30 * time.Second):
			b.logf("retention, %s: router did not stop within 30s of Close", c)
		}
	}()
	select {
	case <-router.Running():
	case err := <-runErr:
		runErr <- err
		return fmt.Errorf("router stopped before running: %v", err)
	case <-time.After(30 * time.Second):
		return errors.New("router did not start within 30s")
	}

	fmt.Printf("## Scenario 12, retention: %s, %d messages of %d B offered at %d msg/s to one subscriber with Retention %s\n\n",
		c, cfg.retentionN, cfg.payloadSize, cfg.retentionRate, cfg.retention)
	if c.onSQLite() {
		fmt.Printf("Sizes: the database file and its WAL on disk; in use, the file's pages less those on its free list (pages that deleted rows freed, which SQLite reuses for new rows); tables: the messages table's rows. No VACUUM.\n\n")
		fmt.Printf("%5s %10s %10s %8s | %12s %12s %12s | %10s\n", "t", "published", "handled", "lag", "file", "WAL", "in use", "rows")
	} else {
		var autovacuum string
		if err := b.admin.QueryRow(ctx, `SELECT current_setting('autovacuum')`).Scan(&autovacuum); err != nil {
			return err
		}
		vacuum := "left to autovacuum (" + autovacuum + ")"
		if cfg.retentionVacuum > 0 {
			vacuum = fmt.Sprintf("VACUUM every %s", cfg.retentionVacuum)
		}
		fmt.Printf("Sizes: pg_total_relation_size (table, indexes, TOAST), the messages table summed over its partitions. Claims and groups tables: %s.\n\n", vacuum)
		fmt.Printf("%5s %10s %10s %8s | %12s %10s | %12s\n", "t", "published", "handled", "lag", "messages", "partitions", "claims")
	}

	start := time.Now()
	p := startPacer(runCtx, pub, topic, cfg.retentionRate, b.payload, 0)
	stopped := false
	stopPacer := func() {
		if !stopped {
			stopped = true
			p.stop()
		}
	}
	defer stopPacer()
	var peakMsgs, peakClaims, lastMsgs, lastClaims, peakRows int64
	var doneAt, vacuumed time.Time
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case err := <-runErr:
			runErr <- err
			return fmt.Errorf("router stopped early: %v", err)
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		if perr := p.failed(); perr != nil {
			return perr
		}
		published, h := p.published.Load(), handled.Load()
		if published >= int64(cfg.retentionN) {
			stopPacer()
			published = p.published.Load()
		}
		if c.onSQLite() {
			st, err := e.sqliteSizes(ctx, topic)
			if err != nil {
				return fmt.Errorf("read the sizes: %w", err)
			}
			peakMsgs, peakClaims, lastMsgs, lastClaims = max(peakMsgs, st.file+st.wal), max(peakClaims, st.inUse), st.file+st.wal, st.inUse
			peakRows = max(peakRows, st.rows)
			fmt.Printf("%5.0f %10d %10d %8d | %8.1f MiB %8.1f MiB %8.1f MiB | %10d\n", time.Since(start).Seconds(), published, h, published-h,
				mib(uint64(st.file)), mib(uint64(st.wal)), mib(uint64(st.inUse)), st.rows)
			if stopped && h >= published {
				if doneAt.IsZero() {
					doneAt = time.Now()
				}
				if time.Since(doneAt) >= cfg.retentionSettle {
					break
				}
			}
			continue
		}
		if cfg.retentionVacuum > 0 && time.Since(vacuumed) >= cfg.retentionVacuum {
			vacuumed = time.Now()
			if _, err := b.admin.Exec(ctx, "VACUUM "+tables.Claims+", "+tables.Groups); err != nil {
				return fmt.Errorf("vacuum: %w", err)
			}
		}
		var msgs, claims, parts int64
		if err := b.admin.QueryRow(ctx, `SELECT `+totalSizeSQL(1)+`, `+totalSizeSQL(2)+`,
			(SELECT count(*) FROM pg_inherits WHERE inhparent = to_regclass($1))`,
			tables.Messages, tables.Claims).Scan(&msgs, &claims, &parts); err != nil {
			return fmt.Errorf("read the sizes: %w", err)
		}
		peakMsgs, peakClaims, lastMsgs, lastClaims = max(peakMsgs, msgs), max(peakClaims, claims), msgs, claims
		fmt.Printf("%5.0f %10d %10d %8d | %8.1f MiB %10d | %8.2f MiB\n", time.Since(start).Seconds(), published, h, published-h,
			mib(uint64(msgs)), parts, mib(uint64(claims)))
		if stopped && h >= published {
			if doneAt.IsZero() {
				doneAt = time.Now()
			}
			if time.Since(doneAt) >= cfg.retentionSettle {
				break
			}
		}
	}
	n := p.published.Load()
	payload := float64(n) * float64(cfg.payloadSize)
	if c.onSQLite() {
		fmt.Printf("\n- %d messages (%.1f MiB of payload) through in %s; database file and WAL at most %.1f MiB, %.1f MiB at the end; pages in use at most %.1f MiB, %.1f MiB at the end; messages table at most %d rows\n\n",
			n, payload/(1<<20), doneAt.Sub(start).Round(time.Second), mib(uint64(peakMsgs)), mib(uint64(lastMsgs)),
			mib(uint64(peakClaims)), mib(uint64(lastClaims)), peakRows)
		return nil
	}
	fmt.Printf("\n- %d messages (%.1f MiB of payload) through in %s; messages table at most %.1f MiB, %.1f MiB at the end; claims table at most %.2f MiB, %.2f MiB at the end\n\n",
		n, payload/(1<<20), doneAt.Sub(start).Round(time.Second), mib(uint64(peakMsgs)), mib(uint64(lastMsgs)),
		mib(uint64(peakClaims)), mib(uint64(lastClaims)))
	return nil
}

// sqliteSizes are the sizes scenario 12 prints on SQLite.
type sqliteSizes struct {
	file, wal, inUse, rows int64
}

func (e *env) sqliteSizes(ctx context.Context, topic string) (sqliteSizes, error) {
	var st sqliteSizes
	if fi, err := os.Stat(e.file); err == nil {
		st.file = fi.Size()
	}
	if fi, err := os.Stat(e.file + "-wal"); err == nil {
		st.wal = fi.Size()
	}
	var pages, free, size int64
	if err := dbx.QueryRow(ctx, e.db, `SELECT (SELECT page_count FROM pragma_page_count()), (SELECT freelist_count FROM pragma_freelist_count()), (SELECT page_size FROM pragma_page_size())`, nil, &pages, &free, &size); err != nil {
		return st, err
	}
	st.inUse = (pages - free) * size
	if err := dbx.QueryRow(ctx, e.db, `SELECT count(*) FROM `+e.tables(topic).Messages, nil, &st.rows); err != nil {
		return st, err
	}
	return st, nil
}
