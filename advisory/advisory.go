// Package advisory documents the lock keys of the advisory-lock claim mode
// (sqlbroker.ClaimAdvisoryLock), so that operators can find the library's locks in pg_locks
// and applications can keep their own locks apart, and holds the errors of that mode that
// users match on.
//
// # Lock keys
//
// A claimed message is held by a PostgreSQL session advisory lock in the two-int4 key space,
// pg_try_advisory_lock(key1 int4, key2 int4):
//
//   - key1 = Namespace | h, where h is the low 24 bits of the FNV-1a hash of the quoted,
//     schema-qualified messages table name and the consumer group name. Every message lock of
//     the library therefore has key1 in [0x4C000000, 0x4CFFFFFE] (the byte 'L' on top); the key1
//     0x4CFFFFFF (ProbeKey1) is reserved for the session check below and is never a message key.
//   - key2 = the low 32 bits of the message's offset, as int4.
//
// In pg_locks such a lock shows as locktype 'advisory', classid = key1, objid = key2 read as an
// unsigned number, objsubid = 2. Why the keys are safe:
//
//   - Apart from the application's bigint locks: pg_advisory_lock(bigint) keys show with
//     objsubid = 1 and live in a separate key space; they can never equal a two-int4 key.
//   - Apart from the library's schema lock (offsets.SchemaLockKey1, 0x53427363, a transaction
//     lock) and from watermill-sql's bigint schema lock: key1 never takes that value.
//   - Collision-free for the messages of one group in flight together: offsets are one
//     sequence per topic, and the messages of a group in flight at once lie less than 2^32
//     apart, so their low 32 bits differ.
//   - Two (topic, group) pairs whose hashes meet share key1. That costs waiting, never a double
//     delivery: a lock someone else holds is never taken, so a message whose key another group
//     holds at that moment is simply claimed a little later. The same holds for an application
//     that takes two-int4 locks with key1 in the library's range: avoid that range.
package advisory

import (
	iadv "github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// Namespace is the top byte of key1 of every message lock ('L'): key1 lies in
// [0x4C000000, 0x4CFFFFFE].
const Namespace = iadv.Namespace

// ProbeKey1 is the key1 of the lock the session check takes and drops at once (with key2 =
// the backend's pid). It lies in the namespace but no message lock ever uses it.
const ProbeKey1 = iadv.ProbeKey1

// NamespaceFirst and NamespaceLast bound key1 of the library's locks, for queries on pg_locks:
// classid BETWEEN NamespaceFirst AND NamespaceLast AND objsubid = 2.
const (
	NamespaceFirst = iadv.NamespaceFirst
	NamespaceLast  = iadv.NamespaceLast
)

// Key1 is the first half of the lock keys of the messages of one consumer group: the
// namespace byte over 24 bits of a hash of the quoted, schema-qualified messages table name
// and the group's name.
func Key1(messagesTable, consumerGroup string) int32 { return iadv.Key1(messagesTable, consumerGroup) }

// Key2 is the second half of a message's lock key: the low 32 bits of its offset.
func Key2(offset int64) int32 { return iadv.Key2(offset) }

// ErrNotSessionConnection says that the database connection does not behave as one server
// session: most likely a transaction-mode pooler (PgBouncer with pool_mode = transaction) sits
// in between. Session advisory locks cannot work there: Subscribe fails with it. Connect
// directly or through a session-mode pooler, or use the lease claim mode.
var ErrNotSessionConnection = iadv.ErrNotSessionConnection

// ErrPoolTooSmall says that a bounded *sql.DB (SetMaxOpenConns) has no room for one more
// subscription's lock connection beside the connections everything else needs; its message
// says how many the pool needs.
var ErrPoolTooSmall = dbx.ErrPoolTooSmall
