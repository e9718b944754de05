package sqlbroker

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// The NOTIFY debouncer lets one NOTIFY per table through inline within its debounce, schedules one
// trailing NOTIFY per table however many publishes ask, sends the one still due at Close,
// and after Close leaves the publish to send its own.
func TestNotify_debouncerCloseSendsWhatIsDue(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var sent []string
	n := newNotifier(time.Hour, func(_ context.Context, table string) {
		mu.Lock()
		sent = append(sent, table)
		mu.Unlock()
	})
	sentNow := func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), sent...)
	}

	assert.True(t, n.inline("a"))
	assert.False(t, n.inline("a"), "within the debounce")
	assert.True(t, n.inline("b"), "another table")
	n.later("a")
	n.later("a")
	assert.Empty(t, sentNow(), "the trailing NOTIFY waits for the debounce")

	n.Close(context.Background())
	assert.Equal(t, []string{"a"}, sentNow(), "the one trailing NOTIFY due, sent at Close")
	n.later("b")
	assert.Equal(t, []string{"a", "b"}, sentNow(), "after Close, the publish sends its own")
	n.wait()
}

// A trailing NOTIFY fires at most the debounce after the last one.
func TestNotify_debouncerTrailingNotifyFires(t *testing.T) {
	t.Parallel()
	fired := make(chan string, 2)
	n := newNotifier(10*time.Millisecond, func(_ context.Context, table string) { fired <- table })
	assert.True(t, n.inline("a"))
	n.later("a")
	assert.Equal(t, "a", <-fired)
	n.Close(context.Background())
	n.wait()
	assert.Empty(t, fired)
}
