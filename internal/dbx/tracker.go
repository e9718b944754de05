package dbx

import (
	"context"
	"errors"
	"fmt"
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
//
// A call costs about what the pool's own Exec costs: its bookkeeping is reused from call to
// call, it arms no timer without a time limit, and it watches the caller's context only when
// that context can end. Stop finds every call in a list kept for it, rather than each call
// watching the tracker.
type Tracker struct {
	pool Pool

	mu      sync.Mutex
	stopped bool
	calls   []*call // every call between its start and its return; each knows its index
	wg      sync.WaitGroup
	stopCh  chan struct{} // closed by Stop
	free    sync.Pool     // *call, reused once a call has ended untouched by any trigger

	cancelled sync.Map     // kind -> *atomic.Int64: statements the server ended on a cancel of ours
	closed    atomic.Int64 // connections closed instead of handed back
}

// Phases of a call.
const (
	phaseAcquire = iota // waiting for a connection: a trigger ends the wait
	phaseRun            // running fn: a trigger sends the server a cancel
	phaseDone           // fn returned: triggers do nothing
)

// call is one Run from its start to its return.
type call struct {
	t   *Tracker
	idx int // in t.calls, guarded by t.mu

	kind   string
	ctx    context.Context
	conn   Conn
	cancel context.CancelFunc // ends the call's own context: the acquire, or the driver gives up

	timer    *time.Timer   // the time limit, then the last resort; made once per call struct
	onCtxFn  func()        // c.onCtx, bound once
	armed    bool          // timer set for this call
	runLimit time.Duration // RunWaiting: the statement's limit, from the moment it has a connection
	ctxStop  func() bool   // the AfterFunc of the caller's context, when it can end
	sending  sync.WaitGroup
	sent     atomic.Bool // the cancel request went out
	closes   atomic.Bool // the driver closes the connection after it
	mu       sync.Mutex  // guards phase, reason, lastResort
	phase    int
	reason   error // why the call was triggered: ctx's cause, ErrLimit or ErrStopped
	resorted bool  // the timer is past the limit: its next firing is the last resort
}

// NewTracker returns a Tracker of statements on pool.
func NewTracker(pool Pool) *Tracker {
	return &Tracker{pool: pool, stopCh: make(chan struct{})}
}

// Cause of a statement cancelled by Run, as its error wraps it.
var (
	// ErrLimit says that a statement ran past its time limit and was cancelled on the server.
	ErrLimit = errors.New("dbx: the statement ran past its time limit and was cancelled on the server")
)

// errAcquireLimit is the error of a call whose time limit passed before it had a connection.
var errAcquireLimit = fmt.Errorf("dbx: no connection within the statement's time limit: %w", context.DeadlineExceeded)

// Run takes a connection from the pool and runs fn on it, with a context that keeps ctx's
// values but not its cancellation. The acquire is bounded by ctx, by limit and by Stop. When
// ctx ends, limit passes or the tracker stops while fn runs, a cancel request is sent for the
// connection's backend and Run waits for fn to return the server's answer; the error then
// wraps the reason (ctx's cause, ErrLimit or ErrStopped) and the server's error. fn must read
// every row it asks for before it returns. kind names the statement in Stop's counts. The
// limit counts from Run's start, the wait for a connection included; a limit of 0 or less
// sets no time limit: ctx and Stop bound the statement. q is the connection itself: fn may
// run a transaction on it (q is a Beginner too); a cancel reaches whichever of its statements
// is running, and a statement that starts after the cancel was sent is not cancelled again.
func (t *Tracker) Run(ctx context.Context, kind string, limit time.Duration, fn func(ctx context.Context, q Querier) error) error {
	return t.run(ctx, kind, limit, 0, fn, nil)
}

// RunWaiting is Run whose wait for a connection and statement have limits of their own: it
// waits up to wait for a connection, then gives the statement limit from the moment it has
// one. A caller that may wait longer for a connection than for its statement (a busy pool
// hands connections out in turn, and a wait given up and begun again goes to the back) keeps
// its place; a statement stuck on a connection is still cancelled after limit and may be tried
// again on another. wait and limit must be positive.
func (t *Tracker) RunWaiting(ctx context.Context, kind string, wait, limit time.Duration, fn func(ctx context.Context, q Querier) error) error {
	return t.run(ctx, kind, wait, limit, fn, nil)
}

// RunConn is Run for an fn that needs the connection itself (its backend's PID); fn must not
// Release, Destroy or Cancel it.
func (t *Tracker) RunConn(ctx context.Context, kind string, limit time.Duration, fn func(ctx context.Context, c Conn) error) error {
	return t.run(ctx, kind, limit, 0, nil, fn)
}

// run: limit bounds the call from its start; runLimit, when positive, bounds the statement
// from the moment it has a connection instead.
func (t *Tracker) run(ctx context.Context, kind string, limit, runLimit time.Duration, fnq func(context.Context, Querier) error, fnc func(context.Context, Conn) error) error {
	c, _ := t.free.Get().(*call)
	if c == nil {
		c = &call{t: t}
		c.onCtxFn = c.onCtx
	}
	c.kind, c.ctx, c.phase, c.runLimit = kind, ctx, phaseAcquire, runLimit

	// One context serves the acquire and the statement: it keeps ctx's values, and only the
	// call ends it (a trigger while it waits for a connection, or the last resort).
	var cctx context.Context
	if ctx.Done() == nil {
		cctx, c.cancel = context.WithCancel(ctx)
	} else {
		cctx, c.cancel = context.WithCancel(context.WithoutCancel(ctx))
	}

	t.mu.Lock()
	if t.stopped {
		t.mu.Unlock()
		c.cancel()
		t.recycle(c)
		return ErrStopped
	}
	if err := ctx.Err(); err != nil {
		t.mu.Unlock()
		c.cancel()
		t.recycle(c)
		return err
	}
	c.idx = len(t.calls)
	t.calls = append(t.calls, c)
	t.wg.Add(1)
	t.mu.Unlock()

	if limit > 0 {
		c.armed = true
		if c.timer == nil {
			c.mu.Lock() // onTimer reads it under c.mu: it may fire before this returns
			c.timer = time.AfterFunc(limit, c.onTimer)
			c.mu.Unlock()
		} else {
			c.timer.Reset(limit)
		}
	}
	if ctx.Done() != nil {
		c.ctxStop = context.AfterFunc(ctx, c.onCtxFn)
	}

	conn, err := t.pool.Acquire(cctx)
	c.mu.Lock()
	reason := c.reason
	if reason == nil && err == nil {
		c.conn = conn
		c.phase = phaseRun
		// RunWaiting: the statement's own limit starts now. A timer that has fired already
		// (its onTimer waits for c.mu) cancels the statement as soon as it starts.
		if c.runLimit > 0 && c.armed && !c.resorted && c.timer.Stop() {
			c.timer.Reset(c.runLimit)
		}
	} else {
		c.phase = phaseDone
	}
	c.mu.Unlock()
	switch {
	case reason != nil:
		// Triggered while it waited: whatever the acquire returned, the call ends here.
		if err == nil {
			conn.Release()
		}
		switch {
		case reason == ErrStopped:
			err = ErrStopped
		case reason == ErrLimit:
			err = errAcquireLimit
		default:
			err = ctx.Err()
		}
		return t.finish(c, err)
	case err != nil:
		return t.finish(c, err)
	}

	// fn's context ends only as the last resort, for a server that answers neither the
	// statement nor its cancel (a dead network): CleanupTimeout past the limit, or when Stop
	// gives up on it. The driver then closes the connection.
	if fnq != nil {
		err = fnq(cctx, conn)
	} else {
		err = fnc(cctx, conn)
	}

	c.mu.Lock()
	c.phase = phaseDone
	reason = c.reason
	c.mu.Unlock()
	c.sending.Wait()

	switch {
	case reason == nil:
		if err != nil && cctx.Err() != nil {
			t.destroy(conn)
		} else {
			conn.Release()
		}
	case err != nil && SQLState(err) == CodeQueryCanceled:
		t.count(kind)
		if c.closes.Load() {
			t.destroy(conn)
		} else {
			conn.Release()
		}
		err = errors.Join(reason, err)
	case !c.sent.Load():
		// The cancel could not be sent: the statement ended on its own.
		t.destroy(conn)
	default:
		// The statement ended before the cancel arrived: a cancel may still be pending for
		// the connection's next statement, so the connection goes.
		t.destroy(conn)
		if err != nil && c.closes.Load() && SQLState(err) == "" {
			// A driver that gives the statement up on its side reports that without the
			// server's word (lib/pq: driver.ErrBadConn when the cancel beat the statement
			// out): the call ended for its reason.
			err = errors.Join(reason, err)
		}
	}
	return t.finish(c, err)
}

// finish takes c out of the tracker's list and stops its watchers; c is reused when none of
// them fired (a watcher that fired may still hold it).
func (t *Tracker) finish(c *call, err error) error {
	untouched := c.reason == nil // phaseDone: nothing sets it any more
	if c.armed {
		untouched = c.timer.Stop() && untouched
	}
	if c.ctxStop != nil {
		untouched = c.ctxStop() && untouched
	}
	c.cancel()

	t.mu.Lock()
	last := t.calls[len(t.calls)-1]
	last.idx = c.idx
	t.calls[c.idx] = last
	t.calls[len(t.calls)-1] = nil
	t.calls = t.calls[:len(t.calls)-1]
	t.mu.Unlock()
	t.wg.Done()

	if untouched {
		t.recycle(c)
	}
	return err
}

func (t *Tracker) recycle(c *call) {
	c.ctx, c.conn, c.cancel, c.ctxStop, c.armed, c.runLimit = nil, nil, nil, nil, false, 0
	c.reason, c.resorted = nil, false
	c.sent.Store(false)
	c.closes.Store(false)
	t.free.Put(c)
}

func (c *call) onCtx() { c.trigger(context.Cause(c.ctx)) }

// onTimer fires at the call's limit, and again CleanupTimeout later (the last resort).
func (c *call) onTimer() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.phase == phaseDone {
		return
	}
	if c.resorted {
		c.cancel()
		return
	}
	c.resorted = true
	c.timer.Reset(CleanupTimeout)
	c.triggerLocked(ErrLimit)
}

// trigger ends c's wait for a connection, or sends the server a cancel of its statement; the
// first reason is the one its error gives.
func (c *call) trigger(why error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.triggerLocked(why)
}

func (c *call) triggerLocked(why error) {
	if c.reason != nil || c.phase == phaseDone {
		return
	}
	c.reason = why
	if c.phase == phaseAcquire {
		c.cancel()
		return
	}
	c.sending.Add(1)
	go func(conn Conn) {
		defer c.sending.Done()
		cctx, ccancel := CleanupContext(context.Background())
		defer ccancel()
		closes, err := conn.Cancel(cctx)
		if err == nil {
			c.sent.Store(true)
			c.closes.Store(closes)
		}
	}(c.conn)
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
func (t *Tracker) Stopping() <-chan struct{} { return t.stopCh }

func (t *Tracker) count(kind string) {
	v, _ := t.cancelled.LoadOrStore(kind, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

// Running is the number of statements running now.
func (t *Tracker) Running() int { return t.inPhase(phaseRun) }

// Acquiring is the number of statements waiting for a connection now.
func (t *Tracker) Acquiring() int { return t.inPhase(phaseAcquire) }

func (t *Tracker) inPhase(phase int) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, c := range t.calls {
		c.mu.Lock()
		if c.phase == phase {
			n++
		}
		c.mu.Unlock()
	}
	return n
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
	if !t.stopped {
		t.stopped = true
		close(t.stopCh)
	}
	for _, c := range t.calls {
		c.trigger(ErrStopped)
	}
	t.mu.Unlock()

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
	for _, c := range t.calls {
		c.mu.Lock()
		if c.phase == phaseRun {
			res.Abandoned[c.kind]++
		}
		c.cancel()
		c.mu.Unlock()
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
