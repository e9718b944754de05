// Package offsets documents the tables of a topic and their schema version, for migration
// tools and operators (sqlbroker.SchemaSQL gives their DDL).
//
// A topic has three tables:
//
//   - messages: one row a published message, kept until retention deletes it, with the id of the transaction that
//     wrote it (xid8). Read in (xid, offset) order and only below the oldest transaction still
//     running (pg_snapshot_xmin), so a message committed late is never skipped.
//   - groups: one row a consumer group, with the (xid, offset) position of the last message
//     handed out.
//   - claims: one small row a message of a group that was handed out and not yet settled, or
//     that waits for redelivery: (group_id, offset) key, fencing token, visible_at (the lease
//     deadline or the nack backoff), attempts. Ack deletes the row, so the table stays as small
//     as the work in flight and its updates stay HOT (no indexed column changes).
//
// A message published with a delay carries its time in the messages table's deliver_at. A
// group's claim of new messages passes it like any other, but writes its claim row due at that
// time with no holder (token 0, attempt 0), and hands it out no earlier than that: the claims
// due again take it then, and the messages behind it are not held back.
package offsets

import ioff "github.com/sqlbroker/watermill-sqlbroker/internal/offsets"

// SchemaVersion is the version of the tables this library creates and needs; it is written in
// the comment of a topic's messages table (on SQLite, in its CREATE TABLE text) and checked on
// start. Tables of another version are refused with a sqlbroker.SchemaVersionError.
const SchemaVersion = ioff.SchemaVersion

// SchemaLockKey1 is the first half of the two-int4 transaction advisory lock under which the
// library creates a topic's tables; the second half is derived from the messages table's name.
const SchemaLockKey1 = ioff.SchemaLockKey1
