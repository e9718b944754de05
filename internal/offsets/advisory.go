package offsets

import (
	"context"
	"fmt"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// The statements of the advisory-lock claim mode. A claim held by an advisory lock has
// visible_at = 'infinity': no "due" step takes it back by time; only its lock says whether its
// holder is alive. Ack, nack and release are the lease mode's statements, fenced by the token.

// The advisory mode's claim (claimSQL with locked) claims up to $4 messages for group $1
// under token $2 and takes their advisory locks (key1 $3, key2 the offset's low 32 bits) in
// the same statement, so a claim becomes visible to other consumers only once its lock is
// held: no one can ever see it as orphaned while its claimer lives.
//   - cand, lk: tries the lock of exactly each candidate (the due offsets and the new
//     messages), leaving out $5 (offsets whose lock this session holds already: session
//     locks are re-entrant, and a lock taken twice stays held after its settlement's one
//     unlock). The filter on $5 is made in cand, a materialised step of its own, so that it
//     runs before any lock is tried: within one WHERE clause the server orders the conditions
//     by their estimated cost, and put the lock call first (TestClaimLockedSkipsHeldLocks).
//     $5 is read through a subquery, so that the generic plan's estimate does not differ from
//     the custom plans' with the array's real length. It reads the materialised candidates,
//     after their LIMIT, has no LIMIT of its own (A4), and aggregates: every candidate is
//     tried exactly once, before any step uses the result.
//   - due offsets whose lock was taken are held under the token, one attempt more; the others
//     stay due. New messages whose lock was taken are held ('infinity', the token, attempt 1);
//     the others go into a row due at once for a later round; delayed ones, whose lock is not
//     tried, into rows due at their time; the position advances past all of them.
// The group row is locked, as in the lease mode, only when a message is waiting after its
// position: an idle poll locks and writes nothing.

// ClaimLocked is Claim for the advisory-lock mode, in one statement that also takes the
// advisory locks of exactly the messages it claims (see claimLockedSQL). Run it on the
// connection that holds the locks, with key1 the group's lock key and skip the offsets whose
// locks that connection already holds. It returns the claimed messages: those whose lock it
// took. If it fails, locks it took before failing stay with the session: close the connection.
// With due false it claims new messages only, as Claim does.
func (s *Store) ClaimLocked(ctx context.Context, q dbx.Querier, groupID int32, token int64, limit int, key1 int32, skip []int64, due Due, out []Claimed) ([]Claimed, error) {
	out, _, err := s.ClaimLockedPassing(ctx, q, groupID, token, limit, 0, key1, skip, nil, due, out)
	return out, err
}

// ClaimLockedPassing is ClaimLocked that passes up to pass delayed messages besides the limit
// it may claim, as ClaimPassing does, and that also drops the session's locks (under key1) of
// the offsets in unlock, after the locks it tried (see unlockStepSQL). It returns the offsets
// of unlock whose lock the session did not hold; the others' locks it dropped. If it fails,
// some of those locks may be dropped and others not: ask the session which it holds.
func (s *Store) ClaimLockedPassing(ctx context.Context, q dbx.Querier, groupID int32, token int64, limit, pass int, key1 int32, skip, unlock []int64, due Due, out []Claimed) ([]Claimed, []int64, error) {
	return s.db.claimLocked(ctx, q, groupID, token, limit, pass, key1, skip, unlock, due, out)
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
