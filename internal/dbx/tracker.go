package dbx

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// CancelWait bounds how long Tracker.Stop waits for the server's answer to the cancels it
// sent once the caller's context has ended. The server usually ends a cancelled statement
// within milliseconds; a statement still running after this long is given up on, and its
// connection closed.
const CancelWait = time.Second

// ErrStopped is returned by Tracker.Run once the tracker has been stopped: no statement starts
// after Stop.
var ErrStopped = errors.New("dbx: stopped: no statement starts any more")

// Tracker runs statements on connections it takes from a pool itself, so that every statement
// in flight can be cancelled on the server and awaited. A context cancelled in the middle of a
// query makes a driver return at once while the server may still be running the statement
// (pgx then closes the socket in the background), so the caller's error is not the server's
// word: a statement run through Run is never cancelled that way. When its context ends, when
// its time limit passes, or when the tracker stops, a cancel request is sent for its backend,
// and Run returns only once the server has ended the statement (or CancelWait has passed
// since the tracker's Stop gave up waiting).
type Tracker struct {
	pool Pool

	mu      sync.Mutex
	stopped bool
	calls   map[*call]struct{}
	wg      sync.WaitGroup

	stopCtx  context.Context // cancelled by Stop: acquires end, running statements are cancelled
	stopFunc context.CancelFunc

	cancelled sync.Map     // kind -> *atomic.Int64: statements the server ended on a cancel of ours
	closed    atomic.Int64 // connections closed instead of handed back
}

type call struct {
	kind  string
	conn  Conn
	abort context.CancelFunc // ends the statement's own context: the driver gives up on it
}

// NewTracker returns a Tracker of statements on pool.
func NewTracker(pool Pool) *Tracker {
	ctx, cancel := context.WithCancel(context.Background())
	return &Tracker{pool: pool, calls: map[*call]struct{}{}, stopCtx: ctx, stopFunc: cancel}
}

// Cause of a statement cancelled by Run, as its error wraps it.
var (
	// ErrLimit says that a statement ran past its time limit and was cancelled on the server.
	ErrLimit = errors.New("dbx: the statement ran past its time limit and was cancelled on the server")
)

// Run takes a connection from the pool and runs fn on it, with a context that keeps ctx's
// values but not its cancellation. The acquire is bounded by ctx, by limit and by Stop. When
// ctx ends, limit passes or the tracker stops while fn runs, a cancel request is sent for the
// connection's backend and Run waits for fn to return the server's answer; the error then
// wraps the reason (ctx's cause, ErrLimit or ErrStopped) and the server's error. fn must read
// every row it asks for before it returns. kind names the statement in Stop's counts.
func (t *Tracker) Run(ctx context.Context, kind string, limit time.Duration, fn func(ctx context.Context, q Querier) error) error {
	return t.RunConn(ctx, kind, limit, func(ctx context.Context, c Conn) error { return fn(ctx, c) })
}

// RunConn is Run for an fn that needs the connection itself (its backend's PID); fn must not
// Release, Destroy or Cancel it.
func (t *Tracker) RunConn(ctx context.Context, kind string, limit time.Duration, fn func(ctx context.Context, c Conn) error) error {
	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		return ErrStopped
	}
	t.wg.Add(1)
	t.mu.Unlock()
	defer t.wg.Done()

	actx, acancel := context.WithTimeoutCause(ctx, limit, ErrLimit)
	stopAcq := context.AfterFunc(t.stopCtx, func() { acancel() })
	conn, err := t.pool.Acquire(actx)
	stopAcq()
	acancel()
	if err != nil {
		if t.stopCtx.Err() != nil {
			return ErrStopped
		}
		return err
	}

	// The last resort: a server that answers neither the statement nor its cancel (a dead
	// network). The statement's context then ends and the driver closes the connection.
	qctx, qcancel := context.WithTimeout(context.WithoutCancel(ctx), limit+CleanupTimeout)
	defer qcancel()
	c := &call{kind: kind, conn: conn, abort: qcancel}
	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		conn.Release()
		return ErrStopped
	}
	t.calls[c] = struct{}{}
	t.mu.Unlock()
	defer func() {
		t.mu.Lock()
		delete(t.calls, c)
		t.mu.Unlock()
	}()

	var (
		once       sync.Once
		reason     atomic.Value // error
		cancelSent atomic.Bool
		connCloses atomic.Bool
		sending    sync.WaitGroup
	)
	trigger := func(why error) {
		once.Do(func() {
			reason.Store(why)
			sending.Add(1)
			go func() {
				defer sending.Done()
				cctx, ccancel := CleanupContext(context.Background())
				defer ccancel()
				closes, err := conn.Cancel(cctx)
				if err == nil {
					cancelSent.Store(true)
					connCloses.Store(closes)
				}
			}()
		})
	}
	stops := []func() bool{
		context.AfterFunc(ctx, func() { trigger(context.Cause(ctx)) }),
		context.AfterFunc(t.stopCtx, func() { trigger(ErrStopped) }),
	}
	timer := time.AfterFunc(limit, func() { trigger(ErrLimit) })
	stops = append(stops, timer.Stop)

	err = fn(qctx, conn)
	for _, stop := range stops {
		stop()
	}
	triggered := false
	once.Do(func() {}) // no trigger from now on
	if r := reason.Load(); r != nil {
		triggered = true
	}
	sending.Wait()

	switch {
	case !triggered:
		if err != nil && qctx.Err() != nil {
			t.destroy(conn)
		} else {
			conn.Release()
		}
		return err
	case err != nil && SQLState(err) == CodeQueryCanceled:
		t.count(kind)
		if connCloses.Load() {
			t.destroy(conn)
		} else {
			conn.Release()
		}
		return errors.Join(reason.Load().(error), err)
	case !cancelSent.Load():
		// The cancel could not be sent: the statement ended on its own.
		t.destroy(conn)
		return err
	default:
		// The statement ended before the cancel arrived: a cancel may still be pending for
		// the connection's next statement, so the connection goes.
		t.destroy(conn)
		return err
	}
}

func (t *Tracker) destroy(c Conn) {
	c.Destroy()
	t.closed.Add(1)
}

// Closed is the number of connections the tracker closed instead of handing them back to the
// pool (after a cancel, or a statement it gave up on), since it was built.
func (t *Tracker) Closed() int { return int(t.closed.Load()) }

// Cancelled counts by kind the statements the server ended on a cancel of the tracker's,
// since it was built.
func (t *Tracker) Cancelled() map[string]int {
	out := map[string]int{}
	t.cancelled.Range(func(k, v any) bool {
		out[k.(string)] = int(v.(*atomic.Int64).Load())
		return true
	})
	return out
}

// Stopping is closed once Stop has been called: loops that pause between statements wait on
// it too, since every later Run returns ErrStopped.
func (t *Tracker) Stopping() <-chan struct{} { return t.stopCtx.Done() }

func (t *Tracker) count(kind string) {
	v, _ := t.cancelled.LoadOrStore(kind, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

// Running is the number of statements running now.
func (t *Tracker) Running() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.calls)
}

// StopResult says what Stop did.
type StopResult struct {
	// Cancelled counts by kind the statements the server ended on a cancel of the tracker's,
	// since the tracker was built.
	Cancelled map[string]int
	// Abandoned counts by kind the statements whose end the server did not confirm within
	// CancelWait after ctx ended: the driver was made to give up on them and close their
	// connections, so the server ends them once it notices.
	Abandoned map[string]int
}

// Stop refuses every later Run, ends the acquires in progress, cancels every running
// statement on the server, and waits for each to end: until ctx ends, and then up to
// CancelWait more for the server's answers. Later calls only wait again.
func (t *Tracker) Stop(ctx context.Context) StopResult {
	t.mu.Lock()
	t.stopped = true
	t.mu.Unlock()
	t.stopFunc()

	all := make(chan struct{})
	go func() {
		t.wg.Wait()
		close(all)
	}()
	select {
	case <-all:
	case <-ctx.Done():
		select {
		case <-all:
		case <-time.After(CancelWait):
		}
	}
	res := StopResult{Cancelled: map[string]int{}, Abandoned: map[string]int{}}
	t.mu.Lock()
	for c := range t.calls {
		res.Abandoned[c.kind]++
		c.abort()
	}
	t.mu.Unlock()
	if len(res.Abandoned) > 0 {
		select { // the drivers return at once once their statements' contexts end
		case <-all:
		case <-time.After(CancelWait):
		}
	}
	res.Cancelled = t.Cancelled()
	return res
}
