package main

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker"
)

// Scenario 13: order by key. One backlog of messages whose keys go round the key set (message
// i has key i mod keys and is the (i div keys)th of its key), drained by one subscriber of the
// library's lease mode with OrderByKey and without it, and the same with a 5 ms handler and 256
// in flight: each ordered figure beside the unordered one of the same round. Every run counts
// order violations: a handling that starts beside another of its key, or before the one before
// it of its key has returned.
//
// A run lasts until its backlog is settled or -ordered-window has passed, whichever comes
// first; the rate is over that time.

// metaSeq is the position of a message among those of its key, set by the benchmark.
const metaSeq = "bench_seq"

func orderedRows(c *config) []rowDef {
	few, many := c.orderedKeysFew, c.orderedKeysMany
	h := c.slowHandler.String()
	return []rowDef{
		{"13a", 13, fmt.Sprintf("order by key: drain %s, keys set, unordered", short(c.orderedN)), "msg/s", false},
		{"13b", 13, fmt.Sprintf("  ordered, %d keys", few), "msg/s", false},
		{"13c", 13, fmt.Sprintf("  ordered, %d keys / unordered", few), "x", false},
		{"13d", 13, fmt.Sprintf("  ordered, %d keys", many), "msg/s", false},
		{"13e", 13, fmt.Sprintf("  ordered, %d keys / unordered", many), "x", false},
		{"13f", 13, fmt.Sprintf("order by key: %s handler, 256 in flight, unordered", h), "msg/s", false},
		{"13g", 13, fmt.Sprintf("  ordered, %d keys", few), "msg/s", false},
		{"13h", 13, fmt.Sprintf("  ordered, %d keys / the keys' ceiling (%d keys, one %s handling at a time each)", few, few, h), "x", false},
		{"13i", 13, fmt.Sprintf("  ordered, %d keys", many), "msg/s", false},
		{"13j", 13, fmt.Sprintf("  ordered, %d keys / unordered", many), "x", false},
		{"13k", 13, "  order violations, every ordered run", "", true},
	}
}

func scenarioOrdered(ctx context.Context, b *bench, c contender) error {
	switch c {
	case watermillSQL, watermillSQLMySQL:
		return fmt.Errorf("%w: watermill-sql has no order per key (one message per consumer group at a time)", errNA)
	case advisory:
		return fmt.Errorf("%w: the advisory mode refuses OrderByKey", errNA)
	case mysqlLease:
		return fmt.Errorf("%w: the library has no order by key on MySQL", errNA)
	}
	cfg := b.cfg
	type run struct {
		keys     int
		ordered  bool
		inFlight int
		sleep    time.Duration
	}
	violations := 0
	measure := func(r run) (float64, error) {
		v, bad, err := b.orderedRun(ctx, c, r.keys, r.ordered, r.inFlight, r.sleep)
		violations += bad
		return v, err
	}
	set := func(id string, v float64) { b.results.set(id, c, v) }

	// Drain, no-op handler, the library's default MaxInFlight.
	unordered, err := measure(run{keys: cfg.orderedKeysFew})
	if err != nil {
		return err
	}
	set("13a", unordered)
	for _, x := range []struct {
		keys       int
		rate, frac string
	}{{cfg.orderedKeysFew, "13b", "13c"}, {cfg.orderedKeysMany, "13d", "13e"}} {
		v, err := measure(run{keys: x.keys, ordered: true})
		if err != nil {
			return err
		}
		set(x.rate, v)
		set(x.frac, v/unordered)
	}

	// The slow handler, 256 in flight.
	slowUnordered, err := measure(run{keys: cfg.orderedKeysFew, inFlight: 256, sleep: cfg.slowHandler})
	if err != nil {
		return err
	}
	set("13f", slowUnordered)
	few, err := measure(run{keys: cfg.orderedKeysFew, ordered: true, inFlight: 256, sleep: cfg.slowHandler})
	if err != nil {
		return err
	}
	set("13g", few)
	ceiling := float64(min(cfg.orderedKeysFew, 256)) / cfg.slowHandler.Seconds()
	set("13h", few/ceiling)
	many, err := measure(run{keys: cfg.orderedKeysMany, ordered: true, inFlight: 256, sleep: cfg.slowHandler})
	if err != nil {
		return err
	}
	set("13i", many)
	set("13j", many/slowUnordered)
	set("13k", float64(violations))
	return nil
}

// orderedRun publishes the keyed backlog to a fresh topic and drains it with one subscriber
// (OrderByKey as asked) until it is settled or the window has passed; it returns the rate and
// the order violations it saw.
func (b *bench) orderedRun(ctx context.Context, c contender, keys int, ordered bool, inFlight int, sleep time.Duration) (float64, int, error) {
	n := b.cfg.orderedN
	e, topic, err := b.prepareWith(ctx, c, "ordered", n, func(i int) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), b.payload)
		m.Metadata.Set(sqlbroker.MetadataOrderKey, "k"+strconv.Itoa(i%keys))
		m.Metadata.Set(metaSeq, strconv.Itoa(i/keys)) // published in order within its key
		return m
	})
	if err != nil {
		return 0, 0, err
	}
	defer e.close()
	defer b.dropTopic(c, topic)
	e.orderByKey = ordered
	check := newOrderCheck(keys)
	what := "unordered"
	if ordered {
		what = "ordered"
	}
	r := routerRun{
		instances: 1, maxInFlight: inFlight, sleep: sleep, stopAt: n, window: b.cfg.orderedWindow, drain: true,
		around: check.begin,
	}
	if sleep == 0 { // the drains: with -cpuprofile, a profile each
		run := fmt.Sprintf("%s%d", what, keys)
		r = b.profiled(r, profilePath(b.cfg.cpuProfile, c, run), fmt.Sprintf("%s, scenario 13, %s", c, run))
	}
	res, err := b.runRouter(ctx, e, topic, r)
	if err != nil {
		return 0, 0, err
	}
	bad := 0 // an unordered run breaks order by design
	if ordered {
		bad = check.violations()
	}
	cpu := fmt.Sprintf("client CPU %.1f µs a message", float64(res.cpu.client.Microseconds())/float64(max(res.handled, 1)))
	if res.cpu.serverKnown {
		cpu += fmt.Sprintf(", server %.1f", float64(res.cpu.server.Microseconds())/float64(max(res.handled, 1)))
	}
	b.logf("  %s: %s, %d keys, MaxInFlight %d, handler %s: %d handled in %s, %d violations, at most %d in handlers at once; %s",
		c, what, keys, inFlight, sleep, res.handled, res.elapsed.Round(time.Millisecond), bad, check.peak, cpu)
	return rate(res.handled, res.elapsed), bad, nil
}

// orderCheck watches the handlings of one run: per key, the position of the last handling
// that returned and whether one is running.
type orderCheck struct {
	mu      sync.Mutex
	next    map[string]int // the position the next handling of a key must have
	running map[string]bool
	bad     int
	inWork  int
	peak    int
}

func newOrderCheck(keys int) *orderCheck {
	return &orderCheck{next: make(map[string]int, keys), running: make(map[string]bool, keys)}
}

// begin records a handling's start, and returns what records its end. A handling that starts
// beside another of its key, or whose position is past the next one of its key (one before it
// has not returned yet), is a violation; one before it (a redelivery) is not, and none happens
// in a run without faults.
func (o *orderCheck) begin(m *message.Message) func() {
	key := m.Metadata.Get(sqlbroker.MetadataOrderKey)
	seq, _ := strconv.Atoi(m.Metadata.Get(metaSeq))
	o.mu.Lock()
	if o.running[key] || seq > o.next[key] {
		o.bad++
	}
	o.running[key] = true
	o.inWork++
	o.peak = max(o.peak, o.inWork)
	o.mu.Unlock()
	return func() {
		o.mu.Lock()
		o.running[key] = false
		o.inWork--
		if seq >= o.next[key] {
			o.next[key] = seq + 1
		}
		o.mu.Unlock()
	}
}

func (o *orderCheck) violations() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.bad
}
