// Package advisory holds what the advisory-lock claim mode (sqlbroker.ClaimAdvisoryLock) needs
// beside the tables of package offsets: the lock keys, the connection that holds the locks, and
// the bookkeeping of which locks it holds.
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
//
// # The lock connection
//
// A Conn is one session connection, outside the pool's accounting where the driver allows it
// (pgx: a pgx.Conn of its own; database/sql: a *sql.Conn taken from the *sql.DB and closed,
// never returned, when it is done). It runs the claim statement, which takes the locks of
// exactly the messages it claims before the claims commit (see offsets.Store.ClaimLocked), the
// orphan search and takeover, and short statements that never wait: try-lock, unlock and a
// ping. They run one at a time; reading the Conn's state (Held, Gen) never waits for them.
//
// Every statement is bounded by the server: the session sets lock_timeout
// (Options.LockTimeout) and statement_timeout (Options.StatementTimeout). A client-side bound
// is kept only as a last resort 30 s past statement_timeout, for a network that is gone: a
// context cancelled while a driver runs a query closes the connection, and with it every
// lock on it. A statement the server ended (a lock wait that ran out, a cancel) leaves the
// connection open; since a session advisory lock survives the rollback of the statement that
// took it, the Conn then reads the session's locks under its key1 from pg_locks and drops
// those it does not hold. When the owner stops (Options.Stop), the statement of its claim
// round in flight is cancelled on the server (pgx: a cancel request; database/sql:
// pg_cancel_backend through the pool, which keeps the connection open) and awaited, and the
// connection is never opened again.
//
// A connection that really fails (a network error, the server ending the session) is closed at
// once: PostgreSQL then frees every lock it held, and the Conn reports those keys as lost (the
// owner cancels the deliveries and refuses their settlements), then reconnects. A periodic
// ping finds a connection that died while idle (pg_terminate_backend, a server restart, a
// network cut): every CheckInterval while it holds locks and no other statement succeeded on
// it meanwhile, every IdleCheckInterval while it holds none (its loss then loses nothing, and
// the next statement opens it again). The session has idle_session_timeout and idle_in_transaction_session_timeout
// off and TCP keepalives on at both ends (pgx: the dialer's keepalive is set explicitly;
// lib/pq dials with Go's defaults, which keep TCP keepalives on; the server side is set per
// session with tcp_keepalives_idle and friends).
//
// # Session connections only
//
// Session advisory locks belong to a server session. Behind a transaction-mode pooler such as
// PgBouncer (pool_mode = transaction) consecutive statements of one client connection may run
// on different server sessions, and a lock would stay behind on a session another client
// uses. Open checks, before the mode starts, that the backend process is the same across
// statements and that a session lock taken by one statement is seen in pg_locks by the next,
// and refuses with ErrNotSessionConnection otherwise. Point the advisory mode at PostgreSQL
// itself or at a session-mode pooler.
package advisory
