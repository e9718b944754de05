package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// serverProfile samples what the PostgreSQL server does while a drain runs (-server-profile):
// every sample reads pg_stat_activity and counts each process that is working, by who it is
// (the contender's backends, an autovacuum worker and its table, a background process) and by
// what it is doing (on CPU, or its wait event); it also reads the CPU time of those processes
// from /proc. Counters of the whole server (pg_stat_bgwriter, pg_stat_wal) are read at the
// start and the end. Together they tell where a drain's server time went: the contender's own
// statements, or autovacuum, checkpoints and buffer writes that a larger table brings.
type serverProfile struct {
	admin *pgxpool.Pool
	app   string
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once

	mu      sync.Mutex
	samples int
	failed  []error // samples that could not be read
	states  map[profKey]int
	cpu     map[int]*procSpan // by pid
	before  serverCounters
	start   time.Time
	self    time.Duration // this process's CPU time at the start
}

type profKey struct{ who, what string }

type procSpan struct {
	who         string
	first, last time.Duration
}

// serverCounters are cumulative counters of the whole server.
type serverCounters struct {
	checkpointsTimed, checkpointsReq             int64
	buffersCheckpoint, buffersClean, buffersBack int64
	walBytes, walBuffersFull                     int64
	err                                          error // the view's columns differ (PostgreSQL 17 moved some), or it is missing
}

func readServerCounters(ctx context.Context, admin *pgxpool.Pool) serverCounters {
	var c serverCounters
	err := admin.QueryRow(ctx, `SELECT b.checkpoints_timed, b.checkpoints_req, b.buffers_checkpoint,
		b.buffers_clean, b.buffers_backend, w.wal_bytes::bigint, w.wal_buffers_full
		FROM pg_stat_bgwriter b, pg_stat_wal w`).Scan(&c.checkpointsTimed, &c.checkpointsReq,
		&c.buffersCheckpoint, &c.buffersClean, &c.buffersBack, &c.walBytes, &c.walBuffersFull)
	c.err = err
	return c
}

func startServerProfile(ctx context.Context, admin *pgxpool.Pool, app string, every time.Duration) *serverProfile {
	p := &serverProfile{admin: admin, app: app, stop: make(chan struct{}), done: make(chan struct{}),
		states: map[profKey]int{}, cpu: map[int]*procSpan{}, start: time.Now(), self: selfCPU()}
	p.before = readServerCounters(ctx, admin)
	go func() {
		defer close(p.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			p.sample(ctx)
			select {
			case <-p.stop:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return p
}

// sample reads pg_stat_activity once. A process counts as working when it is active (client
// backends and autovacuum workers) or, for background processes, when it waits on I/O or a
// lock rather than sleeping.
func (p *serverProfile) sample(ctx context.Context) {
	rows, err := p.admin.Query(ctx, `SELECT pid, backend_type, coalesce(application_name, ''),
		coalesce(state, ''), coalesce(wait_event_type, ''), coalesce(wait_event, ''), left(coalesce(query, ''), 200)
		FROM pg_stat_activity WHERE pid <> pg_backend_pid()`)
	if err != nil {
		p.fail(err)
		return
	}
	defer rows.Close()
	type row struct {
		pid                                  int
		btype, app, state, wtype, wev, query string
	}
	var rs []row
	for rows.Next() {
		var r row
		if err := rows.Scan(&r.pid, &r.btype, &r.app, &r.state, &r.wtype, &r.wev, &r.query); err != nil {
			p.fail(err)
			return
		}
		rs = append(rs, r)
	}
	if err := rows.Err(); err != nil {
		p.fail(err)
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.samples++
	for _, r := range rs {
		who := p.classify(r.btype, r.app, r.query)
		if who == "" {
			continue
		}
		if d, ok := procCPU(r.pid); ok {
			if s := p.cpu[r.pid]; s != nil {
				s.last = d
			} else {
				p.cpu[r.pid] = &procSpan{who: cpuGroup(who), first: d, last: d}
			}
		}
		working := r.state == "active"
		if r.btype != "client backend" && r.btype != "autovacuum worker" {
			// Activity is a background process's main-loop sleep, Timeout a pause it takes
			// (a spread checkpoint between writes): neither is work.
			working = r.wtype != "" && r.wtype != "Activity" && r.wtype != "Timeout"
		}
		if !working {
			continue
		}
		what := "CPU"
		if r.wtype != "" {
			what = r.wtype + ":" + r.wev
		}
		p.states[profKey{who, what}]++
	}
}

// fail records a sample that could not be read; the profile says how many there were.
func (p *serverProfile) fail(err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failed = append(p.failed, err)
}

// classify names a process for the profile; "" leaves it out (the bench's own admin
// connections, and other clients' backends, which are not part of the run).
func (p *serverProfile) classify(btype, app, query string) string {
	switch {
	case btype == "client backend" && app == p.app:
		return "contender's backends"
	case btype == "client backend":
		return ""
	case btype == "autovacuum worker":
		// "autovacuum: VACUUM ANALYZE public.bench_..._messages (to prevent wraparound)" becomes
		// "autovacuum VACUUM ANALYZE …_messages": the operation and the table's kind.
		words := strings.Fields(strings.TrimPrefix(query, "autovacuum: "))
		for i, w := range words {
			if strings.Contains(w, ".") { // the schema-qualified table
				return "autovacuum " + strings.Join(words[:i], " ") + " …" + w[max(strings.LastIndexByte(w, '_'), 0):]
			}
		}
		return "autovacuum " + strings.Join(words, " ")
	default:
		return btype
	}
}

// cpuGroup folds the autovacuum workers' names into one CPU line.
func cpuGroup(who string) string {
	if strings.HasPrefix(who, "autovacuum ") {
		return "autovacuum workers"
	}
	return who
}

// halt stops the sampling; finish calls it, and a scenario that ends early calls it alone.
func (p *serverProfile) halt() {
	p.once.Do(func() { close(p.stop) })
	<-p.done
}

// finish stops the sampling and returns the profile of n messages handled in elapsed (the
// scenario's own timing) as Markdown.
func (p *serverProfile) finish(ctx context.Context, title string, n int64, elapsed time.Duration) string {
	self := selfCPU() - p.self
	p.halt()
	after := readServerCounters(ctx, p.admin)
	p.mu.Lock()
	defer p.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "Server profile, %s (%d samples of pg_stat_activity over %.1fs; a share is the mean number of processes in that state; a background process counts only while it waits on I/O or a lock, its CPU time is in the /proc line):\n\n",
		title, p.samples, elapsed.Seconds())
	if len(p.failed) > 0 {
		fmt.Fprintf(&b, "%d samples could not be read and are left out (first: %v).\n\n", len(p.failed), p.failed[0])
	}
	type kv struct {
		k profKey
		n int
	}
	var all []kv
	for k, n := range p.states {
		all = append(all, kv{k, n})
	}
	slices.SortFunc(all, func(a, c kv) int {
		if a.n != c.n {
			return c.n - a.n
		}
		return strings.Compare(a.k.who+a.k.what, c.k.who+c.k.what)
	})
	b.WriteString("| process | state | share |\n|---|---|---:|\n")
	var own float64 // the contender's backends, working
	for _, x := range all {
		share := float64(x.n) / float64(max(p.samples, 1))
		fmt.Fprintf(&b, "| %s | %s | %.2f |\n", x.k.who, x.k.what, share)
		if x.k.who == "contender's backends" {
			own += share
		}
	}
	if n > 0 {
		us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) / float64(n) }
		fmt.Fprintf(&b, "\nPer message: %.1f µs of wall time, of which the contender's backends were working (on CPU or waiting on the server) %.1f µs; the client process used %.1f µs of CPU.\n",
			us(elapsed), us(time.Duration(own*float64(elapsed))), us(self))
	}
	cpu := map[string]time.Duration{}
	for _, s := range p.cpu {
		cpu[s.who] += s.last - s.first
	}
	var groups []string
	for g := range cpu {
		if cpu[g] > 0 {
			groups = append(groups, g)
		}
	}
	slices.SortFunc(groups, func(a, c string) int { return int(cpu[c] - cpu[a]) })
	if len(groups) > 0 {
		b.WriteString("\nServer CPU time (from /proc, between the first and the last sample that saw each process):")
		for _, g := range groups {
			fmt.Fprintf(&b, " %s %.1fs;", g, cpu[g].Seconds())
		}
		b.WriteString("\n")
	}
	if err := errors.Join(p.before.err, after.err); err != nil {
		fmt.Fprintf(&b, "\nWhole server meanwhile: not read (%v).\n", err)
	} else {
		d := func(a, c int64) int64 { return c - a }
		fmt.Fprintf(&b, "\nWhole server meanwhile: checkpoints %d timed + %d requested; buffers written by checkpoints %d, by the background writer %d, by backends %d; WAL %.0f MiB, WAL buffers full %d times.\n",
			d(p.before.checkpointsTimed, after.checkpointsTimed), d(p.before.checkpointsReq, after.checkpointsReq),
			d(p.before.buffersCheckpoint, after.buffersCheckpoint), d(p.before.buffersClean, after.buffersClean),
			d(p.before.buffersBack, after.buffersBack), float64(d(p.before.walBytes, after.walBytes))/(1<<20),
			d(p.before.walBuffersFull, after.walBuffersFull))
	}
	return b.String()
}
