package sqlbroker

// ConsumerGroup is the consumer group the subscriber claims for (after defaults).
func (s *Subscriber) ConsumerGroup() string { return s.config.ConsumerGroup }

// ClaimMode is the subscriber's claim mode.
func (s *Subscriber) ClaimMode() ClaimMode { return s.config.ClaimMode }
