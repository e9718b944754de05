package sqlbroker

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// Idle subscriptions: parking while there is nothing to claim (PostgreSQL; on SQLite see
// idlepark_sqlite.go).
//
// A subscription whose claim found nothing parks until one of: a publisher of this process or
// a NOTIFY wakes its topic; one of its own claims comes due (dueAt); the poll shared by the
// subscriptions of its pool in this process finds work for it; its own safety poll
// (idleSafetyPolls IdlePollIntervals). The shared poll finds the work nobody announces: a
// lease of another consumer that ran out, a message the xmin horizon held back when its
// notification came, a message written without NOTIFY, in advisory mode a claim whose holder
// let go. It runs one statement for up to pollChunk subscriptions, only for chunks holding a
// parked one, every IdlePollInterval while the pool's LISTEN connection listens and every
// PollInterval while it does not (database/sql cannot listen).

// pollChunk is how many subscriptions one statement of the shared poll covers.
const pollChunk = 64

// idleSafetyPolls is how many IdlePollIntervals a parked subscription sleeps at most before it
// claims by itself, whatever the shared poll says.
const idleSafetyPolls = 30

// pollLimit bounds one statement of the shared poll; past it the statement is cancelled on
// the server and every parked subscription of its chunk claims by itself. A table lock on one
// topic's tables (a migration's) thus delays the others of its chunk by this much at most.
const pollLimit = time.Second

// stmtIdlePoll is the kind of the shared poll's statements in its tracker.
const stmtIdlePoll = "idle-poll"

// parking is the claim loop's side of parking.
type parking struct {
	entry   *pollEntry    // set by the claim loop while it runs
	duePoke chan struct{} // markDue: a parked claim loop looks at dueAt again
}

// pokeDue tells a parked claim loop that dueAt changed.
func (sub *subscription) pokeDue() {
	select {
	case sub.claimer.park.duePoke <- struct{}{}:
	default:
	}
}

// joinIdlePoll registers the subscription with its pool's shared poll; the claim loop calls
// the returned leave when it ends, which stops the poll if this was its last subscription.
// On SQLite a subscription does not park: there is no LISTEN to wake it from another process,
// and it joins its pool's watch of commits instead (idlepark_sqlite.go).
func (sub *subscription) joinIdlePoll() (leave func()) {
	if !sub.store.T.Dialect().Notify {
		w, leaveWatch := joinCommitWatch(sub)
		sub.claimer.sqlite.watch = w
		return func() {
			if leaveWatch() {
				sub.atStop.connsClosed.Add(1)
			}
		}
	}
	p, e := acquirePoller(sub.s.db, sub)
	sub.claimer.park.entry = e
	return func() { p.leave(e) }
}

// park sleeps as described above. It reports whether to go on, and whether a publisher or a
// NOTIFY woke the topic (the claim that follows may then find nothing while the xmin horizon
// holds the message back, and is tried again soon).
func (sub *subscription) park() (goOn, woken bool) {
	e := sub.claimer.park.entry
	e.setParked(true)
	defer e.setParked(false)
	// Spread over ±25%, so that subscriptions that parked together do not claim together.
	every := idleSafetyPolls * sub.cfg.IdlePollInterval
	safety := time.NewTimer(every*3/4 + rand.N(every/2+1))
	defer safety.Stop()
	due := time.NewTimer(time.Hour)
	defer due.Stop()
	for {
		due.Stop()
		var dueC <-chan time.Time
		if at := sub.claimer.dueAt.first(); at != 0 {
			d := time.Until(time.Unix(0, at))
			if d <= 0 {
				return true, false
			}
			due.Reset(d)
			dueC = due.C
		}
		select {
		case <-sub.claimer.woken:
			return true, true
		case <-e.poke:
			sub.mode.woken() // in advisory mode a claim may have lost its holder: look now
			return true, false
		case <-sub.claimer.park.duePoke:
		case <-dueC:
			return true, false
		case <-safety.C:
			return true, false
		case <-sub.ctx.Done():
			return false, false
		}
	}
}

// pollEntry is one subscription in a shared poll.
type pollEntry struct {
	p           *idlePoller
	sub         *subscription
	chunk, slot int
	parked      bool          // guarded by the poller's mu
	poke        chan struct{} // the shared poll found work for it
}

func (e *pollEntry) setParked(v bool) {
	e.p.mu.Lock()
	e.parked = v
	e.p.mu.Unlock()
}

// pollChunkState is one statement of the shared poll and the subscriptions it covers, in
// fixed slots so that the statement's text, prepared once per connection by pgx, stays the
// same while subscriptions park and wake.
type pollChunkState struct {
	slots []*pollEntry // nil: a free slot
	sql   string       // "" when slots changed
	adv   bool         // a slot is in the advisory mode: the statement takes $1
}

// idlePoller is the shared poll of one pool in this process.
type idlePoller struct {
	key     any
	pool    dbx.Pool
	logger  watermill.LoggerAdapter
	tracker *dbx.Tracker
	stop    chan struct{}
	done    chan struct{}

	mu     sync.Mutex
	refs   int
	chunks []*pollChunkState
}

var (
	pollersMu sync.Mutex
	pollers   = map[any]*idlePoller{} // by pollKey
)

// pollKey identifies the pool under wrappers: one shared poll per pool.
func pollKey(pool dbx.Pool) any {
	switch p := pool.(type) {
	case dbx.Listenable:
		return p.ListenKey()
	case *dbx.StdPool:
		return p.DB
	}
	return pool
}

func acquirePoller(pool dbx.Pool, sub *subscription) (*idlePoller, *pollEntry) {
	pollersMu.Lock()
	defer pollersMu.Unlock()
	key := pollKey(pool)
	p := pollers[key]
	if p == nil {
		p = &idlePoller{key: key, pool: pool, logger: sub.s.logger, tracker: dbx.NewTracker(pool),
			stop: make(chan struct{}), done: make(chan struct{})}
		pollers[key] = p
		go p.run()
	}
	e := &pollEntry{p: p, sub: sub, poke: make(chan struct{}, 1)}
	p.mu.Lock()
	p.refs++
	p.place(e)
	p.mu.Unlock()
	return p, e
}

// place puts e in the first free slot; mu is held.
func (p *idlePoller) place(e *pollEntry) {
	for ci, c := range p.chunks {
		for si, s := range c.slots {
			if s == nil {
				c.slots[si], e.chunk, e.slot, c.sql = e, ci, si, ""
				return
			}
		}
		if len(c.slots) < pollChunk {
			e.chunk, e.slot = ci, len(c.slots)
			c.slots, c.sql = append(c.slots, e), ""
			return
		}
	}
	e.chunk, e.slot = len(p.chunks), 0
	p.chunks = append(p.chunks, &pollChunkState{slots: []*pollEntry{e}})
}

// leave takes e out of the poll; the last subscription to leave stops it, cancelling its
// statement in flight on the server and waiting for it.
func (p *idlePoller) leave(e *pollEntry) {
	pollersMu.Lock()
	p.mu.Lock()
	c := p.chunks[e.chunk]
	c.slots[e.slot], c.sql = nil, ""
	p.refs--
	last := p.refs == 0
	p.mu.Unlock()
	if last {
		delete(pollers, p.key)
	}
	pollersMu.Unlock()
	if last {
		close(p.stop)
		ctx, cancel := context.WithTimeout(context.Background(), dbx.CleanupTimeout)
		p.tracker.Stop(ctx)
		cancel()
		<-p.done
	}
}

// intervals are the shortest PollInterval and IdlePollInterval of the subscriptions in the
// poll.
func (p *idlePoller) intervals() (poll, idle time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	poll, idle = time.Hour, time.Hour
	for _, c := range p.chunks {
		for _, e := range c.slots {
			if e != nil {
				poll = min(poll, e.sub.cfg.PollInterval)
				idle = min(idle, e.sub.cfg.IdlePollInterval)
			}
		}
	}
	return poll, idle
}

// run polls every PollInterval while the pool's LISTEN connection is down (or the pool cannot
// listen), every IdlePollInterval while it listens.
func (p *idlePoller) run() {
	defer close(p.done)
	last := time.Now()
	for {
		poll, idle := p.intervals()
		tick := min(poll, idle)
		t := time.NewTimer(tick)
		select {
		case <-t.C:
		case <-p.stop:
			t.Stop()
			return
		}
		every := poll
		if listen.Listening(p.pool) {
			every = idle
		}
		if time.Since(last) < every-tick/2 {
			continue
		}
		last = time.Now()
		p.pollOnce()
	}
}

// pollOnce runs the statement of every chunk that holds a parked subscription and pokes the
// parked subscriptions it found work for. A statement that fails pokes every parked
// subscription of its chunk: their own claims then see what is wrong.
func (p *idlePoller) pollOnce() {
	type job struct {
		sql     string
		args    []any
		entries []*pollEntry
	}
	var jobs []job
	p.mu.Lock()
	for _, c := range p.chunks {
		parked := false
		for _, e := range c.slots {
			if e != nil && e.parked {
				parked = true
				break
			}
		}
		if !parked {
			continue
		}
		if c.sql == "" {
			c.sql, c.adv = chunkSQL(c.slots, nil)
		}
		j := job{sql: c.sql, entries: append([]*pollEntry(nil), c.slots...)}
		if c.adv {
			held := make([]int64, len(c.slots))
			for i, e := range c.slots {
				if e != nil {
					held[i] = int64(e.sub.mode.locksHeld())
				}
			}
			if p.pool.Driver() == "database/sql" {
				// lib/pq sends a statement with arguments in two round trips, each a
				// transaction of its own, and never keeps its plan: the counts go into the text.
				j.sql, _ = chunkSQL(c.slots, held)
			} else {
				j.args = []any{held}
			}
		}
		jobs = append(jobs, j)
	}
	p.mu.Unlock()
	for _, j := range jobs {
		var found []int64
		err := p.tracker.Run(context.Background(), stmtIdlePoll, pollLimit, func(ctx context.Context, q dbx.Querier) error {
			var err error
			found, err = dbx.ScanInt64s(q.Query(ctx, j.sql, j.args...))
			return err
		})
		select {
		case <-p.stop:
			return
		default:
		}
		if err != nil {
			p.logger.Debug("The idle subscriptions' shared poll failed; their own claims look", watermill.LogFields{"err": err.Error()})
			for _, e := range j.entries {
				if e != nil {
					e.wake()
				}
			}
			continue
		}
		for _, i := range found {
			if i >= 0 && int(i) < len(j.entries) && j.entries[i] != nil {
				j.entries[i].wake()
			}
		}
	}
}

func (e *pollEntry) wake() {
	select {
	case e.poke <- struct{}{}:
	default:
	}
}

// chunkSQL is the statement of one chunk (offsets.IdleLookSQL): one branch per slot, nil for
// a free slot. With held given, the counts of the advisory branches are written into the text
// instead of being read from $1.
func chunkSQL(slots []*pollEntry, held []int64) (string, bool) {
	branches := make([]offsets.IdleBranch, len(slots))
	for i, e := range slots {
		if e == nil {
			continue
		}
		branches[i] = offsets.IdleBranch{Tables: &e.sub.store.T, GroupID: e.sub.groupID, Locks: e.sub.mode.holdsLocks(), Ordered: e.sub.cfg.OrderByKey}
	}
	return offsets.IdleLookSQL(branches, held)
}
