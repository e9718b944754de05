// Command sqlbroker-bench measures watermill-sqlbroker, in both claim modes, side by side with
// the official watermill-sql (v4, default PostgreSQL schema with a BYTEA payload, default
// settings) on one PostgreSQL, in one run, and prints every figure with its ratio to
// watermill-sql's figure from the same run. On a noisy machine only such ratios hold.
//
// Each scenario runs in -rounds interleaved rounds (5 by default): a round runs it once for
// every contender, one after the other (A, B, A, B, ...), so that whatever else the machine
// does weighs on all of them alike. The table shows each figure's median over the rounds and
// each ratio's median over the rounds' own ratios, with their range (min-max); a * marks a
// range with 1x inside it, a row where neither side leads. The SVG chart draws the medians,
// with the range as a whisker.
//
// The contender "sqlite" is the library on SQLite (modernc.org/sqlite, lease mode): a fresh
// database file per scenario in -sqlite-dir, opened with sqlbroker.Open on a sqlite: URL as a
// program would. Its figures are not compared with watermill-sql's (another database); row 7e
// compares its drain with the raw limit of its own statements, measured in the same run.
//
// The contenders "libpq" and "libpq-binary" are the lease mode through database/sql and
// lib/pq (sqlbroker.StdSQL), the second with lib/pq's binary_parameters=yes in its URL, which
// sends a statement with arguments in one round trip instead of two; "libpq-prepared" is
// sqlbroker.StdSQLPrepared, whose statements are prepared once per connection.
//
// The contenders "mysql" and "watermill-sql-mysql" run on the MySQL or MariaDB of -mysql-dsn
// (go-sql-driver/mysql): the library's lease mode (sqlbroker.MySQL), and watermill-sql with
// its default MySQL schema (a LONGBLOB payload) and offsets adapter. Run side by side, the
// first gets its ratio to the second's figures, not to watermill-sql's on PostgreSQL. The
// scenarios that read PostgreSQL's statistics (8, 9, and 10's claims rows) are n/a for them,
// as is order by key (13), which the library has on PostgreSQL and SQLite only; the hold (11)
// reads InnoDB's counters instead, and retention (12) the sizes of the tables' files. The
// server's CPU (row 1s) is measured on PostgreSQL only.
//
// It is a module of its own, so that watermill-sql is a dependency of the benchmark only and
// never of the library's users. From the repository's root:
//
//	go -C cmd/sqlbroker-bench run . -quick -svg ../../docs/bench.svg
//
// Scenarios (select with -scenarios, by number or name):
//
//  1. drain:     drain a published backlog through a message.Router, no-op handler
//  2. slow:      the same with a handler that sleeps 5 ms, 16 and 256 messages in flight,
//     measured over a fixed duration
//  3. instances: four Subscriber objects of one consumer group against one, 5 ms handler
//  4. latency:   from Publish returning to the handler starting, at a steady rate
//  5. publish:   batches of 100 per call, and one message per call from 16 goroutines
//  6. memory:    peak heap while a large backlog drains, and EXPLAIN of the claim at that size
//  7. raw:       the library's own insert and claim+ack statements in a tight loop, without
//     Watermill or the library's goroutines
//  8. idle:      transactions that idle subscriptions (one topic each, nothing published) cost
//     the database, through pgx and database/sql: per second from the first Subscribe,
//     what starting them cost beyond the steady rate, and the steady rate per subscription
//  9. many:      a thousand idle subscriptions in one process: connections, goroutines, heap
//     and transactions per second
//  10. group:    one consumer group with 1, 2, 4 and 8 consumers (a pool each), no-op
//     handler: messages and claims per second
//  11. hold:     messages offered at a steady rate to consumer groups of two subscribers with
//     Retention set, while a REPEATABLE READ transaction holds vacuum back: rates, lag and
//     index entries read per scan, second by second, and a summary of the hold (on MySQL,
//     a transaction WITH CONSISTENT SNAPSHOT holds InnoDB's purge back: rows read per
//     message handled and the history list length instead)
//  12. retention: -retention-n messages through one subscriber with Retention 1 s: the
//     sizes of the messages and claims tables second by second, at the peak and at the end
//     (on SQLite: the database file's, its WAL's and its pages in use; on MySQL: the tables'
//     .ibd files' and the messages table's rows)
//  13. ordered:  order by key: a backlog whose keys go round 64 (-ordered-keys) or 10,000
//     (-ordered-keys-many) keys, drained by one lease-mode subscriber with OrderByKey and
//     without it, with a no-op handler and with the 5 ms handler at 256 in flight; the
//     ordered rates beside the unordered ones of the same round, and the order violations
//     seen (a handling beside another of its key, or before the one before it returned)
//
// Scenarios 1-7 run by default; 8-13 when named. Scenarios 8 and 9 count each contender's
// transactions at the protocol, through a local proxy that sees every ReadyForQuery its
// connections receive (-idle-proxy); they also print, second by second, the transaction count
// of the whole database (pg_stat_database), which backends report up to 10 s late. With
// -idle-proxy=false their figures come from that count, less a baseline: point -url at a
// database nothing else uses. They do not apply to SQLite or MySQL.
//
// Every topic gets a unique name and every table created is dropped at the end.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"time"
)

type config struct {
	url           string
	poolSize      int
	payloadSize   int
	timeout       time.Duration
	svgPath       string
	cpuProfile    string
	scenarios     map[int]bool
	rounds        int
	contenders    []contender
	verbose       bool
	traceSQL      bool
	serverProfile bool
	sqliteDir     string // the run's directory of SQLite files, made inside -sqlite-dir
	mysqlDSN      string

	drainN          int           // 1
	drainInFlight   int           // 1
	slowBacklog     int           // 2, 3
	slowDuration    time.Duration // 2, 3
	slowHandler     time.Duration // 2, 3
	instInFlight    int           // 3
	latencyRate     int           // 4
	latencyDuration time.Duration // 4
	publishBatchN   int           // 5
	publishSingleN  int           // 5
	publishWorkers  int           // 5
	memoryN         int           // 6
	explain         bool          // 6
	memoryCap       time.Duration // 6
	rawN            int           // 7
	rawSingleN      int           // 7
	idleSubs        int           // 8
	idleLockSubs    int           // 8, 9
	idleWindow      time.Duration // 8, 9
	idleSettle      time.Duration // 8, 9
	idleProxy       bool          // 8, 9
	manySubs        int           // 9
	groupBacklog    int           // 10
	groupWindow     time.Duration // 10
	groupPool       int           // 10
	holdRate        int           // 11
	holdDuration    time.Duration // 11
	holdAt          time.Duration // 11
	holdFor         time.Duration // 11
	holdGroups      int           // 11
	holdRetention   time.Duration // 11
	holdKeys        int           // 11: order keys of the messages (0: none), the groups ordered by key
	retentionN      int           // 12
	retentionRate   int           // 12
	retention       time.Duration // 12
	retentionSettle time.Duration // 12
	retentionVacuum time.Duration // 12
	orderedN        int           // 13
	orderedKeysFew  int           // 13
	orderedKeysMany int           // 13
	orderedWindow   time.Duration // 13
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "sqlbroker-bench:", err)
		os.Exit(1)
	}
}

func parseFlags() (*config, error) {
	c := &config{}
	quick := flag.Bool("quick", false, "CI-sized run: small backlogs and short durations (explicit size flags still win)")
	var defaults []string
	for _, sc := range scenarios {
		if sc.byDefault {
			defaults = append(defaults, fmt.Sprint(sc.id))
		}
	}
	scen := flag.String("scenarios", strings.Join(defaults, ","), "scenarios to run, by number or name ("+scenarioList()+")")
	flag.IntVar(&c.rounds, "rounds", 5, "interleaved rounds: each scenario runs this many times for every contender, one contender after the other; the table shows each figure's median, and each ratio's median and range over the rounds")
	cont := flag.String("contenders", "lease,advisory,watermill-sql,sqlite", "contenders to run ("+contenderNameList()+")")
	flag.StringVar(&c.sqliteDir, "sqlite-dir", os.TempDir(), "the sqlite contender's database files go in a new directory inside this one (local disk: not a tmpfs, or commits cost nothing)")
	flag.StringVar(&c.url, "url", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL URL")
	flag.StringVar(&c.mysqlDSN, "mysql-dsn", "root@tcp(127.0.0.1:3306)/test?interpolateParams=true", "MySQL or MariaDB DSN of the mysql and watermill-sql-mysql contenders, in go-sql-driver/mysql's format (interpolateParams=true: a statement in one round trip instead of three)")
	flag.IntVar(&c.poolSize, "pool", 20, "connections in each contender's pool")
	flag.IntVar(&c.payloadSize, "payload", 256, "payload bytes per message")
	flag.DurationVar(&c.timeout, "timeout", 60*time.Minute, "bound on the whole run")
	flag.StringVar(&c.svgPath, "svg", "", "write an SVG bar chart of the results to this path")
	flag.StringVar(&c.cpuProfile, "cpuprofile", "", "write a CPU profile of each contender's timed drain (scenario 1) to this path, the contender's name inserted before the extension, of its four-subscriber run (scenario 3) with -instances4 after the name, and of the drains of scenario 13 with -unordered64, -ordered64 and -ordered10000 (the keys)")
	flag.BoolVar(&c.verbose, "v", false, "log progress to stderr")
	flag.BoolVar(&c.traceSQL, "trace-sql", false, "time every statement on the client side (pgx tracer) and print a table per contender and scenario; slows the run a little")
	flag.BoolVar(&c.serverProfile, "server-profile", false, "sample pg_stat_activity every 100ms during the drains (scenarios 1 and 6) and batched publishing (5a) and print where the server's time went: the contender's backends, autovacuum, background writes")
	drainN := flag.Int("n", 100_000, "scenario 1: backlog to drain")
	flag.IntVar(&c.drainInFlight, "drain-inflight", 0, "scenario 1: MaxInFlight of the library's subscriber (0: the library's default)")
	slowBacklog := flag.Int("slow-backlog", 100_000, "scenarios 2, 3: backlog published before the timed window")
	slowDuration := flag.Duration("slow-duration", 10*time.Second, "scenarios 2, 3: timed window")
	flag.DurationVar(&c.slowHandler, "slow-handler", 5*time.Millisecond, "scenarios 2, 3: handler sleep")
	flag.IntVar(&c.instInFlight, "instances-inflight", 16, "scenario 3: MaxInFlight of each library subscriber")
	flag.IntVar(&c.latencyRate, "latency-rate", 100, "scenario 4: messages per second")
	latencyDuration := flag.Duration("latency-duration", 20*time.Second, "scenario 4: how long to publish at that rate")
	publishBatchN := flag.Int("publish-n", 100_000, "scenario 5: messages published in batches of 100")
	publishSingleN := flag.Int("publish-single-n", 50_000, "scenario 5: messages published one per call")
	flag.IntVar(&c.publishWorkers, "publish-workers", 16, "scenario 5: goroutines publishing one message per call")
	memoryN := flag.Int("memory-n", 1_000_000, "scenario 6: backlog drained while memory is sampled")
	memoryCap := flag.Duration("memory-cap", 10*time.Minute, "scenario 6: bound on each contender's drain")
	flag.BoolVar(&c.explain, "explain", true, "scenario 6: log the plan of the library's claim statement at full size (auto_explain)")
	rawN := flag.Int("raw-n", 100_000, "scenario 7: messages inserted in batches of 100, then claimed and acked")
	rawSingleN := flag.Int("raw-single-n", 50_000, "scenario 7: messages inserted one per statement")
	flag.IntVar(&c.idleSubs, "idle-subs", 100, "scenario 8: idle subscriptions, one topic each")
	flag.IntVar(&c.idleLockSubs, "idle-lock-subs", 40, "scenarios 8, 9: idle subscriptions of the advisory mode (each holds a connection)")
	flag.DurationVar(&c.idleWindow, "idle-window", 10*time.Second, "scenarios 8, 9: window over which transactions are counted")
	flag.DurationVar(&c.idleSettle, "idle-settle", 15*time.Second, "scenarios 8, 9: after subscribing, how long the start lasts before the steady window (pg_stat_database: a backend reports the transactions it ran before going idle up to 10 s late)")
	flag.BoolVar(&c.idleProxy, "idle-proxy", true, "scenarios 8, 9: count each contender's transactions exactly, at the protocol, through a local proxy (plain TCP to the server, sslmode=disable); false: read pg_stat_database, the whole database's count, less a baseline")
	flag.IntVar(&c.manySubs, "many-subs", 1000, "scenario 9: idle subscriptions in one process, one topic each")
	flag.IntVar(&c.groupBacklog, "group-backlog", 300_000, "scenario 10: backlog published before each run")
	flag.DurationVar(&c.groupWindow, "group-window", 10*time.Second, "scenario 10: timed window")
	flag.IntVar(&c.groupPool, "group-pool", 4, "scenario 10: connections in each consumer's pool")
	holdRate := flag.Int("hold-rate", 10_000, "scenario 11: messages per second offered (published in paced batches)")
	holdDuration := flag.Duration("hold-duration", 150*time.Second, "scenario 11: how long to publish and consume")
	holdAt := flag.Duration("hold-at", 10*time.Second, "scenario 11: when the reader that holds vacuum back opens its transaction")
	holdFor := flag.Duration("hold-for", 120*time.Second, "scenario 11: how long the reader keeps it open")
	flag.IntVar(&c.holdGroups, "hold-groups", 1, "scenario 11: consumer groups, each of two subscribers")
	flag.DurationVar(&c.holdRetention, "hold-retention", 10*time.Second, "scenario 11: the subscribers' Retention (0: none)")
	flag.IntVar(&c.holdKeys, "hold-keys", 0, "scenario 11: order keys the messages go round, the groups ordered by key (0: no keys, unordered)")
	retentionN := flag.Int("retention-n", 1_000_000, "scenario 12: messages published")
	flag.IntVar(&c.retentionRate, "retention-rate", 10_000, "scenario 12: messages per second offered")
	flag.DurationVar(&c.retention, "retention", time.Second, "scenario 12: the subscriber's Retention")
	flag.DurationVar(&c.retentionSettle, "retention-settle", 15*time.Second, "scenario 12: how long to watch the sizes after the last message is handled")
	flag.DurationVar(&c.retentionVacuum, "retention-vacuum", 0, "scenario 12: VACUUM the claims and groups tables this often, for a server whose autovacuum is off (0: leave it to autovacuum)")
	orderedN := flag.Int("ordered-n", 100_000, "scenario 13: backlog of keyed messages published before each run")
	flag.IntVar(&c.orderedKeysFew, "ordered-keys", 64, "scenario 13: keys of the runs with few keys")
	flag.IntVar(&c.orderedKeysMany, "ordered-keys-many", 10_000, "scenario 13: keys of the runs with many keys")
	orderedWindow := flag.Duration("ordered-window", 30*time.Second, "scenario 13: bound on each run (the rate is over the run)")
	flag.Parse()

	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	// -quick shrinks every size and duration whose flag was not given explicitly.
	pickInt := func(name string, v *int, q int) int {
		if *quick && !set[name] {
			return q
		}
		return *v
	}
	pickDur := func(name string, v *time.Duration, q time.Duration) time.Duration {
		if *quick && !set[name] {
			return q
		}
		return *v
	}
	c.drainN = pickInt("n", drainN, 10_000)
	c.slowBacklog = pickInt("slow-backlog", slowBacklog, 20_000)
	c.slowDuration = pickDur("slow-duration", slowDuration, 3*time.Second)
	c.latencyDuration = pickDur("latency-duration", latencyDuration, 5*time.Second)
	c.publishBatchN = pickInt("publish-n", publishBatchN, 20_000)
	c.publishSingleN = pickInt("publish-single-n", publishSingleN, 5_000)
	c.memoryN = pickInt("memory-n", memoryN, 100_000)
	c.memoryCap = pickDur("memory-cap", memoryCap, 2*time.Minute)
	c.rawN = pickInt("raw-n", rawN, 10_000)
	c.rawSingleN = pickInt("raw-single-n", rawSingleN, 5_000)
	c.holdRate = pickInt("hold-rate", holdRate, 1000)
	c.holdDuration = pickDur("hold-duration", holdDuration, 30*time.Second)
	c.holdAt = pickDur("hold-at", holdAt, 5*time.Second)
	c.holdFor = pickDur("hold-for", holdFor, 15*time.Second)
	c.retentionN = pickInt("retention-n", retentionN, 100_000)
	c.orderedN = pickInt("ordered-n", orderedN, 20_000)
	c.orderedWindow = pickDur("ordered-window", orderedWindow, 10*time.Second)

	c.scenarios = map[int]bool{}
	for _, s := range strings.Split(*scen, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		sc, ok := scenarioBy(s)
		if !ok {
			return nil, fmt.Errorf("-scenarios: %q is not a scenario (%s)", s, scenarioList())
		}
		c.scenarios[sc.id] = true
	}
	for _, s := range strings.Split(*cont, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		k, ok := contenderByName(s)
		if !ok {
			return nil, fmt.Errorf("-contenders: %q is not one of %s", s, contenderNameList())
		}
		c.contenders = append(c.contenders, k)
	}
	positive := map[string]int{
		"rounds": c.rounds, "pool": c.poolSize, "payload": c.payloadSize, "n": c.drainN, "slow-backlog": c.slowBacklog,
		"instances-inflight": c.instInFlight, "latency-rate": c.latencyRate, "publish-n": c.publishBatchN,
		"publish-single-n": c.publishSingleN, "publish-workers": c.publishWorkers, "memory-n": c.memoryN,
		"raw-n": c.rawN, "raw-single-n": c.rawSingleN,
		"idle-subs": c.idleSubs, "idle-lock-subs": c.idleLockSubs, "many-subs": c.manySubs,
		"group-backlog": c.groupBacklog, "group-pool": c.groupPool,
		"hold-rate": c.holdRate, "hold-groups": c.holdGroups,
		"ordered-n": c.orderedN, "ordered-keys": c.orderedKeysFew, "ordered-keys-many": c.orderedKeysMany,
	}
	for name, v := range positive {
		if v <= 0 {
			return nil, fmt.Errorf("-%s (%d) must be positive", name, v)
		}
	}
	for name, v := range map[string]time.Duration{"timeout": c.timeout, "slow-duration": c.slowDuration, "latency-duration": c.latencyDuration, "memory-cap": c.memoryCap,
		"idle-window": c.idleWindow, "group-window": c.groupWindow, "hold-duration": c.holdDuration, "hold-for": c.holdFor,
		"ordered-window": c.orderedWindow} {
		if v <= 0 {
			return nil, fmt.Errorf("-%s (%s) must be positive", name, v)
		}
	}
	for name, v := range map[string]time.Duration{"hold-at": c.holdAt, "hold-retention": c.holdRetention} {
		if v < 0 {
			return nil, fmt.Errorf("-%s (%s) must not be negative", name, v)
		}
	}
	if c.holdKeys < 0 {
		return nil, fmt.Errorf("-hold-keys (%d) must not be negative", c.holdKeys)
	}
	if c.holdAt+c.holdFor > c.holdDuration {
		return nil, fmt.Errorf("-hold-at (%s) + -hold-for (%s) must not exceed -hold-duration (%s)", c.holdAt, c.holdFor, c.holdDuration)
	}
	return c, nil
}

func run() error {
	cfg, err := parseFlags()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeoutCause(context.Background(), cfg.timeout,
		fmt.Errorf("the run took longer than -timeout %s", cfg.timeout))
	defer cancel()
	ctx, stop := signal.NotifyContext(ctx, os.Interrupt)
	defer stop()

	b, err := newBench(ctx, cfg)
	if err != nil {
		return err
	}
	defer b.cleanup()

	b.describe()
	runErr := b.runScenarios(ctx)
	b.results.derive(cfg.contenders)
	if runErr != nil && errors.Is(runErr, context.DeadlineExceeded) {
		runErr = fmt.Errorf("%w (%v)", runErr, context.Cause(ctx))
	}

	fmt.Println(b.results.markdown(cfg.contenders))
	for _, n := range b.results.noteLines(cfg.rounds) {
		fmt.Println("- " + n)
	}
	if len(b.plans) > 0 {
		fmt.Println()
		for _, p := range b.plans {
			fmt.Println(p)
		}
	}
	for _, t := range b.traces {
		fmt.Println()
		fmt.Println(t)
	}
	if cfg.svgPath != "" {
		if err := os.WriteFile(cfg.svgPath, []byte(b.results.svg(cfg.contenders, cfg.rounds)), 0o644); err != nil {
			return errors.Join(runErr, fmt.Errorf("-svg: %w", err))
		}
		fmt.Fprintln(os.Stderr, "chart written to", cfg.svgPath)
	}
	return runErr
}
