package offsets_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// BenchmarkAckHandingOver times the ordered ack that hands each key it frees its next parked
// message (pgx pool): 64 keys, their first messages held and the rest parked, each statement
// acking the 64 messages the one before handed over. ns/op is per message acked and handed
// over; the server's share of an ordered drain over few keys.
func BenchmarkAckHandingOver(b *testing.B) {
	ctx := context.Background()
	const keys = 64
	rounds := max(b.N/keys, 1)
	tables, _, pool := createTables(b, ctx)
	store := offsets.NewStore(tables, false)
	n := keys * (rounds + 1)
	rows := make([]offsets.Row, 0, 1000)
	for i := range n {
		rows = append(rows, offsets.Row{UUID: fmt.Sprint(i), Payload: make([]byte, 256),
			Metadata: fmt.Sprintf(`{%q: "k%d", "other": "v"}`, offsets.MetaOrderKey, i%keys)})
		if len(rows) == cap(rows) || i == n-1 {
			if err := store.Insert(ctx, pool, rows, ""); err != nil {
				b.Fatal(err)
			}
			rows = rows[:0]
		}
	}
	gid, err := store.EnsureGroup(ctx, pool, "g", false)
	if err != nil {
		b.Fatal(err)
	}
	var held []offsets.Fenced
	for token := int64(1); len(held) < keys || token < 3; token++ {
		cs, _, err := store.ClaimOrdered(ctx, pool, gid, token, time.Hour, keys, n, nil)
		if err != nil {
			b.Fatal(err)
		}
		held = append(held, offsets.Fence(cs, token)...)
		if token > 100 {
			b.Fatalf("the claims took %d messages, want the first of each of %d keys", len(held), keys)
		}
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+tables.Claims); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for round := range rounds {
		token := int64(1000 + round)
		done, handed, err := store.AckHandingOver(ctx, pool, gid, held, token, time.Hour, nil)
		if err != nil {
			b.Fatal(err)
		}
		if len(done) != keys || len(handed) != keys {
			b.Fatalf("round %d: %d acks applied and %d handed over, want %d", round, len(done), len(handed), keys)
		}
		held = offsets.Fence(handed, token)
	}
	b.StopTimer()
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(rounds*keys), "ns/msg")
}
