// Package wake lets a publisher in this process wake the subscriptions of a topic at once,
// instead of leaving them to their next poll.
package wake

import "sync"

var (
	mu   sync.Mutex
	subs = map[string]map[chan struct{}]struct{}{}
)

// Register returns a channel that receives a signal (coalesced) whenever Notify(key) is called,
// and a function that unregisters it.
func Register(key string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	mu.Lock()
	m := subs[key]
	if m == nil {
		m = map[chan struct{}]struct{}{}
		subs[key] = m
	}
	m[ch] = struct{}{}
	mu.Unlock()
	return ch, func() {
		mu.Lock()
		delete(subs[key], ch)
		if len(subs[key]) == 0 {
			delete(subs, key)
		}
		mu.Unlock()
	}
}

// Notify signals every channel registered for key, without blocking.
func Notify(key string) {
	mu.Lock()
	for ch := range subs[key] {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
	mu.Unlock()
}

// NotifyAll signals every registered channel.
func NotifyAll() {
	mu.Lock()
	for _, m := range subs {
		for ch := range m {
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}
	mu.Unlock()
}
