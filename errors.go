package sqlbroker

import (
	"errors"
	"fmt"

	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
	"github.com/sqlbroker/watermill-sqlbroker/offsets"
)

// ErrClosed is returned by Publish and Subscribe after Close or Shutdown, and is the cause of
// the contexts the library cancels when it shuts down. Match it with errors.Is.
var ErrClosed = errors.New("sqlbroker: closed")

// ErrLeaseLost is the cause of a message context cancelled because the delivery lost its
// claim: its lease could not be extended in time, or another consumer holds the message now
// (L4). Read it with context.Cause(msg.Context()).
var ErrLeaseLost = errors.New("sqlbroker: claim lost, the message may be redelivered to another consumer")

// StaleSettlementError is logged when an ack or nack arrives for a claim that is no longer this
// delivery's: its lease ran out and the message was claimed again (L3). The settlement was not
// applied; the message is or will be delivered again.
type StaleSettlementError struct {
	Topic         string
	ConsumerGroup string
	Offset        int64
	Op            string // "ack" or "nack"
}

func (e *StaleSettlementError) Error() string {
	return fmt.Sprintf("sqlbroker: stale %s refused: topic %q, consumer group %q, offset %d: the claim is no longer held by this delivery",
		e.Op, e.Topic, e.ConsumerGroup, e.Offset)
}

// NameError says which topic, consumer group or identifier was refused and why (M6).
type NameError = ident.NameError

// MissingTableError says that a table of a topic does not exist and how to create it (M7).
type MissingTableError = offsets.MissingTableError

// SchemaVersionError says that a topic's tables were created by another schema version.
type SchemaVersionError = offsets.VersionError

// ConfigError names a configuration field, its value and the bound it broke.
type ConfigError struct {
	Field  string
	Value  any
	Reason string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("sqlbroker: %s (%v) %s", e.Field, e.Value, e.Reason)
}

// PublishError names the message of a Publish call that was refused before anything was
// written.
type PublishError struct {
	Topic  string
	Index  int    // position of the message in the Publish call
	UUID   string // the message's UUID, as given
	Reason string
}

func (e *PublishError) Error() string {
	return fmt.Sprintf("sqlbroker: publish to %q: message %d (uuid %q): %s; nothing was written", e.Topic, e.Index, e.UUID, e.Reason)
}
