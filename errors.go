package sqlbroker

import (
	"errors"
	"fmt"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/ident"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
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
// checked before they reach any SQL text.
type NameError struct {
	// Field is what the name is: "topic", "ConsumerGroup", "Schema", "TablePrefix", ...
	Field string
	// Value is the name as given.
	Value string
	// Reason says what is wrong with it, and what is allowed.
	Reason string
}

func (e *NameError) Error() string {
	return (&ident.NameError{Field: e.Field, Value: e.Value, Reason: e.Reason}).Error()
}

// MissingTableError says that a table of a topic does not exist and how to create it:
// InitializeSchema, or in a migration the SQL of SchemaSQL (PostgreSQL), SQLiteSchemaSQL
// (SQLite) or MySQLSchemaSQL (MySQL).
type MissingTableError struct {
	// Topic is the topic whose table is missing.
	Topic string
	// Table is the table's quoted name.
	Table string
	// Database is the database where it is missing: "PostgreSQL", "SQLite" or "MySQL".
	Database string
}

func (e *MissingTableError) Error() string {
	return (&offsets.MissingTableError{Topic: e.Topic, Table: e.Table, Database: e.Database}).Error()
}

// SchemaVersionError says that a topic's tables were created by another schema version of the
// library.
type SchemaVersionError struct {
	// Topic is the topic whose tables were refused.
	Topic string
	// Table is the quoted name of the table that carries the version.
	Table string
	// Found is the version the table carries, as written in it.
	Found string
	// Want is the schema version this library needs.
	Want int
}

func (e *SchemaVersionError) Error() string {
	return (&offsets.VersionError{Topic: e.Topic, Table: e.Table, Found: e.Found, Want: e.Want}).Error()
}

// publicErr turns the errors of the library's internals that users match on into the root
// package's own types, keeping what wrapped them.
func publicErr(err error) error {
	if err == nil {
		return nil
	}
	var n *ident.NameError
	if errors.As(err, &n) {
		return replaceErr(err, n, &NameError{Field: n.Field, Value: n.Value, Reason: n.Reason})
	}
	var m *offsets.MissingTableError
	if errors.As(err, &m) {
		database := m.Database
		if database == "" {
			database = dbx.Postgres.Name
		}
		return replaceErr(err, m, &MissingTableError{Topic: m.Topic, Table: m.Table, Database: database})
	}
	var v *offsets.VersionError
	if errors.As(err, &v) {
		return replaceErr(err, v, &SchemaVersionError{Topic: v.Topic, Table: v.Table, Found: v.Found, Want: v.Want})
	}
	return err
}

// replaceErr returns err with inner (found in its chain) replaced by outer: outer itself when
// err is inner, otherwise err's text with outer to match.
func replaceErr(err, inner, outer error) error {
	if err == inner {
		return outer
	}
	return &wrapped{msg: err.Error(), err: outer}
}

// wrapped is an error whose text is msg and whose chain holds err.
type wrapped struct {
	msg string
	err error
}

func (w *wrapped) Error() string { return w.msg }
func (w *wrapped) Unwrap() error { return w.err }

// validateName checks a topic or consumer group name.
func validateName(field, v string) error { return publicErr(ident.ValidateName(field, v)) }

// validateIdentifier checks a schema or table prefix.
func validateIdentifier(field, v string, max int, emptyOK bool) error {
	return publicErr(ident.ValidateIdentifier(field, v, max, emptyOK))
}

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
