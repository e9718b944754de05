package sqlbroker

import "context"

// deliveryKey is the context key of the delivery a message's context belongs to.
type deliveryKey struct{}

// AttemptFromContext returns the delivery attempt of the message whose context ctx is
// (msg.Context()), as MetadataAttempt holds it: 1 the first time, one more each time it was
// claimed again. Unlike the metadata, which is copied with the message into anything
// republished from it (a poison queue, a forwarder), the context belongs to this delivery
// only. ok is false for a context that is not a delivered message's.
func AttemptFromContext(ctx context.Context) (attempt int, ok bool) {
	d, _ := ctx.Value(deliveryKey{}).(*delivery)
	if d == nil {
		return 0, false
	}
	return d.attempts, true
}

// OffsetFromContext returns the offset in its topic of the message whose context ctx is, as
// MetadataOffset holds it (see AttemptFromContext).
func OffsetFromContext(ctx context.Context) (offset int64, ok bool) {
	d, _ := ctx.Value(deliveryKey{}).(*delivery)
	if d == nil {
		return 0, false
	}
	return d.offset, true
}

// TopicFromContext returns the topic of the message whose context ctx is (see
// AttemptFromContext).
func TopicFromContext(ctx context.Context) (topic string, ok bool) {
	d, _ := ctx.Value(deliveryKey{}).(*delivery)
	if d == nil {
		return "", false
	}
	return d.sub.store.T.Topic, true
}
