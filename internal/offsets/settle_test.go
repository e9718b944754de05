package offsets_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A settlement whose claim row a concurrent statement changed after the settlement's snapshot
// was taken (an extension of the same lease, committed while the settlement waited for its row
// lock) is applied, not refused (L3): the fence is checked on the row's newest version. A
// settlement under a token that no longer matches is refused. Each of ack, nack, release and
// extend meets the race here, deterministically: the test's own transaction changes the claim
// row and commits only once the settlement waits on it.
func TestSettle_L3_concurrentChangeIsNotARefusal(t *testing.T) {
	for _, op := range []string{"ack", "nack", "release", "extend"} {
		t.Run(op, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			tables, pool, db := createTables(t, ctx)
			store := offsets.NewStore(tables, true)
			rows := []offsets.Row{{UUID: "a", Metadata: "{}"}, {UUID: "b", Metadata: "{}"}}
			if err := store.Insert(ctx, db, rows, ""); err != nil {
				t.Fatal(err)
			}
			gid, err := store.EnsureGroup(ctx, db, "g", false)
			if err != nil {
				t.Fatal(err)
			}
			const token = 42
			// The claim waits for the xmin horizon: a transaction elsewhere on the server may
			// hold the new messages back for a while.
			var cs []offsets.Claimed
			testdb.Eventually(t, 30*time.Second, "both messages claimed", func() bool {
				got, err := store.Claim(ctx, db, gid, token, time.Minute, 2-len(cs), offsets.DueNone, nil)
				if err != nil {
					t.Fatal(err)
				}
				cs = append(cs, got...)
				return len(cs) == 2
			})
			fs := offsets.Fence(cs, token)
			fs[1].Token = token + 1 // a stale holder's token: refused

			// An extension of both claims, held uncommitted until the settlement waits on it.
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)
			if _, err := tx.Exec(ctx, fmt.Sprintf(`UPDATE %s SET "visible_at" = now() + interval '1 minute' WHERE "group_id" = $1`, tables.Claims), gid); err != nil {
				t.Fatal(err)
			}

			type result struct {
				done map[int64]bool
				err  error
			}
			res := make(chan result, 1)
			go func() {
				var r result
				switch op {
				case "ack":
					r.done, r.err = store.Ack(ctx, db, gid, fs)
				case "nack":
					r.done, r.err = store.Nack(ctx, db, gid, fs, time.Hour)
				case "release":
					r.done, r.err = store.Release(ctx, db, gid, fs)
				case "extend":
					r.done, r.err = store.Extend(ctx, db, gid, fs, time.Hour)
				}
				res <- r
			}()
			testdb.Eventually(t, 10*time.Second, "the settlement waiting on the claim row", func() bool {
				var n int
				err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
					WHERE wait_event_type = 'Lock' AND query LIKE '%'||$1||'%' AND pid <> pg_backend_pid()`, tables.ClaimsName).Scan(&n)
				return err == nil && n == 1
			})
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-res
			if r.err != nil {
				t.Fatal(r.err)
			}
			if !r.done[fs[0].Offset] {
				t.Errorf("%s of a claim still held under its token was refused after a concurrent change of its row", op)
			}
			if r.done[fs[1].Offset] {
				t.Errorf("%s under a token that no longer matches was applied", op)
			}
			var left int
			if err := pool.QueryRow(ctx, fmt.Sprintf(`SELECT coalesce(sum(cardinality("offsets")), 0) FROM %s WHERE "token" = $1`, tables.Claims), token).Scan(&left); err != nil {
				t.Fatal(err)
			}
			want := map[string]int{"ack": 1, "nack": 1, "release": 1, "extend": 2}[op] // the stale one's claim stays as it was
			if left != want {
				t.Errorf("%s: %d claims under the token, want %d", op, left, want)
			}
		})
	}
}
