package sqlbroker

import (
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// QueuedCalls is the number of grouped Publish calls of p waiting for topic's next statement.
func QueuedCalls(p *Publisher, topic string) int {
	table := tablesOn(p.db.dialect(), p.config.Schema, p.config.TablePrefix, topic).Messages
	return p.grouped.queued(table)
}

// PublisherClosed reports whether Close (or the broker's shutdown) has begun on p.
func PublisherClosed(p *Publisher) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// BrokerPublishers is the number of publishers b keeps for its shutdown.
func BrokerPublishers(b *Broker) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.publishers)
}

// NackBackoffFor is the wait of a message nacked at its attempt-th delivery under c (with its
// defaults set).
func NackBackoffFor(c SubscriberConfig, attempt int) time.Duration {
	c.setDefaults()
	return c.nackBackoff(attempt)
}

// DelayedUntil is the time a message's delay metadata holds it until, read at now.
var DelayedUntil = delayedUntil

// PublisherRunning is the number of statements of p running now.
func PublisherRunning(p *Publisher) int {
	if p.tracker == nil {
		return 0
	}
	return p.tracker.Running()
}

// SubscriberRunning is the number of statements of s running now.
func SubscriberRunning(s *Subscriber) int { return s.tracker.Running() }

// SubscriberAcquiring is the number of the subscriber's statements waiting for a connection.
func SubscriberAcquiring(s *Subscriber) int { return s.tracker.Acquiring() }

// SQLiteGatePaths lists the database files whose write gates the process keeps.
var SQLiteGatePaths = dbx.SQLiteGatePaths

// SQLiteReadyConns counts the connections db (a DB of SQLite) remembers as set up.
func SQLiteReadyConns(db DB) int { return db.pool.(*dbx.SQLitePool).ReadyConns() }

// SQLiteMaxReady bounds SQLiteReadyConns.
const SQLiteMaxReady = dbx.SQLiteMaxReady

// BrokerPrepares reports whether b's pool prepares the library's statements per connection.
func BrokerPrepares(b *Broker) bool {
	p, ok := b.pool.(*dbx.StdPool)
	return ok && p.Prepared()
}
