package dbx

import (
	"context"
	"time"
)

// RunOn runs fn, statements on conn, with Run's cancel-and-wait, for a connection the caller
// holds and keeps: a dedicated one whose session state (advisory locks) must outlive a
// cancel. A Tracker cannot run those: it takes its connections from its pool, and closes one
// whose cancel came too late, as a cancel still pending may hit its next statement.
//
// When ctx ends while fn runs, a cancel request is sent for conn's backend, as Run's trigger
// sends it, and RunOn returns only once fn has returned the server's answer. The first
// request may reach the server before fn's statement does (a cancel meeting an idle backend
// does nothing), so it is sent again every repeat until fn returns, one request at a time.
// cancelled reports that the server ended a statement of fn on such a request: err is then
// the server's error. RunOn never releases nor closes conn; a request that arrives after fn's
// statement ended may still cancel the next statement on conn, which the caller must expect.
// When ctx has ended already, fn does not run and RunOn returns ctx's cause.
func RunOn(ctx context.Context, conn Conn, repeat time.Duration, fn func() error) (cancelled bool, err error) {
	if ctx.Done() == nil {
		return false, fn()
	}
	if ctx.Err() != nil {
		return false, context.Cause(ctx)
	}
	c := &call{ctx: ctx, conn: conn, phase: phaseRun, cancel: func() {}}
	finished, loopDone := make(chan struct{}), make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(loopDone)
		c.onCtx()
		t := time.NewTicker(repeat)
		defer t.Stop()
		for {
			c.sending.Wait() // one request at a time: the one before has been answered
			select {
			case <-finished:
				return
			case <-t.C:
			}
			c.again()
		}
	})
	err = fn()
	close(finished)
	if !stop() {
		<-loopDone
	}
	c.mu.Lock()
	c.phase = phaseDone
	c.mu.Unlock()
	c.sending.Wait()
	return err != nil && c.sent.Load() && SQLState(err) == CodeQueryCanceled, err
}

// again sends c's cancel request once more while its statement runs (triggerLocked sends
// one for the first reason only).
func (c *call) again() {
	c.mu.Lock()
	defer c.mu.Unlock()
	why := c.reason
	if why == nil || c.phase == phaseDone {
		return
	}
	c.reason = nil
	c.triggerLocked(why)
}
