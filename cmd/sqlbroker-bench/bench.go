package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// bench holds what the scenarios share: the configuration, a small admin pool (for
// pg_stat_activity, plans and clean-up; never used by a contender), the results and the topics
// to drop.
type bench struct {
	cfg     *config
	admin   *pgxpool.Pool
	runID   string
	payload []byte
	results *results

	mu     sync.Mutex
	topics map[contender][]string
	plans  []string
	traces []string

	base     float64 // scenarios 8, 9: the database's transactions per second with nothing subscribed
	baseDone bool

	round int // the round running now, from 0 (runScenarios)
}

func newBench(ctx context.Context, cfg *config) (*bench, error) {
	pc, err := pgxpool.ParseConfig(cfg.url)
	if err != nil {
		return nil, fmt.Errorf("-url: %w", err)
	}
	pc.MaxConns = 2
	pc.ConnConfig.RuntimeParams["application_name"] = "sqlbroker-bench-admin"
	admin, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := admin.Ping(pctx); err != nil {
		admin.Close()
		return nil, fmt.Errorf("connect to %s: %w", redact(cfg.url), err)
	}
	for _, c := range cfg.contenders {
		if c.onMySQL() {
			if err := pingMySQL(ctx, cfg.mysqlDSN); err != nil {
				admin.Close()
				return nil, err
			}
			break
		}
	}
	id := make([]byte, 3)
	_, _ = rand.Read(id)
	for _, c := range cfg.contenders {
		if c.onSQLite() {
			dir, err := os.MkdirTemp(cfg.sqliteDir, "sqlbroker-bench-")
			if err != nil {
				admin.Close()
				return nil, fmt.Errorf("-sqlite-dir: %w", err)
			}
			if cfg.sqliteDir, err = filepath.Abs(dir); err != nil {
				admin.Close()
				return nil, fmt.Errorf("-sqlite-dir: %w", err)
			}
			break
		}
	}
	return &bench{
		cfg:     cfg,
		admin:   admin,
		runID:   hex.EncodeToString(id),
		payload: newPayload(cfg.payloadSize),
		results: &results{defs: rowDefs(cfg)},
		topics:  map[contender][]string{},
	}, nil
}

// topic returns a new unique topic for c and remembers it for the clean-up.
func (b *bench) topic(c contender, scenario string) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	t := fmt.Sprintf("bench_%s_%s_%d_%s", b.runID, scenario, len(b.topics[c]), strings.ReplaceAll(c.String(), "-", "_"))
	b.topics[c] = append(b.topics[c], t)
	return t
}

// dropTopic drops one topic's tables at once, so that a large backlog does not stay on the
// disk for the rest of the run.
func (b *bench) dropTopic(c contender, topic string) {
	if err := dropTables(b.cfg, map[contender][]string{c: {topic}}); err != nil {
		b.logf("%v", err)
	}
}

func (b *bench) cleanup() {
	b.mu.Lock()
	topics := b.topics
	b.mu.Unlock()
	if err := dropTables(b.cfg, topics); err != nil {
		fmt.Fprintln(os.Stderr, "sqlbroker-bench: clean-up:", err)
	}
	b.admin.Close()
	if b.usesSQLite() {
		if err := os.RemoveAll(b.cfg.sqliteDir); err != nil {
			fmt.Fprintln(os.Stderr, "sqlbroker-bench: clean-up:", err)
		}
	}
}

func (b *bench) usesSQLite() bool {
	for _, c := range b.cfg.contenders {
		if c.onSQLite() {
			return true
		}
	}
	return false
}

func (b *bench) usesMySQL() bool {
	for _, c := range b.cfg.contenders {
		if c.onMySQL() {
			return true
		}
	}
	return false
}

// addTrace keeps a table (SQL timings, a server profile) to print after the results.
func (b *bench) addTrace(t string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.traces = append(b.traces, t)
}

func (b *bench) logf(format string, args ...any) {
	if b.cfg.verbose {
		fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05 ")+format+"\n", args...)
	}
}

// describe prints the machine and the sizes, so that the output stands on its own.
func (b *bench) describe() {
	var pgVersion string
	_ = b.admin.QueryRow(context.Background(), "SHOW server_version").Scan(&pgVersion)
	host, _ := os.Hostname()
	fmt.Printf("# sqlbroker-bench\n\n")
	fmt.Printf("- date: %s\n", time.Now().UTC().Format(time.RFC3339))
	fmt.Printf("- host: %s, %s/%s, %d CPUs (GOMAXPROCS %d), %s\n", host, runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0), memTotal())
	fmt.Printf("- PostgreSQL %s at %s; Go %s\n", pgVersion, redact(b.cfg.url), runtime.Version())
	if b.usesSQLite() {
		fmt.Printf("- %s\n", sqliteDescription(b.cfg.sqliteDir))
	}
	if b.usesMySQL() {
		fmt.Printf("- %s\n", mysqlDescription(b.cfg.mysqlDSN))
	}
	fmt.Printf("- command: %s\n", strings.Join(os.Args, " "))
	c := b.cfg
	fmt.Printf("- rounds: %d, interleaved: each scenario runs once for every contender (%s, in this order) in each round; a figure is the median over the rounds, a ratio the median of the rounds' ratios with their range (min-max)\n",
		c.rounds, contenderList(c.contenders))
	fmt.Printf("- sizes: payload %d B, pool %d conns per contender, drain %d, slow backlog %d over %s (handler %s), "+
		"instances MaxInFlight %d, latency %d msg/s for %s, publish %d batched + %d single (%d goroutines), memory %d (cap %s), raw %d + %d single\n",
		c.payloadSize, c.poolSize, c.drainN, c.slowBacklog, c.slowDuration, c.slowHandler, c.instInFlight,
		c.latencyRate, c.latencyDuration, c.publishBatchN, c.publishSingleN, c.publishWorkers, c.memoryN, c.memoryCap, c.rawN, c.rawSingleN)
	if c.scenarios[11] {
		fmt.Printf("- hold: %d msg/s offered for %s, %d consumer group(s) of %d subscribers, Retention %s, vacuum held back from %s for %s\n",
			c.holdRate, c.holdDuration, c.holdGroups, holdSubs, c.holdRetention, c.holdAt, c.holdFor)
		if c.holdKeys > 0 {
			fmt.Printf("- hold: messages keyed round %d keys, the groups ordered by key\n", c.holdKeys)
		}
	}
	if c.scenarios[13] {
		fmt.Printf("- ordered: %d keyed messages a run, %d and %d keys, each run bounded by %s\n",
			c.orderedN, c.orderedKeysFew, c.orderedKeysMany, c.orderedWindow)
	}
	fmt.Println()
}

func memTotal() string {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return "memory unknown"
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "MemTotal:") {
			var kb int64
			fmt.Sscanf(strings.TrimSpace(strings.TrimPrefix(l, "MemTotal:")), "%d", &kb)
			return fmt.Sprintf("%.1f GiB RAM", float64(kb)/(1<<20))
		}
	}
	return "memory unknown"
}

type scenarioFunc func(ctx context.Context, b *bench, c contender) error

// scenario is one scenario of the run: its number and name (either selects it with
// -scenarios), whether it runs without being named, and what it runs for one contender.
type scenario struct {
	id        int
	name      string
	byDefault bool
	run       scenarioFunc
}

// scenarios is every scenario, in the order they run.
var scenarios = []scenario{
	{1, "drain", true, scenarioDrain},
	{2, "slow", true, scenarioSlow},
	{3, "instances", true, scenarioInstances},
	{4, "latency", true, scenarioLatency},
	{5, "publish", true, scenarioPublish},
	{6, "memory", true, scenarioMemory},
	{7, "raw", true, scenarioRaw},
	{8, "idle", false, scenarioIdle},
	{9, "many", false, scenarioMany},
	{10, "group", false, scenarioGroup},
	{11, "hold", false, scenarioHold},
	{12, "retention", false, scenarioRetention},
	{13, "ordered", false, scenarioOrdered},
}

// scenarioBy finds a scenario by its number or its name.
func scenarioBy(s string) (scenario, bool) {
	for _, sc := range scenarios {
		if s == sc.name || s == fmt.Sprint(sc.id) {
			return sc, true
		}
	}
	return scenario{}, false
}

// scenarioList is "1 drain, 2 slow, ...", for flag help and errors.
func scenarioList() string {
	parts := make([]string, len(scenarios))
	for i, sc := range scenarios {
		parts[i] = fmt.Sprintf("%d %s", sc.id, sc.name)
	}
	return strings.Join(parts, ", ")
}

// runScenarios runs every selected scenario in -rounds interleaved rounds: a round runs the
// scenario once for every contender, one after the other (A, B, A, B, ...), so that what the
// machine does meanwhile weighs on every contender alike, and the ratios of a round compare
// runs minutes apart at most. A contender's failure is recorded in the table and the run goes
// on; only the run's own deadline stops it.
func (b *bench) runScenarios(ctx context.Context) error {
	var errs []error
	for _, sc := range scenarios {
		if !b.cfg.scenarios[sc.id] {
			continue
		}
		for round := range b.cfg.rounds {
			b.round = round
			b.results.startRound(round)
			for _, c := range b.cfg.contenders {
				if err := ctx.Err(); err != nil {
					return errors.Join(append(errs, context.Cause(ctx))...)
				}
				what := fmt.Sprintf("scenario %d, round %d, %s", sc.id, round+1, c)
				b.logf("%s: start", what)
				start := time.Now()
				err := sc.run(ctx, b, c)
				switch {
				case err == nil:
					b.logf("%s: done in %s", what, time.Since(start).Round(time.Millisecond))
				case errors.Is(err, errNA):
					b.logf("%s: n/a: %v", what, err)
					b.results.markScenario(sc.id, c, "n/a")
					b.results.note(fmt.Sprintf("%s, scenario %d: n/a: %v", c, sc.id, err))
				default:
					b.logf("%s: failed: %v", what, err)
					b.results.failScenario(sc.id, c, err)
					errs = append(errs, fmt.Errorf("%s: %w", what, err))
				}
				if b.cfg.traceSQL {
					if t := sqlTracer.report(c.appName(), what, time.Since(start)); t != "" {
						b.addTrace(t)
					}
				}
			}
		}
	}
	return errors.Join(errs...)
}

// roundTitle is title with the round running now, when there are several.
func (b *bench) roundTitle(title string) string {
	if b.cfg.rounds > 1 {
		return fmt.Sprintf("%s, round %d", title, b.round+1)
	}
	return title
}

// firstRound reports whether the round running now is the first: what is printed once per
// scenario and contender (a claim's plan, a CPU profile) comes from it.
func (b *bench) firstRound() bool { return b.round == 0 }

func contenderList(cs []contender) string {
	names := make([]string, len(cs))
	for i, c := range cs {
		names[i] = c.String()
	}
	return strings.Join(names, ", ")
}
