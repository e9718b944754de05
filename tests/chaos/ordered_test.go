package chaos

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// Four consumer processes of one group ordered by key; 64 keys of 40 messages each, published
// interleaved; MaxInFlight 32, handlers that work a random 0-30ms and fail 5% of their
// handlings; every other key acked in the transaction that records its handling. Midway, the
// process that began a handling last is killed with SIGKILL; its leases run out and the other
// three go on with its keys. The order check (ordercheck_test.go) reads every handling's start
// and end, and for the keys acked in a transaction the ack, from a table the processes write
// to: every message of a key starts only once the one before it was acked, never beside
// another of its key but for the killed process's handlings, and at least 8 run at once
// across the processes.
func TestOrderByKey_processesOneKilled(t *testing.T) {
	const keys, perKey, procs = 64, 40, 4
	ctx := context.Background()
	db := testdb.Pgx(t)
	topic := testdb.Topic(t, "")
	tables := offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic)
	run := strings.ToLower(watermill.NewShortUUID())
	libPrefix := "sqlbordlib" + run
	results := pgx.Identifier{"chaos_okill_" + topic}.Sanitize()
	_, err := db.Exec(ctx, "CREATE TABLE "+results+` (uuid text NOT NULL, consumer text NOT NULL, pid int NOT NULL,
		attempt int NOT NULL, kind text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(), off bigint NOT NULL)`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.Exec(context.Background(), "DROP TABLE IF EXISTS "+results) })

	broker, err := sqlbroker.Open(withApp("postgres", "sqlbordpub"+run), sqlbroker.BrokerConfig{MaxConns: 4}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = broker.Close() })
	require.NoError(t, broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
	pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{})
	require.NoError(t, err)

	const lease = 2 * time.Second
	hist := &history{}
	f := newFleet(t, "o", hist, procs, consumerConfig{
		RecordURL: withApp("postgres", "sqlbordrec"+run), Topic: topic, Group: "ordered", Mode: int(sqlbroker.ClaimLease), Results: results,
		MaxInFlight: 32, LeaseTTL: lease, Renew: lease / 4, Poll: 50 * time.Millisecond, Retry: 250 * time.Millisecond,
		Timeout: 10 * time.Second, WorkMax: 30 * time.Millisecond, NackPercent: 5, NackBackoff: sqlbroker.NoBackoff, OrderByKey: true,
	}, func(slot, gen int) string {
		return withApp("postgres", fmt.Sprintf("%so%dg%d", libPrefix, slot, gen))
	}, func(int) int { return 10 })

	msgs := make([]*message.Message, 0, keys*perKey)
	for i := range perKey {
		for k := range keys {
			m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("k%02d:%d", k, i)))
			m.Metadata.Set(sqlbroker.MetadataOrderKey, fmt.Sprintf("k%02d", k))
			if k%2 == 0 {
				m.Metadata.Set(metaAckInTx, "1")
			}
			msgs = append(msgs, m)
		}
	}
	for len(msgs) > 0 {
		n := min(500, len(msgs))
		require.NoError(t, pub.Publish(topic, msgs[:n]...))
		msgs = msgs[n:]
	}

	handled := func() int { return queryInt(t, "SELECT count(DISTINCT uuid) FROM "+results+" WHERE kind = 'done'") }
	testdb.Eventually(t, 3*time.Minute, "half the messages handled", func() bool { return handled() >= keys*perKey/2 })
	// The process with the most handlings begun and not ended.
	var last string
	testdb.Eventually(t, 30*time.Second, "a process with handlings in work", func() bool {
		err := db.QueryRow(ctx, "SELECT consumer FROM "+results+" s WHERE s.kind = 'start' AND NOT EXISTS (SELECT 1 FROM "+results+
			" e WHERE e.consumer = s.consumer AND e.off = s.off AND e.attempt = s.attempt AND e.kind <> 'start') GROUP BY consumer HAVING count(*) >= 3 ORDER BY count(*) DESC LIMIT 1").Scan(&last)
		return err == nil
	})
	killed := f.slotOf(last)
	require.GreaterOrEqual(t, killed, 0, "consumer %s", last)
	f.kill(killed)

	testdb.Eventually(t, 3*time.Minute, "every message handled", func() bool { return handled() >= keys*perKey })
	testdb.Eventually(t, 30*time.Second, "every claim settled", func() bool {
		return queryInt(t, "SELECT count(*) FROM "+tables.Claims) == 0
	})
	for i := range procs {
		if i != killed {
			f.stop(i)
		}
	}
	_, err = broker.Shutdown(ctx)
	require.NoError(t, err)

	faults, events := hist.snapshot()
	chk := &checker{faults: faults, events: events, lease: func(string) (time.Duration, time.Duration, bool) {
		return lease, lease / 4, false
	}}
	dup := chk.check(t, "o", results)
	stored, hs := readOrdered(t, tables.Messages, results, faults)
	v := chk.checkOrder(t, stored, hs, results)
	failed := queryInt(t, "SELECT count(*) FROM "+results+" WHERE kind = 'failed'")
	inWork := 0
	for _, h := range hs {
		if h.Killed {
			inWork++
		}
	}
	t.Logf("%d keys x %d messages, %d handlings (%d failed), process %s killed in %d handlings; order violations %d "+
		"(started before the one before was acked %d, beside another of the key unexplained %d of %d, acked twice %d); duplicates %d (unexplained %d); at most %d in handlers at once; explained: %v %v",
		v.keys, v.messages/max(v.keys, 1), v.handlings, failed, last, inWork, v.violations(), v.startedEarly, v.unexplainedOverlaps, v.overlaps, v.ackedTwice,
		dup.duplicates, dup.unexplainedDuplicates, v.maxInHandlers, v.byWhy, dup.byWhy)
	for _, u := range append(dup.unexplained, v.unexplained...) {
		t.Log(u)
	}
	assert.Equal(t, keys, v.keys)
	assert.Equal(t, keys*perKey, v.messages)
	assert.Zero(t, v.notHandled, "messages never acked")
	assert.Zero(t, v.violations(), "order violations")
	assert.Zero(t, dup.unexplainedDuplicates+dup.unexplainedRefusals+dup.unexplainedLosses, "unexplained duplicates, refusals or lost claims")
	assert.GreaterOrEqual(t, v.maxInHandlers, 8, "too few messages in handlers at once across the processes")
	if t.Failed() {
		_, _, ps := f.reports()
		for _, p := range ps {
			t.Log(tail(p.logPath, 20))
		}
	}
}
