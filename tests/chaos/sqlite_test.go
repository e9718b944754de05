package chaos

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
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

// The SQLite run: consumer processes of one consumer group on one SQLite file, fed by a
// publisher in the test process, while consumers are killed with SIGKILL and restarted and
// frozen with SIGSTOP for longer than a lease. What PostgreSQL alone has (table locks,
// terminated backends, the xmin horizon, server restarts) does not apply. A consumer frozen
// inside a write transaction holds the file's write lock for the whole freeze, which every
// other process then waits on, like a table lock: the test asks the file whether its write
// lock is held while the process is stopped, and records it as such a window.
//
// What each consumer handled is recorded in PostgreSQL, outside the library and outside the
// file, so that the history check is the PostgreSQL runs' own.
const (
	sqliteConsumers  = 3
	sqlitePublishFor = 12 * time.Second
	sqliteTotal      = 900
)

type sqliteTotals struct {
	published, stored, deliveredUnique int
	lost, claimsLeft                   int
	kills, freezes, writeLocks         int
	stale, leasesLost, nacked          int64
	cleanExits, processes              int
	main                               verdict
	ping, killRedelivery               []time.Duration
	probes                             int
	elapsed                            time.Duration
}

func TestChaosSQLite(t *testing.T) {
	start := time.Now()
	ctx := context.Background()
	db := testdb.Pgx(t)
	topic := testdb.Topic(t, "")
	path := filepath.Join(t.TempDir(), "chaos.db")
	libURL := "sqlite:" + path + "?mode=rwc"
	tables := offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic).OnSQLite()
	run := strings.ToLower(watermill.NewShortUUID())
	results := pgx.Identifier{"chaos_sqlite_" + topic}.Sanitize()
	_, err := db.Exec(ctx, "CREATE TABLE "+results+` (uuid text NOT NULL, consumer text NOT NULL, pid int NOT NULL,
		attempt int NOT NULL, kind text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(), off bigint NOT NULL)`)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = db.Exec(context.Background(), "DROP TABLE IF EXISTS "+results) })

	broker, err := sqlbroker.Open(libURL, sqlbroker.BrokerConfig{MaxConns: 4}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = broker.Close() })
	require.NoError(t, broker.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))
	pub, err := broker.NewPublisher(sqlbroker.PublisherConfig{})
	require.NoError(t, err)

	// The test's own reads of the file, and its probe of the write lock (a connection of its
	// own, which waits a second at most for the lock).
	lite, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)")
	require.NoError(t, err)
	t.Cleanup(func() { _ = lite.Close() })
	probe, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(1000)")
	require.NoError(t, err)
	probe.SetMaxOpenConns(1)
	t.Cleanup(func() { _ = probe.Close() })
	liteInt := func(q string) int {
		var n int
		require.NoError(t, lite.QueryRowContext(ctx, q).Scan(&n))
		return n
	}

	hist := &history{}
	base := consumerConfig{
		RecordURL: withApp("postgres", "sqlbchaosrec"+run), Topic: topic, Group: "chaos", Mode: int(sqlbroker.ClaimLease), Results: results,
		MaxInFlight: 16, LeaseTTL: leaseTTL, Renew: renewInterval, Poll: pollInterval, Retry: retryInterval,
		Timeout: handlerTimeout, Faults: true,
	}
	f := newFleet(t, "s", hist, sqliteConsumers, base, func(int, int) string { return libURL }, func(int) int { return 4 })

	var tot sqliteTotals
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		_, _, ps := f.reports()
		for _, p := range ps {
			t.Log(tail(p.logPath, 25))
		}
	})

	publishFor, total := sqlitePublishFor, sqliteTotal
	if d := soakDuration(t); d > 0 {
		publishFor = d
		total = int(float64(total) * d.Seconds() / sqlitePublishFor.Seconds())
	}
	pubDone := make(chan error, 1)
	go func() {
		deadline := time.Now().Add(3*publishFor + time.Minute)
		for sent := 0; sent < total; {
			if time.Now().After(deadline) {
				pubDone <- fmt.Errorf("only %d of %d published by the deadline", sent, total)
				return
			}
			n := min(1+rand.IntN(20), total-sent)
			msgs := make([]*message.Message, n)
			for j := range msgs {
				msgs[j] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf("s-%d", sent+j)))
			}
			if err := pub.Publish(topic, msgs...); err != nil {
				pubDone <- err
				return
			}
			sent += n
			tot.published += n
			time.Sleep(time.Duration(float64(publishFor) * float64(n) / float64(total))) // pacing
		}
		pubDone <- nil
	}()

	// Faults while publishing, and a few seconds beyond: at least one of each.
	faultsEnd := time.Now().Add(publishFor + 3*time.Second)
	cycle := []string{"kill", "freeze", "kill", "kill", "freeze"}
	for i := 0; i < 10000 && (time.Now().Before(faultsEnd) || tot.kills == 0 || tot.freezes == 0); i++ {
		time.Sleep(time.Duration(500+rand.IntN(700)) * time.Millisecond) // pacing, not synchronisation
		slot := rand.IntN(sqliteConsumers)
		switch cycle[i%len(cycle)] {
		case "kill":
			f.kill(slot)
			tot.kills++
			time.Sleep(200 * time.Millisecond)
			f.start(slot)
		case "freeze":
			if freezeSQLite(t, f, slot, leaseTTL+time.Second, probe) {
				tot.writeLocks++
			}
			tot.freezes++
		}
	}
	select {
	case err := <-pubDone:
		require.NoError(t, err)
	case <-time.After(3*publishFor + 2*time.Minute):
		t.Fatal("the publisher did not finish")
	}
	for i := range sqliteConsumers {
		f.waitReady(i)
	}

	// Every message stored is recorded as handled, at least once.
	stored := func() int { return liteInt("SELECT count(DISTINCT uuid) FROM " + tables.Messages) }
	handled := func() map[string]bool {
		rows, err := db.Query(ctx, "SELECT DISTINCT uuid FROM "+results+" WHERE kind = 'done'")
		require.NoError(t, err)
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		m := make(map[string]bool, len(ids))
		for _, id := range ids {
			m[id] = true
		}
		return m
	}
	testdb.Eventually(t, 2*time.Minute, "every message handled", func() bool { return len(handled()) >= stored() })
	testdb.Eventually(t, 30*time.Second, "every claim settled", func() bool { return liteInt("SELECT count(*) FROM "+tables.Claims) == 0 })

	measureSQLiteRecovery(t, f, pub, topic, results, &tot)

	f.stopAll()
	_, err = broker.Shutdown(ctx)
	require.NoError(t, err)

	// Totals.
	tot.published += tot.probes
	tot.stored = stored()
	done := handled()
	rows, err := lite.QueryContext(ctx, "SELECT uuid FROM "+tables.Messages)
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		if done[id] {
			tot.deliveredUnique++
		} else {
			tot.lost++
		}
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	tot.claimsLeft = liteInt("SELECT count(*) FROM " + tables.Claims)
	faults, events := hist.snapshot()
	chk := &checker{faults: faults, events: events, lease: func(string) (time.Duration, time.Duration, bool) {
		return leaseTTL, renewInterval, false
	}}
	tot.main = chk.check(t, "s", results)

	last, final, procs := f.reports()
	tot.processes = len(procs)
	for _, p := range procs {
		r, ok := last[p.id]
		if !ok {
			continue
		}
		tot.stale += r.Stats.StaleSettlements
		tot.leasesLost += r.Stats.LeasesLost
		tot.nacked += r.Stats.Nacked
		if !final[p.id] {
			continue
		}
		tot.cleanExits++
		assert.Empty(t, r.ShutdownErr, "consumer %s shutdown (report %+v)", p.id, r.Report)
		assert.Empty(t, r.RunErr, "consumer %s run", p.id)
		assert.Equal(t, 1, r.Report.Subscriptions, "consumer %s: the report of its shutdown counts its one subscription: %+v", p.id, r.Report)
	}
	tot.elapsed = time.Since(start)
	printSQLiteTotals(t, tot)

	assert.Equal(t, tot.published, tot.stored, "messages stored differ from messages published")
	assert.Zero(t, tot.lost, "messages lost")
	assert.Equal(t, tot.stored, tot.deliveredUnique)
	assert.Zero(t, tot.claimsLeft, "claims left unsettled")
	assert.Equal(t, sqliteConsumers, tot.cleanExits-countKilledWithFinal(procs, final), "every consumer not killed exits cleanly")
	assert.Zero(t, tot.main.unexplainedRefusals, "unexplained refused settlements")
	assert.Zero(t, tot.main.unexplainedLosses, "unexplained lost claims")
	assert.Zero(t, tot.main.unexplainedDuplicates, "unexplained duplicates")
	for _, u := range tot.main.unexplained {
		t.Log(u)
	}
}

// freezeSQLite stops slot i's process with SIGSTOP for d, then continues it, like fleet.freeze;
// while it is stopped, it asks the file whether its write lock is held (the process was
// stopped inside a write transaction) and records the freeze as a write-lock window for every
// process when it is. It reports whether the lock was held.
func freezeSQLite(t *testing.T, f *fleet, i int, d time.Duration, probe *sql.DB) bool {
	f.mu.Lock()
	p := f.slots[i]
	p.frozen = true
	f.mu.Unlock()
	start := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGSTOP)
	testdb.Eventually(t, 5*time.Second, "the process stopped", func() bool { return procState(p.cmd.Process.Pid) == 'T' })
	held := writeLockHeld(probe)
	time.Sleep(time.Until(start.Add(d))) // the length of the stall
	end := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGCONT)
	f.hist.add(fault{Kind: faultFreeze, Procs: []string{p.id}, Start: start, End: end})
	if held {
		f.hist.add(fault{Kind: faultWriteLock, Start: start, End: end})
	}
	return held
}

// writeLockHeld tries to take the file's write lock, waiting a second at most (the probe's busy
// timeout): the other processes' write transactions last milliseconds, so a lock still held
// after two such waits is held by the stopped process.
func writeLockHeld(probe *sql.DB) bool {
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		conn, err := probe.Conn(ctx)
		if err != nil {
			cancel()
			return false
		}
		_, err = conn.ExecContext(ctx, "BEGIN IMMEDIATE")
		if err == nil {
			_, _ = conn.ExecContext(ctx, "ROLLBACK")
		}
		_ = conn.Close()
		cancel()
		if err == nil {
			return false
		}
		if !strings.Contains(err.Error(), "locked") && !strings.Contains(err.Error(), "busy") {
			return false
		}
	}
	return true
}

// procState is the state letter of a process in /proc ('T': stopped), or 0.
func procState(pid int) byte {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}

// measureSQLiteRecovery measures, with the fleet running and idle: how long a message published
// in this process takes to be handled by a consumer process (which only polls the file for it),
// and how long after a SIGKILL of the consumer holding a message another one handles it.
func measureSQLiteRecovery(t *testing.T, f *fleet, pub *sqlbroker.Publisher, topic, results string, tot *sqliteTotals) {
	at := firstEvent(t, results)
	for range 5 {
		t0 := time.Now()
		msg := message.NewMessage(watermill.NewUUID(), []byte(probePing))
		require.NoError(t, pub.Publish(topic, msg))
		tot.probes++
		var done time.Time
		testdb.Eventually(t, 30*time.Second, "the probe handled", func() bool {
			var ok bool
			done, _, ok = at(msg.UUID, "done")
			return ok
		})
		tot.ping = append(tot.ping, done.Sub(t0))
	}
	for range 2 {
		tot.probes++
		tot.kills++
		tot.killRedelivery = append(tot.killRedelivery, killHolder(t, f, pub, topic, at, time.Now))
	}
}

// printSQLiteTotals writes the totals like printTotals: to the test log, stdout and the file
// SQLBROKER_CHAOS_TOTALS names.
func printSQLiteTotals(t *testing.T, tot sqliteTotals) {
	var b strings.Builder
	fmt.Fprintf(&b, "=== chaos totals: SQLite, one file, claim mode lease (%d consumer processes, %s)\n", sqliteConsumers, tot.elapsed.Round(time.Second))
	fmt.Fprintf(&b, "published               %d (%d probes of the recovery measurements included; stored %d distinct)\n", tot.published, tot.probes, tot.stored)
	fmt.Fprintf(&b, "delivered unique        %d\n", tot.deliveredUnique)
	fmt.Fprintf(&b, "lost                    %d\n", tot.lost)
	fmt.Fprintf(&b, "duplicates              %d, unexplained %d (every duplicate handling explained by what happened to it or to the handling before it: below)\n", tot.main.duplicates, tot.main.unexplainedDuplicates)
	fmt.Fprintf(&b, "claims left             %d\n", tot.claimsLeft)
	fmt.Fprintf(&b, "stale settlements       %d refused (leases lost %d, nacks applied %d; killed processes counted up to their last second)\n", tot.stale, tot.leasesLost, tot.nacked)
	fmt.Fprintf(&b, "unexplained refusals    %d (of %d refused or not applied in the history)\n", tot.main.unexplainedRefusals, tot.main.refusals)
	fmt.Fprintf(&b, "unexplained duplicates  %d\n", tot.main.unexplainedDuplicates)
	fmt.Fprintf(&b, "unexplained lost claims %d (of %d)\n", tot.main.unexplainedLosses, tot.main.losses)
	fmt.Fprintf(&b, "explained by\n%s", fmtWhy(tot.main.byWhy))
	fmt.Fprintf(&b, "faults injected         %d SIGKILL+restart, %d SIGSTOP for %s then SIGCONT (%d of them inside a write transaction: the file's write lock held meanwhile), handlers panicking/nacking/timing out on ~9%% of messages\n",
		tot.kills, tot.freezes, leaseTTL+time.Second, tot.writeLocks)
	fmt.Fprintf(&b, "processes               %d started, %d clean exits\n", tot.processes, tot.cleanExits)
	fmt.Fprintf(&b, "recovery: published in the test process, handled in a consumer process %s (PollInterval %s)\n", fmtDurations(tot.ping), pollInterval)
	fmt.Fprintf(&b, "recovery: redelivery after SIGKILL of the holder  %s (LeaseTTL %s, poll %s)\n", fmtDurations(tot.killRedelivery), leaseTTL, pollInterval)
	t.Log("\n" + b.String())
	fmt.Print(b.String())
	if path := os.Getenv("SQLBROKER_CHAOS_TOTALS"); path != "" {
		file, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
		require.NoError(t, err)
		_, err = file.WriteString(b.String())
		require.NoError(t, errors.Join(err, file.Close()))
	}
}
