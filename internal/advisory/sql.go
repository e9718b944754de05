package advisory

// The statements that run on the lock connection. None of these waits: an advisory lock
// someone else holds is skipped, never waited for. (The claim and takeover statements of
// package offsets that also run there may wait on table and row locks: the session's
// lock_timeout bounds that wait.) The keys of the offsets are computed in SQL, so the
// library passes one bigint array and never an int4 array (which lib/pq cannot bind).
const (
	// tryLockSQL tries the lock of exactly the offsets in $2 and returns those it took. There
	// is no LIMIT anywhere near the lock call: the function runs once per element, and only
	// on the elements given (A4).
	tryLockSQL = `SELECT o FROM unnest($2::bigint[]) AS u(o) WHERE pg_try_advisory_lock($1::int4, (o::bit(32))::int4)`

	// unlockSQL drops the locks of the offsets in $2 and says, for each, whether this session
	// held it.
	unlockSQL = `SELECT o, pg_advisory_unlock($1::int4, (o::bit(32))::int4) FROM unnest($2::bigint[]) AS u(o)`

	pingSQL = `SELECT 1`

	// setupSQL turns off the server's idle timeouts for this session (a lock connection may
	// sit idle between claims and must not be closed for it), bounds every statement of the
	// session on the server (lock_timeout and statement_timeout, the two %s, written in as
	// numbers of milliseconds: a statement blocked by a lock another session holds, a
	// migration's table lock, ends with the server's error and leaves the session and its
	// locks as they were, where a client-side timeout would close it), and sets the server's
	// TCP keepalives, so that the server notices a client host that vanished and frees its
	// locks. idle_session_timeout exists from PostgreSQL 14 on.
	setupSQL = `SELECT set_config('idle_in_transaction_session_timeout', '0', false),
	CASE WHEN current_setting('server_version_num')::int >= 140000
	     THEN set_config('idle_session_timeout', '0', false) END,
	set_config('lock_timeout', '%s', false),
	set_config('statement_timeout', '%s', false),
	set_config('tcp_keepalives_idle', '30', false),
	set_config('tcp_keepalives_interval', '10', false),
	set_config('tcp_keepalives_count', '3', false)`

	// reconcileSQL drops the locks this session holds under key1 $1 whose key2 is not in $2
	// (the keys the bookkeeping holds), and returns each key2 with whether it was dropped. It
	// runs after a statement failed on a live connection: a session lock that statement took
	// stays through its rollback. The keys are read in a materialised step of their own, so
	// that the unlock runs only on the rows the filter kept, whatever order the planner gives
	// the conditions.
	reconcileSQL = `WITH stray AS MATERIALIZED (
	SELECT (l.objid::bigint::bit(32))::int4 AS k FROM pg_locks l
	WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted AND l.objsubid = 2
	  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND l.classid = $1::int4::oid
	  AND (l.objid::bigint::bit(32))::int4 <> ALL ($2::bigint[])
)
SELECT k::bigint, pg_advisory_unlock($1::int4, k) FROM stray`

	// The session check (A5, probe): the backend's pid, a probe lock, then the pid again and
	// the lock as pg_locks shows it, from a separate statement.
	pidSQL       = `SELECT pg_backend_pid()`
	probeLockSQL = `SELECT pg_try_advisory_lock($1::int4, $2::int4)`
	probeSeeSQL  = `SELECT pg_backend_pid(), EXISTS (
	SELECT 1 FROM pg_locks
	WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
	  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND classid = $1::int4::oid AND objid = $2::int4::oid AND objsubid = 2)`
	probeUnlockSQL = `SELECT pg_advisory_unlock($1::int4, $2::int4)`
)
