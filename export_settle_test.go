package sqlbroker

// SettleQueued is the number of acks and nacks of s's subscriptions waiting for their
// settlers.
func SettleQueued(s *Subscriber) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for sub := range s.subs {
		n += len(sub.settler.queue)
	}
	return n
}
