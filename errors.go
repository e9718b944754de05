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
// claim: its lease could not be extended in time, or another consumer holds the message now.
// Read it with context.Cause(msg.Context()).
var ErrLeaseLost = errors.New("sqlbroker: claim lost, the message may be redelivered to another consumer")

// StaleSettlementError is logged when an ack or nack arrives for a claim that is no longer this
// delivery's: its lease ran out, or its lock connection died, and the message was claimed
// again (or may be). The settlement was not applied; the message is or will be delivered
// again, so a handler must tolerate a second delivery of the same message.
type StaleSettlementError struct {
	// Topic is the topic the message was delivered from.
	Topic string
	// ConsumerGroup is the subscriber's consumer group.
	ConsumerGroup string
	// Offset is the message's position in the topic (its sqlbroker_offset metadata).
	Offset int64
	// Op is the settlement refused: "ack" or "nack".
	Op string
}

func (e *StaleSettlementError) Error() string {
	return fmt.Sprintf("sqlbroker: stale %s refused: topic %q, consumer group %q, offset %d: the claim is no longer held by this delivery",
		e.Op, e.Topic, e.ConsumerGroup, e.Offset)
}

// NameError says which topic, consumer group or identifier was refused and why: names are
// checked before they reach any SQL text. Its fields are Field (what the name is: "topic",
// "ConsumerGroup", ...), Value (the name as given) and Reason.
type NameError = ident.NameError

// MissingTableError says that a table of a topic does not exist and how to create it
// (InitializeSchema, or the SQL of SchemaSQL). Its fields are Topic and Table (the table's
// quoted name).
type MissingTableError = offsets.MissingTableError

// SchemaVersionError says that a topic's tables were created by another schema version of the
// library. Its fields are Topic, Table (the table's quoted name), Found (the version the table
// carries) and Want (the version this library needs).
type SchemaVersionError = offsets.VersionError

// ConfigError names a configuration field, its value and the bound it broke. Every
// constructor of the library returns one for a value it refuses; match it with errors.As.
type ConfigError struct {
	// Field is the configuration field (for example "LeaseTTL"), or "url"
	// for the URL given to Open.
	Field string
	// Value is the value refused. A URL's password is never shown.
	Value any
	// Reason says which bound the value broke, or what to do instead.
	Reason string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("sqlbroker: %s (%v) %s", e.Field, e.Value, e.Reason)
}

// PublishError names the message of a Publish call that was refused before anything was
// written.
type PublishError struct {
	// Topic is the topic of the Publish call.
	Topic string
	// Index is the position of the refused message among the call's messages, from 0.
	Index int
	// UUID is the refused message's UUID, as given.
	UUID string
	// Reason says why the message was refused (an empty or too long UUID, metadata that
	// cannot be stored, ...).
	Reason string
}

func (e *PublishError) Error() string {
	return fmt.Sprintf("sqlbroker: publish to %q: message %d (uuid %q): %s; nothing was written", e.Topic, e.Index, e.UUID, e.Reason)
}
