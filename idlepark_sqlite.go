package sqlbroker

import (
	"context"
	"database/sql"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/wake"
)

// Idle subscriptions on SQLite: knowing when to look again.
//
// SQLite has no LISTEN, and a look is a statement SQLite parses and plans each time. So one
// connection per pool in this process reads PRAGMA data_version every PollInterval (commitWatch):
// its value changes when any connection, of any process, commits to the file. A subscription
// whose claim found nothing claims again only when that value changed, when it was woken (a
// publisher of this process), when one of its own claims came due, or every IdlePollInterval
// (a lease that ran out commits nothing). Without the watch's connection (pool exhausted, a
// failed read) every subscription looks every PollInterval.
//
// A pool limited to one connection gets no watch, nor does an in-memory database (no other
// process can commit to it). The last subscription of the pool to stop closes the connection
// (counted in its CloseReport) and waits for the watch's goroutine.

// commitWatch is the watch of one SQLite pool in this process.
type commitWatch struct {
	pool   *dbx.SQLitePool
	cancel context.CancelFunc
	done   chan struct{}

	gen      atomic.Uint64 // changes seen; also bumped when the watch (re)connects
	watching atomic.Bool   // the connection is held and its last read succeeded
	closed   bool          // the goroutine closed its connection as it stopped; read after done

	mu   sync.Mutex
	refs int
	subs map[*subscription]struct{}
}

var (
	watchesMu sync.Mutex
	watches   = map[*sql.DB]*commitWatch{}
)

// joinCommitWatch registers sub with the watch of its pool, started if needed; nil when the
// pool cannot spare a connection. leave reports whether it closed the watch's connection.
func joinCommitWatch(sub *subscription) (w *commitWatch, leave func() bool) {
	p, ok := sub.s.db.(*dbx.SQLitePool)
	if !ok || p.InMemory() || p.DB.Stats().MaxOpenConnections == 1 {
		return nil, func() bool { return false }
	}
	watchesMu.Lock()
	w = watches[p.DB]
	if w == nil {
		ctx, cancel := context.WithCancel(context.Background())
		w = &commitWatch{pool: p, cancel: cancel, done: make(chan struct{}), subs: map[*subscription]struct{}{}}
		watches[p.DB] = w
		go w.run(ctx)
	}
	w.mu.Lock()
	w.refs++
	w.subs[sub] = struct{}{}
	w.mu.Unlock()
	watchesMu.Unlock()
	var once sync.Once
	return w, func() (closed bool) {
		once.Do(func() {
			watchesMu.Lock()
			w.mu.Lock()
			w.refs--
			delete(w.subs, sub)
			last := w.refs == 0
			w.mu.Unlock()
			if last {
				delete(watches, w.pool.DB)
			}
			watchesMu.Unlock()
			if last {
				w.cancel()
				<-w.done
				closed = w.closed
			}
		})
		return closed
	}
}

// interval is the shortest PollInterval of the subscriptions in the watch.
func (w *commitWatch) interval() time.Duration {
	w.mu.Lock()
	defer w.mu.Unlock()
	d := DefaultPollInterval
	first := true
	for s := range w.subs {
		if first || s.cfg.PollInterval < d {
			d, first = s.cfg.PollInterval, false
		}
	}
	return d
}

// wakeAll wakes every subscription of the watch (their topics, in this process).
func (w *commitWatch) wakeAll() {
	w.mu.Lock()
	tables := make(map[string]struct{}, len(w.subs))
	for s := range w.subs {
		tables[s.store.T.Messages] = struct{}{}
	}
	w.mu.Unlock()
	for t := range tables {
		wake.Notify(t)
	}
}

func (w *commitWatch) run(ctx context.Context) {
	defer close(w.done)
	var conn dbx.Conn
	defer func() {
		w.watching.Store(false)
		if conn != nil {
			conn.Destroy() // closed, not handed back to the pool
			w.closed = true
		}
	}()
	var last int64
	read := func() (int64, error) { return offsets.DataVersion(ctx, conn) }
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-ctx.Done():
			return
		}
		t.Reset(w.interval())
		if conn == nil {
			// Waits while the pool is exhausted; the subscriptions look by themselves meanwhile.
			c, err := w.pool.Dedicated(ctx)
			if err != nil {
				continue // the pool is closed, or the watch stops: try at the next tick
			}
			conn = c
			if last, err = read(); err != nil {
				if ctx.Err() != nil {
					return // the stop interrupted it: the deferred Destroy closes it, and the stop counts it
				}
				conn.Destroy()
				conn = nil
				continue
			}
			// Commits before the first read are unknown: every subscription looks once.
			w.gen.Add(1)
			w.watching.Store(true)
			continue
		}
		v, err := read()
		if err != nil {
			w.watching.Store(false)
			if ctx.Err() != nil {
				return // the deferred Destroy closes it: the stop counts it
			}
			conn.Destroy()
			conn = nil
			continue
		}
		if v != last {
			last = v
			w.gen.Add(1)
			w.wakeAll()
		}
	}
}

// sqliteWatching is a SQLite subscription's side of the watch; the claim loop alone uses it.
type sqliteWatching struct {
	watch    *commitWatch
	seenGen  uint64    // the watch's gen before the last look
	lastLook time.Time // when the last look ran
	mustLook bool      // the last look found claims or failed, or the subscription was woken
}

// lookNeeded says whether the claim loop must run its claim now, or may take it that nothing
// changed since the last one found nothing.
func (sub *subscription) lookNeeded(now time.Time) bool {
	st := &sub.claimer.sqlite
	w := st.watch
	if w == nil || st.mustLook || !w.watching.Load() || w.gen.Load() != st.seenGen {
		return true
	}
	if at := sub.claimer.dueAt.first(); at != 0 && now.UnixNano() >= at {
		return true
	}
	return now.Sub(st.lastLook) >= sub.cfg.IdlePollInterval
}

// looking notes a look that starts now.
func (sub *subscription) looking(now time.Time) {
	st := &sub.claimer.sqlite
	if st.watch != nil {
		st.seenGen = st.watch.gen.Load()
	}
	st.lastLook = now
}
