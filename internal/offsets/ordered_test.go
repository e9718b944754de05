package offsets_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// A group ordered by key: a message goes out only once every message of its key before it is
// settled, whoever claims; messages without a key and of other keys go out beside it; a
// nacked message stays first of its key.
func TestClaimOrdered_onePerKeyInGroupOrder(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables, _, db := createTables(t, ctx)
	store := offsets.NewStore(tables, false)
	keys := []string{"A", "A", "B", "A", "", "B"}
	rows := make([]offsets.Row, len(keys))
	for i, k := range keys {
		md := "{}"
		if k != "" {
			md = fmt.Sprintf(`{%q: %q}`, offsets.MetaOrderKey, k)
		}
		rows[i] = offsets.Row{UUID: fmt.Sprintf("%s%d", k, i+1), Metadata: md}
	}
	if err := store.Insert(ctx, db, rows, ""); err != nil {
		t.Fatal(err)
	}
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	claim := func(token int64) map[string]offsets.Claimed {
		t.Helper()
		got := map[string]offsets.Claimed{}
		cs, err := store.ClaimOrdered(ctx, db, gid, token, time.Minute, 10, 100, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs {
			if c.Delayed.IsZero() {
				got[c.UUID] = c
			}
		}
		return got
	}
	names := func(m map[string]offsets.Claimed) string {
		s := ""
		for _, u := range []string{"A1", "A2", "B3", "A4", "5", "B6"} {
			if c, ok := m[u]; ok {
				s += fmt.Sprintf("%s@%d ", u, c.Attempts)
			}
		}
		return s
	}
	var first map[string]offsets.Claimed
	testdb.Eventually(t, 30*time.Second, "the first claim", func() bool { first = claim(1); return len(first) > 0 })
	if got := names(first); got != "A1@1 B3@1 5@1 " {
		t.Fatalf("first claim: %q, want the first of each key and the one without", got)
	}
	if got := names(claim(2)); got != "" {
		t.Fatalf("second claim while every key is in work: %q", got)
	}
	if _, err := store.Ack(ctx, db, gid, []offsets.Fenced{{Offset: first["A1"].Offset, Token: 1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := store.Nack(ctx, db, gid, []offsets.Fenced{{Offset: first["B3"].Offset, Token: 1}}, 0); err != nil {
		t.Fatal(err)
	}
	third := claim(3)
	if got := names(third); got != "A2@1 B3@2 " {
		t.Fatalf("after A1 acked and B3 nacked: %q, want A2 and B3 again", got)
	}
	if _, err := store.Ack(ctx, db, gid, offsets.Fence([]offsets.Claimed{third["A2"], third["B3"]}, 3)); err != nil {
		t.Fatal(err)
	}
	if got := names(claim(4)); got != "A4@1 B6@1 " {
		t.Fatalf("after A2 and B3 acked: %q, want A4 and B6", got)
	}
}
