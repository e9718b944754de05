package offsets

import (
	"context"
	"fmt"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// The statements of the advisory-lock claim mode. A claim held by an advisory lock has
// visible_at = 'infinity': no "due" step takes it back by time; only its lock says whether its
// holder is alive. Ack, nack and release are the lease mode's statements, fenced by the token.

// claimLockedSQL claims up to $4 messages for group $1 under token $2 and takes their advisory
// locks (key1 $3, key2 the offset's low 32 bits) in the same statement, so a claim row becomes
// visible to other consumers only once its lock is held: no one can ever see it as orphaned
// while its claimer lives.
//   - due, g, m: as in the lease mode's claim, the candidates: claims due again (nacked or
//     released, backoff passed), then the next messages after the group's position (M2).
//   - cand, lk: tries the lock of exactly each candidate, leaving out $5 (offsets whose lock
//     this session holds already: session locks are re-entrant, and a lock taken twice stays
//     held after its settlement's one unlock). The filter on $5 is made in cand, a
//     materialised step of its own, so that it runs before any lock is tried: within one
//     WHERE clause the server orders the conditions by their estimated cost, and put the lock
//     call first (TestClaimLockedSkipsHeldLocks). $5 is read through a subquery, so that the
//     generic plan's estimate does not differ from the custom plans' with the array's real
//     length (see the lease mode's claim in store.go). It reads the materialised
//     candidates, after their LIMIT, has no LIMIT of its own (A4), and aggregates: every
//     candidate is tried exactly once, before any step uses the result.
//   - r: due claims whose lock was taken are held under the token, one attempt more; the others
//     stay due.
//   - m reads the position through scalar subqueries, so that it bounds the index scan of
//     (xid, offset), as in the lease mode's claim (store.go).
//   - ins, upd: every new message gets a claim row, held ('infinity', the token, attempt 1)
//     when its lock was taken, otherwise due (attempt 0) for a later round: at once, or, for
//     a delayed message, whose lock is not tried, at its time (see delayedSQL); the position
//     advances past all of them.
//
// with and cond are the asynchronous-commit prefix and condition of pgTopic; due and r are
// dueSQL and lockedAgainSQL, or noDueSQL and noneAgainSQL for a claim of new messages only.
// The group row is locked, as in the lease mode, only when a message is waiting after its
// position: an idle poll locks and writes nothing.
func claimLockedSQL(t Tables, with, cond, due, r string) string {
	return fmt.Sprintf(`%[4]s`+due+`, g AS (
	SELECT gr."last_xid", gr."last_offset" FROM %[1]s gr
	WHERE gr."group_id" = $1 AND (SELECT count(*) FROM due) < $4%[5]s
	  AND (`+nextWaitingSQL+`) IS NOT NULL
	FOR UPDATE
), `+newMessagesSQL("MATERIALIZED ", "$6")+`, cand AS MATERIALIZED (
	SELECT c.o FROM (
		SELECT "offset" AS o FROM due
		UNION ALL
		SELECT "offset" FROM m WHERE m."later" IS NULL
	) c
	WHERE c.o <> ALL ((SELECT $5::bigint[])::bigint[])
), lk AS MATERIALIZED (
	SELECT coalesce(array_agg(o), '{}') AS os FROM cand
	WHERE pg_try_advisory_lock($3::int4, (o::bit(32))::int4)
), `+r+`, ins AS (
	INSERT INTO %[3]s ("group_id", "offset", "token", "visible_at", "attempts")
	SELECT $1, m."offset",
		CASE WHEN m."offset" = ANY (lk.os) THEN $2::bigint ELSE 0 END,
		CASE WHEN m."offset" = ANY (lk.os) THEN 'infinity' ELSE coalesce(m."later", now()) END,
		CASE WHEN m."offset" = ANY (lk.os) THEN 1 ELSE 0 END
	FROM m, lk
)`+claimTailSQL(`m, lk WHERE m."offset" = ANY (lk.os)`), t.Groups, t.Messages, t.Claims, with, cond)
}

// lockedAgainSQL is the step r of claimLockedSQL.
const lockedAgainSQL = `r AS (
	UPDATE %[3]s c SET "token" = $2, "visible_at" = 'infinity', "attempts" = c."attempts" + 1
	FROM due, lk
	WHERE c."group_id" = $1 AND c."offset" = due."offset" AND due."offset" = ANY (lk.os)
	RETURNING c."offset", c."attempts"
)`

// heldSQL lists claims of group $1 held by a lock (visible_at 'infinity') after offset $2, in
// offset order, leaving out the offsets in $3 (the caller's own deliveries), up to $4. The
// caller tries the locks of exactly these offsets (never pg_try_advisory_lock under a LIMIT,
// A4): a lock it can take belongs to a claim whose consumer is gone. It walks the group's
// claims a page at a time, from where the previous page ended, so every claim is looked at
// however many live ones come first. (Reading pg_locks instead costs a copy of the server's
// whole lock table per call: tens of milliseconds with a few thousand locks held.)
const heldSQL = `SELECT c."offset" FROM %s c
WHERE c."group_id" = $1 AND c."visible_at" = 'infinity' AND c."offset" > $2
  AND c."offset" <> ALL ($3::bigint[])
ORDER BY c."offset"
LIMIT $4`

// adoptSQL takes over orphaned claims whose locks the caller now holds, under its token, one
// attempt more. It runs after the locks were taken, so its snapshot sees every settlement that
// committed before the previous holder let go: a claim that was acked meanwhile is gone, one
// that was nacked or released is no longer 'infinity', and neither is returned (A4).
const adoptSQL = `WITH r AS (
	UPDATE %[1]s c SET "token" = $2, "attempts" = c."attempts" + 1
	WHERE c."group_id" = $1 AND c."offset" = ANY ($3::bigint[]) AND c."visible_at" = 'infinity'
	RETURNING c."offset", c."attempts"
)
SELECT m."offset", m."uuid", m."payload", m."metadata"::text, r."attempts", 0, 0::float8
FROM r JOIN %[2]s m ON m."offset" = r."offset"
ORDER BY m."offset"`

// ClaimLocked is Claim for the advisory-lock mode, in one statement that also takes the
// advisory locks of exactly the messages it claims (see claimLockedSQL). Run it on the
// connection that holds the locks, with key1 the group's lock key and skip the offsets whose
// locks that connection already holds. It returns the claimed messages: those whose lock it
// took. If it fails, locks it took before failing stay with the session: close the connection.
// With due false it claims new messages only, as Claim does.
func (s *Store) ClaimLocked(ctx context.Context, q dbx.Querier, groupID int32, token int64, limit int, key1 int32, skip []int64, due bool, out []Claimed) ([]Claimed, error) {
	return s.ClaimLockedPassing(ctx, q, groupID, token, limit, 0, key1, skip, due, out)
}

// ClaimLockedPassing is ClaimLocked that passes up to pass delayed messages besides the limit
// it may claim, as ClaimPassing does.
func (s *Store) ClaimLockedPassing(ctx context.Context, q dbx.Querier, groupID int32, token int64, limit, pass int, key1 int32, skip []int64, due bool, out []Claimed) ([]Claimed, error) {
	return s.db.claimLocked(ctx, q, groupID, token, limit, pass, key1, skip, due, out)
}

// HeldAfter returns up to limit offsets after offset after of claims of the group held by a
// lock, leaving out the offsets in skip. Which of them are orphans only their locks can say.
func (s *Store) HeldAfter(ctx context.Context, q dbx.Querier, groupID int32, after int64, skip []int64, limit int) ([]int64, error) {
	if skip == nil {
		skip = []int64{}
	}
	return dbx.ScanInt64s(q.Query(ctx, fmt.Sprintf(heldSQL, s.T.Claims), groupID, after, skip, limit))
}

// Adopt takes over the orphaned claims at offs, whose locks the caller holds, under token,
// and returns the messages of those still unsettled.
func (s *Store) Adopt(ctx context.Context, q dbx.Querier, groupID int32, token int64, offs []int64, out []Claimed) ([]Claimed, error) {
	rows, err := dbx.QueryWrite(ctx, q, fmt.Sprintf(adoptSQL, s.T.Claims, s.T.Messages), groupID, token, offs)
	if err != nil {
		return out, err
	}
	return scanClaimed(rows, out)
}
