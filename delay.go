package sqlbroker

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// Delayed messages. Watermill's components/delay (delay.NewPublisher, delay.Message,
// middleware.DelayOnError) marks a message with the time it is delayed until, in the metadata
// key delay.DelayedUntilKey (RFC 3339, whole seconds), and with the delay itself in
// delay.DelayedForKey. The Publisher writes that time into the message's row, and no consumer
// group is handed the message before it; a Nack of a message whose handler delayed it (as
// DelayOnError does) makes it wait until then instead of the nack backoff.

// delayedUntil returns the time md delays its message until, read at now, and whether that
// time is still to come. The RFC 3339 time of the metadata is cut to the second. With the
// delay itself (delay.DelayedForKey) beside it, the time the delay was set for is known to lie
// within that second and no later than now plus the delay, and the earlier of the two bounds
// is taken: a message delayed by 3 s is then never delivered before 3 s have passed, and at
// most the rest of a second late when it was published well after it was delayed (a message
// republished long after its time is not delayed again: that time has passed). An unreadable
// time is an error.
func delayedUntil(md message.Metadata, now time.Time) (time.Time, bool, error) {
	v := md.Get(delay.DelayedUntilKey)
	if v == "" {
		return time.Time{}, false, nil
	}
	until, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return time.Time{}, false, fmt.Errorf("metadata %s %q is not an RFC 3339 time", delay.DelayedUntilKey, v)
	}
	if d, err := time.ParseDuration(md.Get(delay.DelayedForKey)); err == nil && d > 0 && until.Nanosecond() == 0 {
		// The time the delay was set for lies in [until, until+1s), and is no later than fine:
		// the delay was set before now. The earlier of fine and the end of that second is
		// never before it.
		if fine := now.Add(d); !fine.Before(until) {
			until = minTime(fine, until.Add(time.Second))
		}
	}
	return until, until.After(now), nil
}

// passDelayed drops from cs, the result of a claim statement, the delayed messages it passed
// (offsets.Claimed.Delayed). Their claim rows come due at their times, which the claim loop
// is told (markDue) when the statement succeeded (err nil), so that its claims then take
// them, each at its own time; and it counts them (passed), so that the claim loop claims
// again at once: the claim's room went to them, and the messages behind may be waiting.
func (sub *subscription) passDelayed(cs []offsets.Claimed, err error) []offsets.Claimed {
	cs, delayed := offsets.TakeDelayed(cs)
	if err == nil {
		for _, at := range delayed {
			sub.claimer.markDue(at)
		}
		sub.claimer.passed.Add(int32(len(delayed)))
	}
	return cs
}

// passAfterPassing is how many delayed messages a claim may pass besides its room when the
// claim before it passed some: a run of delayed messages ahead of the next message to hand out
// is then passed in a few claims, not one claim per BatchSize of them (with MaxInFlight 1, one
// per message).
const passAfterPassing = 1000

// untilDue is how long the claim loop waits when a claim found nothing: idle, or less when a
// claim of this subscription comes due before (a nack's backoff ends, a delayed message's time
// comes).
func (sub *subscription) untilDue(idle time.Duration) time.Duration {
	at := sub.claimer.dueAt.first()
	if at == 0 {
		return idle
	}
	return max(0, min(idle, time.Until(time.Unix(0, at))))
}

// maxDueTimes bounds the due times a subscription keeps. Past it the latest are dropped: the
// claims they were for are found by the periodic and idle looks instead (IdlePollInterval).
const maxDueTimes = 4096

// dueTimes are the times, in Unix nanoseconds, at which claims of the subscription come due
// again: the end of a nack's backoff, a lease lost, and the time of every delayed message its
// claims passed. The claim loop claims at each (wantDue takes those that have come), so that
// every delayed message it passed is taken at its own time, not only the earliest.
type dueTimes struct {
	mu   sync.Mutex
	at   []int64      // ascending, distinct, at most maxDueTimes
	head atomic.Int64 // at[0], or 0 when at is empty: read without the lock
}

// add notes t, and reports whether it is now the earliest.
func (d *dueTimes) add(t int64) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	i, found := slices.BinarySearch(d.at, t)
	if found {
		return false
	}
	if len(d.at) == maxDueTimes {
		if i == len(d.at) {
			return false
		}
		d.at = d.at[:len(d.at)-1]
	}
	d.at = slices.Insert(d.at, i, t)
	d.head.Store(d.at[0])
	return i == 0
}

// first returns the earliest time, or 0 if there is none.
func (d *dueTimes) first() int64 { return d.head.Load() }

// take drops the times up to now and reports whether there were any.
func (d *dueTimes) take(now int64) bool {
	if h := d.head.Load(); h == 0 || h > now {
		return false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	i := 0
	for i < len(d.at) && d.at[i] <= now {
		i++
	}
	if i == 0 {
		return false
	}
	d.at = slices.Delete(d.at, 0, i)
	if len(d.at) == 0 {
		d.at = nil
		d.head.Store(0)
	} else {
		d.head.Store(d.at[0])
	}
	return true
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
