package sqlbroker

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/wake"
)

// Metadata keys of a message that SubscriberConfig.MaxAttempts moved to a dead-letter topic.
// The copy keeps the message's UUID, payload and metadata, without the keys of its last
// delivery (MetadataAttempt, MetadataOffset); its deliveries from the dead-letter topic carry
// their own.
const (
	// MetadataDeadLetterTopic is the topic the message was moved from.
	MetadataDeadLetterTopic = offsets.MetaDeadLetterTopic
	// MetadataDeadLetterGroup is the consumer group that gave up on it.
	MetadataDeadLetterGroup = offsets.MetaDeadLetterGroup
	// MetadataDeadLetterAttempts is the number of its attempts in that group.
	MetadataDeadLetterAttempts = offsets.MetaDeadLetterAttempts
	// MetadataDeadLetterOffset is its offset in the topic it was moved from.
	MetadataDeadLetterOffset = offsets.MetaDeadLetterOffset
)

// deadLetterWait marks, among the waits of nacks (nackWaits), a message to move to the
// dead-letter topic rather than give back.
const deadLetterWait time.Duration = -1

// deadLetterTopic is the dead-letter topic of topic: DeadLetterTopic, or topic followed by
// DefaultDeadLetterSuffix.
func (c *SubscriberConfig) deadLetterTopic(topic string) (string, error) {
	name := c.DeadLetterTopic
	if name == "" {
		name = topic + DefaultDeadLetterSuffix
	}
	if err := validateName("DeadLetterTopic", name); err != nil {
		return "", err
	}
	if name == topic {
		return "", &ConfigError{Field: "DeadLetterTopic", Value: name, Reason: "must not be the subscribed topic"}
	}
	return name, nil
}

// deadLetterStore returns the store of topic's dead-letter topic, its tables created or
// checked, or nil without MaxAttempts.
func (s *Subscriber) deadLetterStore(ctx context.Context, pool dbx.Beginner, q dbx.Querier, topic string) (*offsets.Store, error) {
	if s.config.MaxAttempts == 0 {
		return nil, nil
	}
	name, err := s.config.deadLetterTopic(topic)
	if err != nil {
		return nil, err
	}
	return s.stores.store(ctx, pool, q, name, s.config.InitializeSchema)
}

// overAttempts reports whether the delivery d must go to the dead-letter topic rather than
// back to the group after a nack: its attempt was the MaxAttempts-th, or a later one (a
// message whose leases were lost, claimed again after its last attempt).
func (st *settler) overAttempts(d *delivery) bool {
	return st.dlq != nil && d.attempts >= st.sub.cfg.MaxAttempts
}

// deadOnArrival queues for the dead-letter topic a message claimed again after its last
// attempt (its earlier deliveries lost their claims, their handlers never settled it): it is
// not handed to a handler. It goes through the settler like a nack, which moves it
// (nackWaits); in advisory mode its lock is dropped afterwards, as for any settlement.
func (sub *subscription) deadOnArrival(d *delivery) {
	if !sub.mode.beginSettle() {
		sub.forget(d)
		return
	}
	sub.work.settling(d)
	sub.logger.Info("Message claimed again after its last attempt; moving it to the dead-letter topic",
		watermill.LogFields{"offset": d.offset, "attempt": d.attempts, "dead_letter_topic": sub.settler.dlq.T.Topic})
	sub.settler.enqueue(d, opNack)
}

// deadLetter moves the fenced claims fs to the dead-letter topic in one statement, and wakes
// the dead-letter topic's subscribers.
func (st *settler) deadLetter(fs []offsets.Fenced) (map[int64]bool, error) {
	sub, dlq := st.sub, st.dlq
	var done map[int64]bool
	err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtNack, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		var err error
		done, err = sub.store.DeadLetter(ctx, q, sub.groupID, sub.cfg.ConsumerGroup, fs, dlq, [2]string{MetadataAttempt, MetadataOffset})
		if err != nil && dlq.NoPartition(err) {
			// The dead-letter topic's partitions ran out (see Publisher.write): add them and
			// move the claims once more.
			if err := dlq.AddPartitions(ctx, q, len(fs)); err != nil {
				return err
			}
			done, err = sub.store.DeadLetter(ctx, q, sub.groupID, sub.cfg.ConsumerGroup, fs, dlq, [2]string{MetadataAttempt, MetadataOffset})
		}
		return err
	})
	if err != nil || len(done) == 0 {
		return done, err
	}
	sub.s.stats.deadLettered.Add(int64(len(done)))
	if sub.cfg.OrderByKey {
		sub.claimer.markDue(time.Now()) // the next message of each key moved may go now
	}
	sub.logger.Info("Moved messages to the dead-letter topic", watermill.LogFields{"count": len(done), "dead_letter_topic": dlq.T.Topic})
	wake.Notify(dlq.T.Messages)
	_ = sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtNack, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		return dlq.Notify(ctx, q, listen.Channel) // a lost one costs a poll elsewhere
	})
	return done, nil
}
