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
//   - claims: the messages of a group handed out and not yet settled, or waiting for
//     redelivery. On PostgreSQL a row holds what one claim statement took: its unsettled
//     offsets (bigint[]), the fencing token, visible_at (the lease deadline or the time the
//     row comes due) and the attempt count, keyed by (group_id, token, attempts); a row no
//     consumer holds (nacked, released, delayed) has a negative token. Settling takes offsets
//     out of their row and deletes it with its last one. On SQLite a row holds one message,
//     keyed by (group_id, offset).
//
// A message published with a delay carries its time in the messages table's deliver_at. A
// group's claim of new messages passes it like any other, but writes its claim row due at that
// time with no holder (attempt 0), and hands it out no earlier than that: the claims
// due again take it then, and the messages behind it are not held back.
package offsets

import ioff "github.com/sqlbroker/watermill-sqlbroker/internal/offsets"

// SchemaVersion is the version of the PostgreSQL tables this library creates and needs; it is
// written in the comment of a topic's messages table and checked on start. Tables of another
// version are refused with a sqlbroker.SchemaVersionError; those of versions 1 and 2 are
// upgraded in place by InitializeSchema or the SQL of sqlbroker.SchemaSQL.
const SchemaVersion = ioff.SchemaVersion

// SQLiteSchemaVersion is the version of the SQLite tables, written in the messages table's
// CREATE TABLE text.
const SQLiteSchemaVersion = ioff.SQLiteSchemaVersion

// SchemaLockKey1 is the first half of the two-int4 transaction advisory lock under which the
// library creates a topic's tables; the second half is derived from the messages table's name.
const SchemaLockKey1 = ioff.SchemaLockKey1
