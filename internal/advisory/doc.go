// Package advisory (internal) holds what the advisory-lock claim mode (sqlbroker.ClaimAdvisoryLock) needs
// beside the tables of package offsets: the lock keys, the connection that holds the locks, and
// the bookkeeping of which locks it holds.
//
// The key layout is documented in the public package advisory, which re-exports the
// key functions of this one.
//
// # The lock connection
//
// A Conn is one session connection, outside the pool's accounting where the driver allows it
// (pgx: a pgx.Conn of its own; database/sql: a *sql.Conn taken from the *sql.DB and closed,
// never returned, when it is done; the room for it in a bounded *sql.DB is reserved from Open
// to Close, across reconnects). With Options.Lazy it is opened by the first statement that
// needs it rather than by Open, once a lock connection of the same pool has passed the
// session check (below): an owner with nothing to claim holds no connection. It runs the claim
// statement, which takes the locks of
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
// uses. The first lock connection of a pool in the process is checked as it opens (by Open):
// the backend process must be the same across statements, a session lock taken by one
// statement must be seen in pg_locks by the next, and the backend must stay the connection's
// while another connection of the pool holds a transaction open; otherwise Open refuses with
// ErrNotSessionConnection. A pool one lock connection passed on is remembered (by a weak
// reference), and its later lock connections and reconnects are only set up. Point the
// advisory mode at PostgreSQL itself or at a session-mode pooler.
package advisory
