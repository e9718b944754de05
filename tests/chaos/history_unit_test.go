package chaos

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// A duplicate whose later handling is the faulty one: c2 held the message through a freeze
// past its lease, another consumer handled it meanwhile, and c2's handler ran on once the
// process woke up; c2's ack was refused. The duplicate is explained by the later handling,
// and a duplicate with no fault on either side is not.
func TestHistory_duplicateExplainedByLaterHandling(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	c := &checker{
		faults: []fault{{Kind: faultFreeze, Procs: []string{"c2"}, Start: at(100), End: at(3100)}},
		events: []event{{Proc: "c2", Kind: evRefused, Offset: 7, Op: "ack", Began: at(90).UnixNano(), At: at(3120).UnixNano()}},
		lease: func(string) (time.Duration, time.Duration, bool) {
			return 2 * time.Second, 666 * time.Millisecond, false
		},
	}
	first := resultRow{UUID: "u", Consumer: "c1", Attempt: 2, Kind: "done", At: at(2300), Off: 7}
	later := resultRow{UUID: "u", Consumer: "c2", Attempt: 1, Kind: "done", At: at(3110), Off: 7}
	why, ok := c.duplicate(first, later)
	assert.True(t, ok, "a duplicate by a consumer frozen past its lease left unexplained")
	assert.True(t, strings.HasPrefix(why, "the later handling's "), why)

	other := resultRow{UUID: "u", Consumer: "c3", Attempt: 1, Kind: "done", At: at(3110), Off: 7}
	_, ok = c.duplicate(first, other)
	assert.False(t, ok, "a duplicate with no fault on either side explained")
}

// A nack queued behind a table lock held past the lease is refused once the lock goes, after
// the same process took the message again and its new delivery's handler began: the process
// keeps one handler start an offset, the new one's, and the refusal is explained by the loss
// of the claim it settled, logged before the new delivery began. A refusal that does not say
// its claim was lost is not explained by that older loss.
func TestHistory_refusalOfEarlierDeliveryOfSameProcess(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	at := func(ms int) int64 { return t0.Add(time.Duration(ms) * time.Millisecond).UnixNano() }
	lost := event{Proc: "c2", Kind: evLeaseLost, Offset: 447, Began: at(0), At: at(2200)}
	refused := event{Proc: "c2", Kind: evRefused, Offset: 447, Op: "nack", LostBefore: true, Began: at(2289), At: at(2291)}
	c := &checker{
		faults: []fault{{Kind: faultStopLock, Procs: []string{"c1"}, Start: t0.Add(260 * time.Millisecond), End: t0.Add(2287 * time.Millisecond)}},
		events: []event{lost, refused},
		lease: func(string) (time.Duration, time.Duration, bool) {
			return 2 * time.Second, 666 * time.Millisecond, false
		},
	}
	why, ok := c.refusal(refused)
	assert.True(t, ok, "the refused nack of a delivery lost under a table lock left unexplained")
	assert.True(t, strings.HasPrefix(why, "claim lost before: lease ran out under a stoplock"), why)

	notLost := refused
	notLost.LostBefore = false
	_, ok = c.refusal(notLost)
	assert.False(t, ok, "a refusal of a claim not lost explained by the loss of an earlier delivery")
}

// A consumer killed while its handler recorded the message: the database ran the insert after
// the process died, after the next delivery's handling was recorded. Taken by attempt, the
// killed handling comes first and its kill explains the duplicate; a kill of the consumer of
// the later delivery explains nothing.
func TestHistory_duplicateOfKilledHandlingRecordedLate(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	c := &checker{
		faults: []fault{{Kind: faultKill, Procs: []string{"c2"}, Start: at(186), End: at(186)}},
		lease: func(string) (time.Duration, time.Duration, bool) {
			return 2 * time.Second, 666 * time.Millisecond, true
		},
	}
	rs := []resultRow{ // as read, by time of record
		{UUID: "u", Consumer: "c0", Attempt: 4, Kind: "done", At: at(251), Off: 539},
		{UUID: "u", Consumer: "c2", Attempt: 3, Kind: "done", At: at(256), Off: 539},
	}
	_, ok := c.duplicate(rs[0], rs[1])
	assert.False(t, ok, "taken by time, the killed handling should have been the later one")
	orderHandlings(rs)
	why, ok := c.duplicate(rs[0], rs[1])
	assert.True(t, ok, "a duplicate after a kill during the handling left unexplained")
	assert.Equal(t, "killed before its ack applied", why)

	// The same kill, but of the consumer of the later delivery: not an explanation.
	rs = []resultRow{
		{UUID: "u", Consumer: "c0", Attempt: 3, Kind: "done", At: at(251), Off: 539},
		{UUID: "u", Consumer: "c2", Attempt: 4, Kind: "done", At: at(256), Off: 539},
	}
	orderHandlings(rs)
	_, ok = c.duplicate(rs[0], rs[1])
	assert.False(t, ok, "a kill of the later delivery's consumer explained the duplicate")
}
