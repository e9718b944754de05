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
