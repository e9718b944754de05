package offsets

import (
	"context"
	"fmt"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// The statements of the advisory-lock claim mode. A claim held by an advisory lock has
// visible_at = 'infinity': no "due" step takes it back by time; only its lock says whether its
// holder is alive. Ack, nack and release are the lease mode's statements, fenced by the token.

// orphansSQL finds claims of group $1 held by a lock (visible_at infinity) whose lock nobody
// holds: their consumer died or lost its lock connection. It reads pg_locks and never calls
// pg_try_advisory_lock (A4): the caller tries the locks of exactly the offsets it returns.
// $2 is the group's key1, $3 offsets to leave out (the caller's own deliveries), $4 the limit.
const orphansSQL = `SELECT c."offset" FROM %s c
WHERE c."group_id" = $1 AND c."visible_at" = 'infinity'
  AND c."offset" <> ALL ($3::bigint[])
  AND NOT EXISTS (
	SELECT 1 FROM pg_locks l
	WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
	  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
	  AND l.classid = $2::int4::oid
	  AND l.objid = ((c."offset"::bit(32))::int4)::oid)
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
SELECT m."offset", m."uuid", m."payload", m."metadata"::text, r."attempts"
FROM r JOIN %[2]s m ON m."offset" = r."offset"
ORDER BY m."offset"`

// ClaimHeld is Claim for the advisory-lock mode: the claims it writes have no deadline
// (visible_at 'infinity'). Run it in a transaction, and take the advisory locks of the claimed
// offsets before that transaction commits: no other consumer can then see a claim row whose
// lock is free while its claimer is alive.
func (s *Store) ClaimHeld(ctx context.Context, q dbx.Querier, groupID int32, token int64, limit int, out []Claimed) ([]Claimed, error) {
	rows, err := q.Query(ctx, s.heldClaimSQL, groupID, token, 0.0, limit)
	if err != nil {
		return out, err
	}
	return scanClaimed(rows, out)
}

// Orphans returns up to limit offsets of claims of the group held by a lock of key1 that no
// session holds, leaving out the offsets in skip.
func (s *Store) Orphans(ctx context.Context, q dbx.Querier, groupID int32, key1 int32, skip []int64, limit int) ([]int64, error) {
	if skip == nil {
		skip = []int64{}
	}
	rows, err := q.Query(ctx, fmt.Sprintf(orphansSQL, s.T.Claims), groupID, key1, skip, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var o int64
		if err := rows.Scan(&o); err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	return out, rows.Err()
}

// Adopt takes over the orphaned claims at offs, whose locks the caller holds, under token,
// and returns the messages of those still unsettled.
func (s *Store) Adopt(ctx context.Context, q dbx.Querier, groupID int32, token int64, offs []int64, out []Claimed) ([]Claimed, error) {
	rows, err := q.Query(ctx, fmt.Sprintf(adoptSQL, s.T.Claims, s.T.Messages), groupID, token, offs)
	if err != nil {
		return out, err
	}
	return scanClaimed(rows, out)
}
