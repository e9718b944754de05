package main

import (
	"context"
	"database/sql"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/lib/pq"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

// Scenarios 8 to 10: what subscriptions cost when they have nothing to do (8, idle), what a
// thousand of them cost in one process (9, many), and how far one consumer group goes with
// more consumers (10, group).

// driver is the database driver a contender's subscriptions use in scenarios 8 and 9.
type driver int

const (
	viaPgx driver = iota
	viaStdSQL
)

func (d driver) String() string {
	if d == viaStdSQL {
		return "database/sql"
	}
	return "pgx"
}

// idleEnv is a pool of one driver for the idle scenarios, not warmed: the connections it holds
// are those the subscriptions open.
type idleEnv struct {
	c    contender
	d    driver
	pgx  *pgxpool.Pool
	std  *sql.DB
	subs []message.Subscriber
}

// openIdleEnv opens the pool on url: the server's, or the transaction-counting proxy's.
func openIdleEnv(ctx context.Context, cfg *config, url string, c contender, d driver) (*idleEnv, error) {
	e := &idleEnv{c: c, d: d}
	if d == viaStdSQL {
		db, err := sql.Open("postgres", stdURL(url, c.appName()))
		if err != nil {
			return nil, err
		}
		n := cfg.poolSize
		if c == advisory {
			n += cfg.idleLockSubs // its lock connections come out of the *sql.DB's limit
		}
		db.SetMaxOpenConns(n)
		db.SetMaxIdleConns(cfg.poolSize)
		e.std = db
		return e, nil
	}
	pc, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("-url: %w", err)
	}
	pc.MaxConns = int32(cfg.poolSize)
	pc.ConnConfig.RuntimeParams["application_name"] = c.appName()
	if cfg.traceSQL {
		pc.ConnConfig.Tracer = sqlTracer
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, err
	}
	e.pgx = pool
	return e, nil
}

// stdURL adds application_name to a postgres:// URL for lib/pq.
func stdURL(url, app string) string {
	sep := "?"
	for _, r := range url {
		if r == '?' {
			sep = "&"
		}
	}
	return url + sep + "application_name=" + app
}

func (e *idleEnv) subscriber(mode sqlbroker.ClaimMode) (message.Subscriber, error) {
	var s message.Subscriber
	var err error
	if e.c == watermillSQL {
		var bg wsql.Beginner
		if e.d == viaStdSQL {
			bg = wsql.BeginnerFromStdSQL(e.std)
		} else {
			bg = wsql.BeginnerFromPgx(e.pgx)
		}
		s, err = wsql.NewSubscriber(bg, wsql.SubscriberConfig{
			ConsumerGroup: group, SchemaAdapter: wsqlSchema(), OffsetsAdapter: wsqlOffsets(),
		}, nil)
	} else {
		db := sqlbroker.Pgx(e.pgx)
		if e.d == viaStdSQL {
			db = sqlbroker.StdSQL(e.std)
		}
		s, err = sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: group, ClaimMode: mode}, nil)
	}
	if err == nil {
		e.subs = append(e.subs, s)
	}
	return s, err
}

func (e *idleEnv) close() {
	for _, s := range e.subs {
		_ = s.Close()
	}
	if e.pgx != nil {
		e.pgx.Close()
	}
	if e.std != nil {
		_ = e.std.Close()
	}
}

func (c contender) mode() sqlbroker.ClaimMode {
	if c == advisory {
		return sqlbroker.ClaimAdvisoryLock
	}
	return sqlbroker.ClaimLease
}

// xacts is the database's count of transactions ended so far (pg_stat_database), as every
// backend last reported it (at most about a second late).
func (b *bench) xacts(ctx context.Context) (int64, error) {
	var n int64
	err := b.admin.QueryRow(ctx, `SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	return n, err
}

// txRate is the database's transactions per second over window, less the baseline (the
// admin pool's own reads and whatever else runs in the database when nothing is subscribed).
func (b *bench) txRate(ctx context.Context, window time.Duration) (float64, error) {
	before, err := b.xacts(ctx)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	prev := before
	for time.Since(start) < window {
		select {
		case <-time.After(time.Second):
		case <-ctx.Done():
			return 0, context.Cause(ctx)
		}
		if b.cfg.verbose {
			n, _ := b.xacts(ctx)
			b.logf("    +%d", n-prev)
			prev = n
		}
	}
	after, err := b.xacts(ctx)
	if err != nil {
		return 0, err
	}
	return float64(after-before) / time.Since(start).Seconds(), nil
}

// baseline measures the database's transaction rate with nothing subscribed, once a run.
func (b *bench) baseline(ctx context.Context) (float64, error) {
	b.mu.Lock()
	done, v := b.baseDone, b.base
	b.mu.Unlock()
	if done {
		return v, nil
	}
	time.Sleep(2 * time.Second) // let backends that just went idle report
	v, err := b.txRate(ctx, b.cfg.idleWindow)
	if err != nil {
		return 0, err
	}
	b.mu.Lock()
	b.base, b.baseDone = v, true
	b.mu.Unlock()
	b.results.note(fmt.Sprintf("scenarios 8, 9: %.1f tx/s in the database with nothing subscribed, subtracted from every idle figure", v))
	return v, nil
}

// createTopics creates n topics' tables for c.
func (b *bench) createTopics(ctx context.Context, c contender, scenario string, n int) ([]string, error) {
	e, err := openEnv(ctx, b.cfg, c)
	if err != nil {
		return nil, err
	}
	defer e.close()
	topics := make([]string, n)
	for i := range topics {
		topics[i] = b.topic(c, scenario)
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				if err := e.createTopic(ctx, topics[i]); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return nil, fmt.Errorf("create tables: %w", err)
	}
	return topics, nil
}

// idleFigures is what n idle subscriptions of one contender and driver cost.
type idleFigures struct {
	n          int
	txPerSec   float64 // steady: transactions per second over the window
	startup    float64 // transactions of the start (see idleRun), less the steady rate over as long
	source     string  // where the transactions were counted
	conns      int     // the contender's backends in pg_stat_activity
	goroutines int     // goroutines added
	heapMiB    float64 // HeapInuse added, after a GC
}

// secondsOf is d in whole seconds, rounded up.
func secondsOf(d time.Duration) int { return int(math.Ceil(d.Seconds())) }

// idleRun subscribes to every topic with one Subscriber of c over driver d and counts the
// transactions the subscriptions cost, second by second from the first Subscribe: while they
// start, through -idle-settle, then over -idle-window, their steady rate while nothing is
// published. With -idle-proxy they are counted exactly, at the protocol, on the contender's
// own connections (txProxy); the database's count (pg_stat_database, less the baseline) is
// printed beside it, and is what the figures use without the proxy.
func (b *bench) idleRun(ctx context.Context, c contender, d driver, topics []string, scenario string) (idleFigures, error) {
	f := idleFigures{n: len(topics), source: "pg_stat_database, less the baseline"}
	var base float64
	url := b.cfg.url
	var proxy *txProxy
	if b.cfg.idleProxy {
		p, u, err := startTxProxy(b.cfg.url)
		if err != nil {
			return f, fmt.Errorf("-idle-proxy: %w", err)
		}
		defer p.close()
		proxy, url, f.source = p, u, "counted at the protocol on the contender's connections"
	} else {
		var err error
		if base, err = b.baseline(ctx); err != nil {
			return f, err
		}
	}
	runtime.GC()
	var ms0 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	g0 := runtime.NumGoroutine()

	e, err := openIdleEnv(ctx, b.cfg, url, c, d)
	if err != nil {
		return f, err
	}
	defer e.close()
	s, err := e.subscriber(c.mode())
	if err != nil {
		return f, err
	}

	// The database's count at every whole second from the first Subscribe.
	var mu sync.Mutex
	var db []int64
	x0, err := b.xacts(ctx)
	if err != nil {
		return f, err
	}
	db = append(db, x0)
	if proxy != nil {
		proxy.reset()
	}
	t0 := time.Now()
	sampleCtx, stopSampling := context.WithCancel(ctx)
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for k := 1; ; k++ {
			select {
			case <-time.After(time.Until(t0.Add(time.Duration(k) * time.Second))):
			case <-sampleCtx.Done():
				return
			}
			x, err := b.xacts(sampleCtx)
			if err != nil {
				return
			}
			mu.Lock()
			db = append(db, x)
			mu.Unlock()
		}
	}()
	defer func() { stopSampling(); <-sampled }()

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for _, t := range topics {
		ch, err := s.Subscribe(sctx, t)
		if err != nil {
			return f, fmt.Errorf("subscribe %s: %w", t, err)
		}
		go func() {
			for m := range ch {
				m.Ack()
			}
		}()
	}
	subscribing := time.Since(t0)
	from := secondsOf(subscribing) + secondsOf(b.cfg.idleSettle) // the window, in whole seconds from t0
	to := from + secondsOf(b.cfg.idleWindow)
	select {
	case <-time.After(time.Until(t0.Add(time.Duration(to) * time.Second))):
	case <-ctx.Done():
		return f, context.Cause(ctx)
	}
	readAll := func() bool { mu.Lock(); defer mu.Unlock(); return len(db) > to }
	for deadline := time.Now().Add(5 * time.Second); !readAll() && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	stopSampling()
	<-sampled
	mu.Lock()
	defer mu.Unlock()
	if len(db) <= to {
		return f, fmt.Errorf("the database's transaction count was read %d times in %d s", len(db), to)
	}

	// Second by second, from the first Subscribe.
	perDB := make([]int64, to)
	for k := range perDB {
		perDB[k] = db[k+1] - db[k]
	}
	var perProxy []int64
	if proxy != nil {
		perProxy = make([]int64, to)
		for k := range perProxy {
			perProxy[k] = int64(proxy.between(time.Duration(k)*time.Second, time.Duration(k+1)*time.Second))
		}
	}
	count := func(a, z int) float64 { // transactions in seconds [a, z) of the source the figures use
		var n int64
		for k := a; k < z; k++ {
			if perProxy != nil {
				n += perProxy[k]
			} else {
				n += perDB[k]
			}
		}
		if perProxy == nil {
			return float64(n) - base*float64(z-a)
		}
		return float64(n)
	}
	f.txPerSec = max(count(from, to)/float64(to-from), 0)
	// The start: counted at the protocol, up to 2 s after the last Subscribe returned (the
	// claims that follow it have run by then, and no subscription polls by itself before
	// 22 s); from the database's count, up to the window, as backends report late.
	upTo := from
	if perProxy != nil {
		upTo = min(secondsOf(subscribing)+2, from)
	}
	f.startup = count(0, upTo) - f.txPerSec*float64(upTo)
	b.addTrace(idleSeries(b.roundTitle(fmt.Sprintf("%s, scenario %s, %s, %d subscriptions", c, scenario, d, f.n)),
		subscribing, from, perProxy, perDB))

	_ = b.admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, c.appName()).Scan(&f.conns)
	runtime.GC()
	var ms1 runtime.MemStats
	runtime.ReadMemStats(&ms1)
	f.goroutines = runtime.NumGoroutine() - g0
	f.heapMiB = float64(int64(ms1.HeapInuse)-int64(ms0.HeapInuse)) / (1 << 20)
	b.logf("  %s over %s: %d subscriptions: %.0f transactions to start, then %.1f tx/s, %d connections, %d goroutines, %.1f MiB heap",
		c, d, f.n, f.startup, f.txPerSec, f.conns, f.goroutines, f.heapMiB)
	return f, nil
}

// idleSeries prints the transactions of an idle run second by second from the first
// Subscribe: counted at the protocol on the contender's connections (exact, and when each
// ended), and as the database reports them (every client's, up to 10 s late).
func idleSeries(title string, subscribing time.Duration, window int, perProxy, perDB []int64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Transactions per second from the first Subscribe, %s (subscribing took %.1f s; the steady window starts at second %d):\n\n```\n",
		title, subscribing.Seconds(), window+1)
	row := func(label string, vs []int64) {
		fmt.Fprintf(&b, "%-18s", label)
		for _, v := range vs {
			fmt.Fprintf(&b, " %5d", v)
		}
		b.WriteString("\n")
	}
	secs := make([]int64, len(perDB))
	for i := range secs {
		secs[i] = int64(i + 1)
	}
	row("second", secs)
	if perProxy != nil {
		row("protocol", perProxy)
	}
	row("pg_stat_database", perDB)
	b.WriteString("```\n")
	return b.String()
}

// Scenario 8: transactions per second that idle subscriptions cost the database, per
// subscription, through pgx and database/sql. The advisory mode holds a connection per
// subscription, so it runs with -idle-lock-subs subscriptions.
func scenarioIdle(ctx context.Context, b *bench, c contender) error {
	if !c.onPostgres() {
		return errNotOnPostgres
	}
	n := b.cfg.idleSubs
	if c == advisory {
		n = b.cfg.idleLockSubs
	}
	topics, err := b.createTopics(ctx, c, "idle", n)
	if err != nil {
		return err
	}
	for _, d := range []driver{viaPgx, viaStdSQL} {
		f, err := b.idleRun(ctx, c, d, topics, "8")
		if err != nil {
			return fmt.Errorf("%s: %w", d, err)
		}
		rows := [2]string{"8a", "8c"}
		if d == viaStdSQL {
			rows = [2]string{"8b", "8d"}
		}
		b.results.set(rows[0], c, f.txPerSec/float64(n))
		b.results.set(rows[1], c, f.startup/float64(n))
		b.results.note(fmt.Sprintf("%s, scenario 8, %s: %d idle subscriptions, %.0f transactions to start, then %.1f tx/s in all (%s)",
			c, d, n, f.startup, f.txPerSec, f.source))
	}
	return nil
}

// Scenario 9: -many-subs subscriptions (one topic each) in one process, one Subscriber, idle:
// connections, goroutines, heap and transactions per second, per subscription. The advisory
// mode runs with -idle-lock-subs subscriptions (a connection each).
func scenarioMany(ctx context.Context, b *bench, c contender) error {
	if !c.onPostgres() {
		return errNotOnPostgres
	}
	n := b.cfg.manySubs
	if c == advisory {
		n = b.cfg.idleLockSubs
	}
	start := time.Now()
	topics, err := b.createTopics(ctx, c, "many", n)
	if err != nil {
		return err
	}
	b.logf("  %s: %d topics created in %s", c, n, time.Since(start).Round(time.Millisecond))
	for _, d := range []driver{viaPgx, viaStdSQL} {
		f, err := b.idleRun(ctx, c, d, topics, "9")
		if err != nil {
			return fmt.Errorf("%s: %w", d, err)
		}
		rows := [4]string{"9a", "9b", "9c", "9d"}
		if d == viaStdSQL {
			rows = [4]string{"9e", "9f", "9g", "9h"}
		}
		per := float64(n)
		b.results.set(rows[0], c, float64(f.conns))
		b.results.set(rows[1], c, float64(f.goroutines)/per)
		b.results.set(rows[2], c, f.heapMiB*1024/per)
		b.results.set(rows[3], c, f.txPerSec/per)
		b.results.note(fmt.Sprintf("%s, scenario 9, %s: %d subscriptions: %d connections, %d goroutines, %.1f MiB heap, %.0f transactions to start, then %.1f tx/s in all (%s)",
			c, d, n, f.conns, f.goroutines, f.heapMiB, f.startup, f.txPerSec, f.source))
	}
	return nil
}

// Scenario 10: one consumer group's rate with 1, 2, 4 and 8 consumers, each a Subscriber
// on a pool of its own (as consumer processes would be), no-op handler, over a published
// backlog: messages per second, and claims per second (updates of the group's row, one per
// claim that took new messages). On SQLite each consumer is a broker of its own on the one
// database file. The claims are PostgreSQL's count of the group row's updates: on SQLite
// (which keeps none) and on MySQL (whose count is not read) the claims rows are n/a.
func scenarioGroup(ctx context.Context, b *bench, c contender) error {
	if c.isWatermillSQL() {
		return fmt.Errorf("%w: watermill-sql hands out one message of a group at a time", errNA)
	}
	for i, k := range []int{1, 2, 4, 8} {
		msgs, claims, err := b.groupRun(ctx, c, k)
		if err != nil {
			return fmt.Errorf("%d consumers: %w", k, err)
		}
		b.results.set(fmt.Sprintf("10%c", 'a'+i), c, msgs)
		if !c.onPostgres() {
			b.results.setText(fmt.Sprintf("10%c", 'e'+i), c, "n/a")
			continue
		}
		b.results.set(fmt.Sprintf("10%c", 'e'+i), c, claims)
	}
	return nil
}

func (b *bench) groupRun(ctx context.Context, c contender, k int) (msgs, claims float64, err error) {
	e, topic, err := b.prepare(ctx, c, fmt.Sprintf("group%d", k), b.cfg.groupBacklog)
	if err != nil {
		return 0, 0, err
	}
	defer e.close()
	defer b.dropTopic(c, topic)
	envs := make([]*env, k)
	for i := range envs {
		pc := *b.cfg
		pc.poolSize = b.cfg.groupPool
		var ee *env
		if c.onSQLite() {
			ee, err = openSQLiteEnv(&pc, e.file)
		} else {
			ee, err = openEnv(ctx, &pc, c)
		}
		if err != nil {
			return 0, 0, err
		}
		defer ee.close()
		envs[i] = ee
	}
	updates := func() int64 {
		if !c.onPostgres() {
			return 0
		}
		var n int64
		_ = b.admin.QueryRow(ctx, `SELECT n_tup_upd FROM pg_stat_user_tables WHERE relid = $1::regclass`, libTables(topic).Groups).Scan(&n)
		return n
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, nil)
	if err != nil {
		return 0, 0, err
	}
	var handled atomic.Int64
	for i, ee := range envs {
		s, err := ee.subscriber(0)
		if err != nil {
			return 0, 0, err
		}
		defer s.Close()
		router.AddConsumerHandler(fmt.Sprintf("h%d", i), topic, s, func(*message.Message) error {
			handled.Add(1)
			return nil
		})
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = router.Run(runCtx) }()
	<-router.Running()
	// Measured after a second of warm-up, over the window or until the backlog is nearly gone.
	time.Sleep(2 * time.Second)
	h0, u0, t0 := handled.Load(), updates(), time.Now()
	deadline := t0.Add(b.cfg.groupWindow)
	for time.Now().Before(deadline) && handled.Load() < int64(b.cfg.groupBacklog*9/10) {
		time.Sleep(50 * time.Millisecond)
	}
	h1, u1, el := handled.Load(), updates(), time.Since(t0)
	_ = router.Close()
	if h1-h0 < int64(b.cfg.groupBacklog/10) {
		b.results.note(fmt.Sprintf("%s, scenario 10, %d consumers: only %d messages in the window; raise -group-backlog", c, k, h1-h0))
	}
	// Both counts of the group row's updates are read up to a second late (backends report
	// about once a second), both ends alike.
	return rate(h1-h0, el), rate(u1-u0, el), nil
}
