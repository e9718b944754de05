package sqlbroker

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// notifier debounces the NOTIFYs of a pool publisher, per messages table: NOTIFY takes a lock
// shared by the whole cluster at commit, so a busy topic notifies at most once per debounce.
// A publish within the debounce of the last NOTIFY sends none from its own statement, and a
// trailing one follows at most debounce after the last (a timer per table). A NOTIFY is only
// a latency aid: subscribers poll as well.
type notifier struct {
	debounce time.Duration
	send     func(ctx context.Context, table string) // sends one NOTIFY of table

	// timers counts the trailing NOTIFYs scheduled and not yet over (stopped before they
	// fired, or done); once closed is set, no timer is scheduled any more.
	mu     sync.Mutex
	last   map[string]time.Time
	timers map[string]*time.Timer
	closed bool
	wg     sync.WaitGroup
}

func newNotifier(debounce time.Duration, send func(ctx context.Context, table string)) *notifier {
	return &notifier{debounce: debounce, send: send, last: map[string]time.Time{}, timers: map[string]*time.Timer{}}
}

// inline reports whether a publish to table should send its NOTIFY from its own statement:
// false when one went out less than debounce ago (later then sends the trailing one).
func (n *notifier) inline(table string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	now := time.Now()
	if now.Sub(n.last[table]) < n.debounce {
		return false
	}
	n.last[table] = now
	return true
}

// later makes sure a NOTIFY of table follows a publish that did not send one, at most
// debounce after the last one. Once Close has begun, the publish sends it itself (the
// publisher's shutdown waits for the publishes running, and so for it).
func (n *notifier) later(table string) {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		n.send(context.Background(), table)
		return
	}
	defer n.mu.Unlock()
	if n.timers[table] != nil {
		return
	}
	wait := max(n.debounce-time.Since(n.last[table]), 0)
	n.wg.Add(1)
	n.timers[table] = time.AfterFunc(wait, func() {
		defer n.wg.Done()
		n.mu.Lock()
		delete(n.timers, table)
		n.last[table] = time.Now()
		n.mu.Unlock()
		n.send(context.Background(), table)
	})
}

// Close schedules no timer any more and sends now, bounded by ctx, the trailing NOTIFYs
// still due. It does not wait for those already firing: wait does.
func (n *notifier) Close(ctx context.Context) {
	var due []string
	n.mu.Lock()
	n.closed = true
	for table, t := range n.timers {
		if t.Stop() {
			due = append(due, table)
			n.wg.Done()
		}
		delete(n.timers, table)
	}
	n.mu.Unlock()
	for _, table := range due {
		n.send(ctx, table)
	}
}

// wait returns once every trailing NOTIFY that fired has been sent (or has failed).
func (n *notifier) wait() { n.wg.Wait() }

// notifyChannel returns the NOTIFY channel when this publish to table should wake the
// topic's subscribers in other processes from its own statement, or "" when it should not:
// notifications are off, or the debounce holds it back (see notifier). Inside a caller's
// transaction it always notifies: the commit is the caller's.
func (p *Publisher) notifyChannel(table string) string {
	switch {
	case p.config.DisableNotify:
		return ""
	case p.db.tx != nil:
		return listen.Channel
	case p.notifier.inline(table):
		return listen.Channel
	}
	return ""
}

// notify sends a NOTIFY of table through the tracker, bounded by ctx and CleanupTimeout; a
// failure only delays the subscribers of other processes until their next poll.
func (p *Publisher) notify(ctx context.Context, table string) {
	err := p.run(ctx, stmtNotify, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		return offsets.NotifyTable(ctx, q, listen.Channel, table)
	})
	if err != nil && !errors.Is(err, dbx.ErrStopped) {
		p.logger.Debug("NOTIFY failed; subscribers will poll", watermill.LogFields{"err": err})
	}
}
