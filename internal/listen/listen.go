// Package listen keeps one LISTEN connection per pool in a process and turns the library's
// NOTIFY wake-ups into in-process wake signals. While the connection listens (Listening),
// idle subscriptions rely on it and the process's shared poll looks for work rarely; while it
// does not (a pool that cannot listen, a connection lost and not yet back), the shared poll
// runs every poll interval, so delivery is delayed by at most that much.
package listen

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/wake"
)

// Channel is the NOTIFY channel of the library; the payload names a messages table.
const Channel = "sqlbroker"

type listener struct {
	refs      int
	cancel    context.CancelFunc
	done      chan struct{}
	connected atomic.Bool   // a connection of the listener is open (counted as closed on release)
	listening atomic.Bool   // its LISTEN is in place: every NOTIFY of the library reaches the process
	gen       atomic.Uint64 // how many times its LISTEN was put in place
}

var (
	mu        sync.Mutex
	listeners = map[any]*listener{}
)

// Acquire makes sure a listening connection runs for pool while the returned release has
// not been called. release reports whether it closed the listening connection (the last
// user left). Pools that cannot listen (database/sql) get a no-op.
func Acquire(pool dbx.Pool, logger watermill.LoggerAdapter) (release func() bool) {
	lp, ok := pool.(dbx.Listenable)
	if !ok {
		return func() bool { return false }
	}
	mu.Lock()
	defer mu.Unlock()
	key := lp.ListenKey()
	l := listeners[key]
	if l == nil {
		ctx, cancel := context.WithCancel(context.Background())
		l = &listener{cancel: cancel, done: make(chan struct{})}
		listeners[key] = l
		go l.run(ctx, lp, logger)
	}
	l.refs++
	var once sync.Once
	return func() (closed bool) {
		once.Do(func() {
			mu.Lock()
			l.refs--
			last := l.refs == 0
			if last {
				delete(listeners, key)
			}
			mu.Unlock()
			if last {
				l.cancel()
				<-l.done
				closed = l.connected.Load()
			}
		})
		return closed
	}
}

// run listens until ctx ends, reconnecting after errors.
func (l *listener) run(ctx context.Context, pool dbx.Listenable, logger watermill.LoggerAdapter) {
	defer close(l.done)
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := pool.Listen(ctx, Channel, func() {
			// Open from now on, before its LISTEN is in place: a release in between closes it.
			l.connected.Store(true)
		}, func() {
			// (Re)connected: notifications sent before the LISTEN was in place were missed.
			// The pool's shared poll sees the generation change and looks for the parked
			// subscriptions at once, in one statement per 64 of them; waking every
			// subscription instead would make each claim, and try again while the xmin
			// horizon may hold a message back: a burst of claims per subscription.
			l.gen.Add(1)
			l.listening.Store(true)
			backoff = 100 * time.Millisecond
		}, wake.Notify)
		l.listening.Store(false)
		if ctx.Err() != nil {
			return // l.connected stays as it was: the connection was open until now
		}
		l.connected.Store(false)
		logger.Debug("LISTEN connection lost; subscriptions poll until it is back", watermill.LogFields{"err": err, "retry_in": backoff})
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
			return
		}
		backoff = min(backoff*2, 5*time.Second)
	}
}

// Listening reports whether pool's LISTEN connection in this process is up with its LISTEN in
// place, so that every NOTIFY of the library wakes the process's subscriptions. It is false
// for a pool that cannot listen (database/sql) and for one nobody acquired.
func Listening(pool dbx.Pool) bool {
	listening, _ := State(pool)
	return listening
}

// State is Listening, and how many times pool's LISTEN connection in this process put its
// LISTEN in place: when that changes, a NOTIFY sent just before may have been missed.
func State(pool dbx.Pool) (listening bool, gen uint64) {
	lp, ok := pool.(dbx.Listenable)
	if !ok {
		return false, 0
	}
	mu.Lock()
	l := listeners[lp.ListenKey()]
	mu.Unlock()
	if l == nil {
		return false, 0
	}
	return l.listening.Load(), l.gen.Load()
}
