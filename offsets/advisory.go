package offsets

import (
	"context"
	"fmt"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// The statements of the advisory-lock claim mode. A claim held by an advisory lock has
// visible_at = 'infinity': no "due" step takes it back by time; only its lock says whether its
// holder is alive. Ack, nack and release are the lease mode's statements, fenced by the token.

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

// HeldAfter returns up to limit offsets after offset after of claims of the group held by a
// lock, leaving out the offsets in skip. Which of them are orphans only their locks can say.
func (s *Store) HeldAfter(ctx context.Context, q dbx.Querier, groupID int32, after int64, skip []int64, limit int) ([]int64, error) {
	if skip == nil {
		skip = []int64{}
	}
	rows, err := q.Query(ctx, fmt.Sprintf(heldSQL, s.T.Claims), groupID, after, skip, limit)
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
