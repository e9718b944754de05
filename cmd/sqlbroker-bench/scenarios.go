package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// backlogBatch is the Publish call size used to fill backlogs before timing starts.
const backlogBatch = 1000

// prepare opens c's pool, checks that c can subscribe (n/a otherwise) and creates a fresh
// topic with a backlog of n messages.
func (b *bench) prepare(ctx context.Context, c contender, scenario string, n int) (*env, string, error) {
	return b.prepareWith(ctx, c, scenario, n, func(int) *message.Message {
		return message.NewMessage(watermill.NewUUID(), b.payload)
	})
}

// prepareWith is prepare with a backlog whose ith message newMsg makes.
func (b *bench) prepareWith(ctx context.Context, c contender, scenario string, n int, newMsg func(i int) *message.Message) (*env, string, error) {
	e, err := openEnv(ctx, b.cfg, c)
	if err != nil {
		return nil, "", err
	}
	if err := e.checkSubscriber(); err != nil {
		e.close()
		return nil, "", err
	}
	topic := b.topic(c, scenario)
	if err := e.createTopic(ctx, topic); err != nil {
		e.close()
		return nil, "", fmt.Errorf("create tables: %w", err)
	}
	if n > 0 {
		pub, err := e.publisher()
		if err != nil {
			e.close()
			return nil, "", err
		}
		start := time.Now()
		err = publishBacklog(ctx, pub, topic, n, backlogBatch, newMsg)
		_ = pub.Close()
		if err != nil {
			e.close()
			return nil, "", err
		}
		b.logf("  %s: backlog of %d published in %s", c, n, time.Since(start).Round(time.Millisecond))
	}
	return e, topic, nil
}

// routerRun is one timed run of a message.Router over a topic.
type routerRun struct {
	instances   int           // Subscriber objects of the one consumer group, one handler each
	maxInFlight int           // library only; 0 = its default
	sleep       time.Duration // handler work
	stopAt      int           // stop when this many messages were handled (and, with drain, settled)
	window      time.Duration // stop after this long; 0 = no window
	drain       bool          // wait until the database shows every message settled
	onStart     func()        // called right before the Router runs
	onStop      func()        // called when the stop condition is met, before the Router closes
	profile     string        // with -server-profile: the title of the server profile of this run
	// around, when set, is called as each handling starts; what it returns, as it ends.
	around func(*message.Message) func()
}

type routerResult struct {
	handled int64
	elapsed time.Duration
	cpu     cpuUse
	drained bool // stopAt was reached before the window ended
}

// runRouter runs a Router with r.instances subscribers of the bench group on topic and times it
// from Run to the stop condition.
func (b *bench) runRouter(ctx context.Context, e *env, topic string, r routerRun) (routerResult, error) {
	var res routerResult
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return res, err
	}
	var subs []message.Subscriber
	defer func() {
		for _, s := range subs {
			_ = s.Close()
		}
	}()
	var handled atomic.Int64
	reached := make(chan struct{})
	var once sync.Once
	for i := range r.instances {
		s, err := e.subscriber(r.maxInFlight)
		if err != nil {
			return res, err
		}
		subs = append(subs, s)
		router.AddConsumerHandler(fmt.Sprintf("h%d", i), topic, s, func(m *message.Message) error {
			var done func()
			if r.around != nil {
				done = r.around(m)
			}
			if r.sleep > 0 {
				time.Sleep(r.sleep)
			}
			if done != nil {
				done()
			}
			if handled.Add(1) == int64(r.stopAt) {
				once.Do(func() { close(reached) })
			}
			return nil
		})
	}

	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	before := snapCPU(ctx, b.admin, e.c.appName())
	if r.onStart != nil {
		r.onStart()
	}
	var prof *serverProfile
	if b.cfg.serverProfile && r.profile != "" && e.c.onPostgres() {
		prof = startServerProfile(ctx, b.admin, e.c.appName(), 100*time.Millisecond)
	}
	start := time.Now()
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(runCtx) }()

	var window <-chan time.Time
	if r.window > 0 {
		t := time.NewTimer(r.window)
		defer t.Stop()
		window = t.C
	}
	var waitErr error
	select {
	case <-reached:
		res.drained = true
		if r.drain {
			waitErr = e.waitDrained(ctx, topic, 5*time.Minute)
		}
	case <-window:
	case err := <-runErr:
		waitErr = fmt.Errorf("router stopped early: %v", err)
		runErr <- err
	case <-ctx.Done():
		waitErr = context.Cause(ctx)
	}
	res.elapsed = time.Since(start)
	res.handled = handled.Load()
	if r.onStop != nil {
		r.onStop()
	}
	res.cpu = cpuBetween(before, snapCPU(ctx, b.admin, e.c.appName()))
	if prof != nil {
		b.addTrace(prof.finish(ctx, b.roundTitle(r.profile), res.handled, res.elapsed))
	}

	_ = router.Close()
	select {
	case err := <-runErr:
		if err != nil && waitErr == nil {
			waitErr = fmt.Errorf("router: %w", err)
		}
	case <-time.After(30 * time.Second):
		waitErr = errors.Join(waitErr, errors.New("router did not stop within 30s of Close"))
	}
	return res, waitErr
}

// profiled makes r write a CPU profile of its timed part to path, with -cpuprofile, in the
// first round.
func (b *bench) profiled(r routerRun, path, what string) routerRun {
	if b.cfg.cpuProfile == "" || !b.firstRound() {
		return r
	}
	var stop func() error
	r.onStart = func() { stop = startProfile(path, b) }
	r.onStop = func() {
		if stop != nil {
			if err := stop(); err != nil {
				b.results.note(fmt.Sprintf("%s: CPU profile: %v", what, err))
			}
		}
	}
	return r
}

func rate(n int64, d time.Duration) float64 { return float64(n) / d.Seconds() }

// Scenario 1: drain a backlog through a Router, no-op handler; timed from Run until the
// database shows every message settled.
func scenarioDrain(ctx context.Context, b *bench, c contender) error {
	e, topic, err := b.prepare(ctx, c, "drain", b.cfg.drainN)
	if err != nil {
		return err
	}
	defer e.close()
	defer b.dropTopic(c, topic)
	if b.cfg.explain && b.firstRound() && c.isLibrary() && c.onPostgres() {
		b.explainClaim(ctx, topic, fmt.Sprintf("scenario 1, %s, %d rows, group at the head", c, b.cfg.drainN), false)
	}
	if b.cfg.traceSQL {
		sqlTracer.reset(c.appName())
	}
	res, err := b.runRouter(ctx, e, topic, b.profiled(routerRun{instances: 1, stopAt: b.cfg.drainN, drain: true, maxInFlight: b.cfg.drainInFlight,
		profile: fmt.Sprintf("%s, scenario 1, %d messages", c, b.cfg.drainN),
	}, profilePath(b.cfg.cpuProfile, c, ""), fmt.Sprintf("%s, scenario 1", c)))
	if err != nil {
		return err
	}
	b.results.set("1", c, rate(res.handled, res.elapsed))
	b.results.set("1c", c, float64(res.cpu.client.Microseconds())/float64(res.handled))
	if res.cpu.serverKnown {
		b.results.set("1s", c, float64(res.cpu.server.Microseconds())/float64(res.handled))
	}
	return nil
}

// Scenario 2: a handler that sleeps, with 16 and 256 messages in flight, measured over a fixed
// window (watermill-sql, one in flight, would take hours on a fixed count). watermill-sql has
// no in-flight setting: it runs once and its figure serves both rows.
func scenarioSlow(ctx context.Context, b *bench, c contender) error {
	for _, x := range []struct {
		id       string
		inFlight int
	}{{"2a", 16}, {"2b", 256}} {
		if c.isWatermillSQL() && x.id == "2b" {
			if v, ok := b.results.get("2a", c); ok {
				b.results.set("2b", c, v)
			}
			continue
		}
		v, err := b.windowRun(ctx, c, "slow", routerRun{instances: 1, maxInFlight: x.inFlight, sleep: b.cfg.slowHandler})
		if err != nil {
			return err
		}
		b.results.set(x.id, c, v)
	}
	if c.isWatermillSQL() {
		b.results.note(fmt.Sprintf("%s, scenario 2: one run serves rows 2a and 2b (it has no in-flight setting: one message per consumer group at a time)", c))
	}
	return nil
}

// windowRun publishes the slow backlog to a fresh topic and measures msg/s over the window, or
// until the backlog is gone.
func (b *bench) windowRun(ctx context.Context, c contender, scenario string, r routerRun) (float64, error) {
	e, topic, err := b.prepare(ctx, c, scenario, b.cfg.slowBacklog)
	if err != nil {
		return 0, err
	}
	defer e.close()
	defer b.dropTopic(c, topic)
	r.stopAt = b.cfg.slowBacklog
	r.window = b.cfg.slowDuration
	res, err := b.runRouter(ctx, e, topic, r)
	if err != nil {
		return 0, err
	}
	if res.drained {
		b.results.note(fmt.Sprintf("%s, scenario %s (%d subscribers, MaxInFlight %d): the backlog of %d ran out after %s, before the %s window; the rate is over that time",
			c, scenario, r.instances, r.maxInFlight, b.cfg.slowBacklog, res.elapsed.Round(time.Millisecond), b.cfg.slowDuration))
	}
	return rate(res.handled, res.elapsed), nil
}

// Scenario 3: four Subscriber objects of one consumer group against one, with the slow handler.
func scenarioInstances(ctx context.Context, b *bench, c contender) error {
	inFlight := 0
	if c.isLibrary() {
		inFlight = b.cfg.instInFlight
	}
	one, err := b.windowRun(ctx, c, "inst1", routerRun{instances: 1, maxInFlight: inFlight, sleep: b.cfg.slowHandler})
	if err != nil {
		return err
	}
	b.results.set("3a", c, one)
	four, err := b.windowRun(ctx, c, "inst4", b.profiled(routerRun{instances: 4, maxInFlight: inFlight, sleep: b.cfg.slowHandler},
		profilePath(b.cfg.cpuProfile, c, "instances4"), fmt.Sprintf("%s, scenario 3", c)))
	if err != nil {
		return err
	}
	b.results.set("3b", c, four)
	b.results.set("3c", c, four/one)
	return nil
}

// Scenario 4: latency from Publish returning to the handler starting, at a steady rate, to an
// idle subscriber. "In process": through the contender's Publisher in this process (the
// library wakes its subscriptions in the same process at once). "Elsewhere": the library's
// insert statement run without its Publisher, as a publisher in another process would be seen
// until wake-ups cross processes. watermill-sql behaves the same either way (it only polls), so
// it runs once and its figures serve both pairs of rows.
func scenarioLatency(ctx context.Context, b *bench, c contender) error {
	modes := []bool{false, true}
	if c.isWatermillSQL() {
		modes = []bool{false}
	}
	for _, elsewhere := range modes {
		p50, p99, err := b.latencyRun(ctx, c, elsewhere)
		if err != nil {
			return err
		}
		if elsewhere {
			b.results.set("4c", c, ms(p50))
			b.results.set("4d", c, ms(p99))
		} else {
			b.results.set("4a", c, ms(p50))
			b.results.set("4b", c, ms(p99))
			if c.isWatermillSQL() {
				b.results.set("4c", c, ms(p50))
				b.results.set("4d", c, ms(p99))
			}
		}
	}
	if c.isWatermillSQL() {
		b.results.note(fmt.Sprintf("%s, scenario 4: one run serves the in-process and elsewhere rows (it polls, with no in-process wake-up)", c))
	}
	return nil
}

func (b *bench) latencyRun(ctx context.Context, c contender, elsewhere bool) (p50, p99 time.Duration, err error) {
	e, topic, err := b.prepare(ctx, c, "latency", 0)
	if err != nil {
		return 0, 0, err
	}
	defer e.close()
	defer b.dropTopic(c, topic)

	var publish func(*message.Message) error
	if elsewhere {
		store := offsets.NewStore(e.tables(topic), true)
		publish = func(m *message.Message) error {
			return store.Insert(ctx, e.db, []offsets.Row{{UUID: m.UUID, Payload: m.Payload, Metadata: "{}"}}, listen.Channel)
		}
	} else {
		pub, err := e.publisher()
		if err != nil {
			return 0, 0, err
		}
		defer pub.Close()
		publish = func(m *message.Message) error { return pub.Publish(topic, m) }
	}

	var mu sync.Mutex
	sent := map[string]time.Time{}
	recv := map[string]time.Time{}
	total := int(float64(b.cfg.latencyRate) * b.cfg.latencyDuration.Seconds())
	allIn := make(chan struct{})
	var once sync.Once

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return 0, 0, err
	}
	sub, err := e.subscriber(0)
	if err != nil {
		return 0, 0, err
	}
	defer sub.Close()
	router.AddConsumerHandler("latency", topic, sub, func(m *message.Message) error {
		now := time.Now()
		mu.Lock()
		if _, dup := recv[m.UUID]; !dup {
			recv[m.UUID] = now
		}
		n := len(recv)
		mu.Unlock()
		if n == total {
			once.Do(func() { close(allIn) })
		}
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
		}
	}()
	select {
	case <-router.Running():
	case <-time.After(30 * time.Second):
		return 0, 0, errors.New("router did not start within 30s")
	case <-ctx.Done():
		return 0, 0, context.Cause(ctx)
	}
	// Let the subscription reach its idle wait: latency is measured to an idle subscriber.
	time.Sleep(time.Second)

	tick := time.NewTicker(time.Second / time.Duration(b.cfg.latencyRate))
	defer tick.Stop()
	for i := 0; i < total; i++ {
		select {
		case <-tick.C:
		case <-ctx.Done():
			return 0, 0, context.Cause(ctx)
		}
		m := message.NewMessage(watermill.NewUUID(), b.payload)
		if err := publish(m); err != nil {
			return 0, 0, fmt.Errorf("publish %d: %w", i, err)
		}
		at := time.Now()
		mu.Lock()
		sent[m.UUID] = at
		mu.Unlock()
	}
	select {
	case <-allIn:
	case <-time.After(30 * time.Second):
	case <-ctx.Done():
		return 0, 0, context.Cause(ctx)
	}

	mu.Lock()
	defer mu.Unlock()
	lat := make([]time.Duration, 0, len(sent))
	early := 0
	for id, s := range sent {
		r, ok := recv[id]
		if !ok {
			continue
		}
		d := r.Sub(s)
		if d < 0 {
			// The handler started before Publish returned to the caller.
			early++
			d = 0
		}
		lat = append(lat, d)
	}
	if missing := len(sent) - len(lat); missing > 0 {
		return 0, 0, fmt.Errorf("%d of %d messages did not arrive within 30s of the last publish", missing, len(sent))
	}
	if early > 0 {
		b.results.note(fmt.Sprintf("%s, scenario 4 (elsewhere=%v): %d of %d handlers started before Publish returned; counted as 0 ms", c, elsewhere, early, len(lat)))
	}
	sortDurations(lat)
	return percentile(lat, 50), percentile(lat, 99), nil
}

// Scenario 5: publish throughput through the contender's Publisher. The publisher has no claim
// mode, so the advisory column repeats nothing: it says "= lease".
func scenarioPublish(ctx context.Context, b *bench, c contender) error {
	if c == advisory {
		b.results.setText("5a", c, "= lease")
		b.results.setText("5b", c, "= lease")
		return nil
	}
	e, err := openEnv(ctx, b.cfg, c)
	if err != nil {
		return err
	}
	defer e.close()
	pub, err := e.publisher()
	if err != nil {
		return err
	}
	defer pub.Close()

	// Batches of 100, one goroutine.
	topic := b.topic(c, "pubbatch")
	if err := e.createTopic(ctx, topic); err != nil {
		return err
	}
	msgs := newMessages(b.cfg.publishBatchN, b.payload)
	var prof *serverProfile
	if b.cfg.serverProfile && c.onPostgres() {
		prof = startServerProfile(ctx, b.admin, c.appName(), 100*time.Millisecond)
		defer prof.halt() // when the loop below ends early
	}
	start := time.Now()
	for i := 0; i < len(msgs); i += 100 {
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		if err := pub.Publish(topic, msgs[i:min(i+100, len(msgs))]...); err != nil {
			return fmt.Errorf("publish batch at %d: %w", i, err)
		}
	}
	batched := time.Since(start)
	b.results.set("5a", c, rate(int64(len(msgs)), batched))
	if prof != nil {
		b.addTrace(prof.finish(ctx, b.roundTitle(fmt.Sprintf("%s, scenario 5a, %d messages in batches of 100", c, len(msgs))), int64(len(msgs)), batched))
	}
	b.dropTopic(c, topic)

	// One message per call from many goroutines.
	topic = b.topic(c, "pubsingle")
	if err := e.createTopic(ctx, topic); err != nil {
		return err
	}
	defer b.dropTopic(c, topic)
	msgs = newMessages(b.cfg.publishSingleN, b.payload)
	elapsed, err := parallel(ctx, b.cfg.publishWorkers, len(msgs), func(i int) error {
		return pub.Publish(topic, msgs[i])
	})
	if err != nil {
		return err
	}
	b.results.set("5b", c, rate(int64(len(msgs)), elapsed))
	return nil
}

// parallel runs fn(0..n-1) on workers goroutines and returns the wall time; the first error
// stops the others.
func parallel(ctx context.Context, workers, n int, fn func(i int) error) (time.Duration, error) {
	var next atomic.Int64
	var firstErr error
	var errOnce sync.Once
	var failed atomic.Bool
	var wg sync.WaitGroup
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for !failed.Load() && ctx.Err() == nil {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				if err := fn(i); err != nil {
					errOnce.Do(func() { firstErr = fmt.Errorf("item %d: %w", i, err) })
					failed.Store(true)
					return
				}
			}
		}()
	}
	wg.Wait()
	if firstErr == nil && ctx.Err() != nil {
		firstErr = context.Cause(ctx)
	}
	return time.Since(start), firstErr
}

// Scenario 6: peak memory of this process while a large backlog drains (no-op handler), and the
// drain rate at that size; for the library, the claim statement's plan at that size, with the
// group at the head and at the tail. The drain is bounded by -memory-cap: where it does not
// finish, the figures cover the part drained, and a note says how much that was.
func scenarioMemory(ctx context.Context, b *bench, c contender) error {
	e, topic, err := b.prepare(ctx, c, "memory", b.cfg.memoryN)
	if err != nil {
		return err
	}
	defer e.close()
	defer b.dropTopic(c, topic)
	if b.cfg.explain && b.firstRound() && c.isLibrary() && c.onPostgres() {
		b.explainClaim(ctx, topic, fmt.Sprintf("scenario 6, %s, %d rows, group at the head", c, b.cfg.memoryN), false)
		b.explainClaim(ctx, topic, fmt.Sprintf("scenario 6, %s, %d rows, group at the tail", c, b.cfg.memoryN), true)
	}
	if b.cfg.explain && b.firstRound() && c == watermillSQL {
		b.explainPeer(ctx, topic, fmt.Sprintf("scenario 6, watermill-sql, %d rows, group at the head", b.cfg.memoryN))
	}
	var sampler *memSampler
	res, err := b.runRouter(ctx, e, topic, routerRun{
		instances: 1, stopAt: b.cfg.memoryN, drain: true, window: b.cfg.memoryCap,
		profile: fmt.Sprintf("%s, scenario 6, %d messages", c, b.cfg.memoryN),
		onStart: func() { sampler = startMemSampler(50 * time.Millisecond) },
	})
	if sampler != nil {
		peakHeap, peakSys, _ := sampler.finish()
		b.results.set("6b", c, mib(peakHeap))
		b.results.set("6c", c, mib(peakSys))
	}
	if err != nil {
		return err
	}
	b.results.set("6a", c, rate(res.handled, res.elapsed))
	if !res.drained {
		b.results.note(fmt.Sprintf("%s, scenario 6: NOT drained within -memory-cap %s: %d of %d messages (%.1f%%) handled; 6a-6c cover that part only",
			c, b.cfg.memoryCap, res.handled, b.cfg.memoryN, 100*float64(res.handled)/float64(b.cfg.memoryN)))
	}
	return nil
}
