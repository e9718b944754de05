package offsets_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// orderedDB is a database with the tables of a topic of its own, for the ordered claims:
// PostgreSQL or a SQLite file.
type orderedDB interface {
	dbx.Querier
	dbx.Beginner
}

func orderedTables(t *testing.T, ctx context.Context, name string) (offsets.Tables, orderedDB) {
	if name == "postgres" {
		tables, _, db := createTables(t, ctx)
		return tables, db
	}
	raw, err := sql.Open("sqlite", "file:"+testdb.SQLitePath(t)+"?_pragma=journal_mode(WAL)&_pragma=busy_timeout(5000)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = raw.Close() })
	pool := dbx.NewSQLitePool(raw)
	tables := offsets.NewTables("", "sqlbroker_", testdb.Topic(t, "")).OnSQLite()
	if err := tables.Create(ctx, pool); err != nil {
		t.Fatal(err)
	}
	return tables, pool
}

// A group ordered by key: a message goes out only once every message of its key before it is
// settled, whoever claims; messages without a key and of other keys go out beside it; a
// nacked message stays first of its key.
func TestClaimOrdered_onePerKeyInGroupOrder(t *testing.T) {
	for _, name := range []string{"postgres", "sqlite"} {
		t.Run(name, func(t *testing.T) { testClaimOrderedOnePerKey(t, name) })
	}
}

func testClaimOrderedOnePerKey(t *testing.T, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables, db := orderedTables(t, ctx, name)
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
		cs, _, err := store.ClaimOrdered(ctx, db, gid, token, time.Minute, 10, 100, nil)
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

// Parked messages of a key go out in the group's order, (xid, offset), also where their
// offsets run the other way: Y is written by a transaction that began before X's and commits
// after it, so Y has the lower xid and the higher offset. Both are parked behind A0; once A0
// is acked, Y goes first, then X. The parked rows carry that order in their tokens.
func TestClaimOrdered_parkedGoInGroupOrderNotOffsetOrder(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables, pool, db := createTables(t, ctx)
	store := offsets.NewStore(tables, false)
	row := func(uuid string) offsets.Row {
		return offsets.Row{UUID: uuid, Metadata: fmt.Sprintf(`{%q: "A"}`, offsets.MetaOrderKey)}
	}
	if err := store.Insert(ctx, db, []offsets.Row{row("A0")}, ""); err != nil {
		t.Fatal(err)
	}
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	claim := func(token int64) []string {
		t.Helper()
		cs, _, err := store.ClaimOrdered(ctx, db, gid, token, time.Minute, 10, 100, nil)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, c := range cs {
			got = append(got, c.UUID)
		}
		return got
	}
	var first []string
	testdb.Eventually(t, 30*time.Second, "A0 claimed", func() bool { first = claim(1); return len(first) > 0 })
	if fmt.Sprint(first) != "[A0]" {
		t.Fatalf("first claim %v, want [A0]", first)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(ctx, "SELECT pg_current_xact_id()"); err != nil { // Y's xid, taken first
		t.Fatal(err)
	}
	if err := store.Insert(ctx, db, []offsets.Row{row("X")}, ""); err != nil { // lower offset, higher xid
		t.Fatal(err)
	}
	if err := store.Insert(ctx, dbx.PgxTx(tx), []offsets.Row{row("Y")}, ""); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var xOff, yOff int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT "offset" FROM `+tables.Messages+` WHERE "uuid" = 'X'), (SELECT "offset" FROM `+tables.Messages+` WHERE "uuid" = 'Y')`).Scan(&xOff, &yOff); err != nil {
		t.Fatal(err)
	}
	if xOff > yOff {
		t.Fatalf("X at offset %d, Y at %d: the test needs X's offset lower", xOff, yOff)
	}
	testdb.Eventually(t, 30*time.Second, "X and Y parked", func() bool {
		if got := claim(2); len(got) > 0 {
			t.Fatalf("claimed %v while A0 is in work", got)
		}
		var parked int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tables.Claims+` WHERE "order_key" IS NOT NULL`).Scan(&parked); err != nil {
			t.Fatal(err)
		}
		return parked == 2
	})
	ack := func(token int64, uuid string) {
		t.Helper()
		var off int64
		if err := pool.QueryRow(ctx, `SELECT "offset" FROM `+tables.Messages+` WHERE "uuid" = $1`, uuid).Scan(&off); err != nil {
			t.Fatal(err)
		}
		if _, err := store.Ack(ctx, db, gid, []offsets.Fenced{{Offset: off, Token: token}}); err != nil {
			t.Fatal(err)
		}
	}
	ack(1, "A0")
	if got := claim(3); fmt.Sprint(got) != "[Y]" {
		t.Fatalf("after A0 acked: %v, want [Y] (lower xid, higher offset)", got)
	}
	ack(3, "Y")
	if got := claim(4); fmt.Sprint(got) != "[X]" {
		t.Fatalf("after Y acked: %v, want [X]", got)
	}
}

// A parked message whose time has not come when its key frees becomes a delayed claim: it is
// passed (not handed out), holds its key, and is claimed again once its time has come. Its
// time is far enough off for the first claim to come before it on PostgreSQL, which waits
// for the transaction horizon to pass the inserts.
func TestClaimOrdered_parkedDelayedMessageWaitsForItsTime(t *testing.T) {
	for _, name := range []string{"postgres", "sqlite"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			tables, db := orderedTables(t, ctx, name)
			store := offsets.NewStore(tables, false)
			md := fmt.Sprintf(`{%q: "A"}`, offsets.MetaOrderKey)
			at := time.Now().Add(6 * time.Second)
			if err := store.Insert(ctx, db, []offsets.Row{{UUID: "A1", Metadata: md}, {UUID: "A2", Metadata: md, DeliverAt: at}, {UUID: "A3", Metadata: md}}, ""); err != nil {
				t.Fatal(err)
			}
			gid, err := store.EnsureGroup(ctx, db, "g", false)
			if err != nil {
				t.Fatal(err)
			}
			claim := func(token int64) ([]string, []time.Time, []offsets.Claimed) {
				t.Helper()
				cs, _, err := store.ClaimOrdered(ctx, db, gid, token, time.Minute, 10, 100, nil)
				if err != nil {
					t.Fatal(err)
				}
				var got []string
				var delayed []time.Time
				for _, c := range cs {
					if c.Delayed.IsZero() {
						got = append(got, c.UUID)
					} else {
						delayed = append(delayed, c.Delayed)
					}
				}
				return got, delayed, cs
			}
			var first []offsets.Claimed
			testdb.Eventually(t, 30*time.Second, "A1", func() bool {
				got, _, cs := claim(1)
				first = cs
				return len(got) == 1 && got[0] == "A1"
			})
			if _, err := store.Ack(ctx, db, gid, offsets.Fence(first, 1)); err != nil {
				t.Fatal(err)
			}
			got, delayed, _ := claim(2)
			if len(got) != 0 || len(delayed) != 1 || delayed[0].Before(at.Truncate(time.Millisecond)) {
				t.Fatalf("after A1 acked: claimed %v, passed %v; want A2 passed until %v", got, delayed, at)
			}
			if got, _, _ := claim(3); len(got) != 0 {
				t.Fatalf("while A2 waits for its time: claimed %v", got)
			}
			testdb.Eventually(t, 30*time.Second, "A2 claimed at its time", func() bool {
				got, _, _ := claim(4)
				if len(got) > 0 && (len(got) != 1 || got[0] != "A2") {
					t.Fatalf("at A2's time: claimed %v", got)
				}
				return len(got) == 1
			})
			if !time.Now().After(at) {
				t.Fatalf("A2 claimed before its time")
			}
		})
	}
}

// While MaxParked messages of a group wait parked, a claim reads no new message: B, written
// after more messages of A than that, stays unread while A's first is in work, and still once
// it is acked (A's next goes, and the parked are as many as before, less one).
func TestClaimOrdered_parkedCapStopsNewMessages(t *testing.T) {
	for _, name := range []string{"postgres", "sqlite"} {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			tables, db := orderedTables(t, ctx, name)
			store := offsets.NewStore(tables, false)
			const pass = 100
			rows := make([]offsets.Row, offsets.MaxParked+2*pass+1)
			for i := range rows {
				k := "A"
				if i == len(rows)-1 {
					k = "B"
				}
				rows[i] = offsets.Row{UUID: fmt.Sprintf("%s%d", k, i+1), Metadata: fmt.Sprintf(`{%q: %q}`, offsets.MetaOrderKey, k)}
			}
			if err := store.Insert(ctx, db, rows, ""); err != nil {
				t.Fatal(err)
			}
			gid, err := store.EnsureGroup(ctx, db, "g", false)
			if err != nil {
				t.Fatal(err)
			}
			var taken []offsets.Claimed
			claim := func(token int64) {
				t.Helper()
				cs, _, err := store.ClaimOrdered(ctx, db, gid, token, time.Minute, 10, pass, nil)
				if err != nil {
					t.Fatal(err)
				}
				for _, c := range cs {
					if c.UUID == "B"+fmt.Sprint(len(rows)) {
						t.Fatalf("claim %d took B with %d messages of A parked or more", token, offsets.MaxParked)
					}
				}
				taken = append(taken, cs...)
			}
			for token := int64(1); token <= offsets.MaxParked/pass+5; token++ {
				claim(token)
			}
			if len(taken) != 1 || taken[0].UUID != "A1" {
				t.Fatalf("took %d messages, want A1 alone", len(taken))
			}
			if _, err := store.Ack(ctx, db, gid, offsets.Fence(taken, 1)); err != nil {
				t.Fatal(err)
			}
			claim(100)
			if len(taken) != 2 || taken[1].UUID != "A2" {
				t.Fatalf("after A1 acked took %v, want A2", taken[1:])
			}
		})
	}
}

// An ordered ack hands each key it frees to the acker: the key's first parked message, claimed
// in the same statement under the token given, and never a delayed one (its claim makes it
// due at its time), nor after a stale ack. Claims meanwhile see the key busy with it.
func TestAckHandingOver_nextOfTheKeyToTheAcker(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables, db := orderedTables(t, ctx, "postgres")
	store := offsets.NewStore(tables, false)
	rows := []offsets.Row{}
	for i, k := range []string{"A", "A", "B", "A", "A"} {
		r := offsets.Row{UUID: fmt.Sprintf("%s%d", k, i+1), Metadata: fmt.Sprintf(`{%q: %q}`, offsets.MetaOrderKey, k)}
		if i == 3 {
			r.DeliverAt = time.Now().Add(time.Hour)
		}
		rows = append(rows, r)
	}
	if err := store.Insert(ctx, db, rows, ""); err != nil {
		t.Fatal(err)
	}
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	byUUID := map[string]offsets.Claimed{}
	claim := func(token int64) string {
		t.Helper()
		cs, _, err := store.ClaimOrdered(ctx, db, gid, token, time.Minute, 10, 100, nil)
		if err != nil {
			t.Fatal(err)
		}
		s := ""
		for _, c := range cs {
			if c.Delayed.IsZero() {
				byUUID[c.UUID] = c
				s += c.UUID + " "
			} else {
				s += fmt.Sprintf("delayed@%d ", c.Offset)
			}
		}
		return s
	}
	ack := func(uuid string, token, handTo int64) (bool, string) {
		t.Helper()
		done, handed, err := store.AckHandingOver(ctx, db, gid, []offsets.Fenced{{Offset: byUUID[uuid].Offset, Token: token}}, handTo, time.Minute, nil)
		if err != nil {
			t.Fatal(err)
		}
		s := ""
		for _, c := range handed {
			if c.Attempts != 1 {
				t.Errorf("%s handed over at attempt %d, want 1", c.UUID, c.Attempts)
			}
			byUUID[c.UUID] = c
			s += c.UUID + " "
		}
		return done[byUUID[uuid].Offset], s
	}

	var first string
	testdb.Eventually(t, 30*time.Second, "the first claim", func() bool { first = claim(1); return first != "" })
	if first != "A1 B3 " {
		t.Fatalf("first claim: %q, want A1 and B3 (A2, A4, A5 parked)", first)
	}
	if applied, handed := ack("A1", 99, 10); applied || handed != "" {
		t.Fatalf("a stale ack of A1: applied %v, handed over %q; want neither", applied, handed)
	}
	if applied, handed := ack("A1", 1, 10); !applied || handed != "A2 " {
		t.Fatalf("ack of A1: applied %v, handed over %q; want A2", applied, handed)
	}
	if got := claim(11); got != "" {
		t.Fatalf("a claim while A2 is handed over and B3 held: %q, want nothing", got)
	}
	// The hand-over is a claim of token 10: its lease extends under that token.
	if ext, err := store.Extend(ctx, db, gid, []offsets.Fenced{{Offset: byUUID["A2"].Offset, Token: 10}}, time.Minute); err != nil || !ext[byUUID["A2"].Offset] {
		t.Fatalf("extending A2 under the hand-over's token: %v, %v", ext, err)
	}
	if applied, handed := ack("B3", 1, 12); !applied || handed != "" {
		t.Fatalf("ack of B3: applied %v, handed over %q; want nothing (no B waits)", applied, handed)
	}
	// A4 is next of A but delayed: not handed over; the claim makes it due at its time, and A5
	// stays parked behind it.
	if applied, handed := ack("A2", 10, 13); !applied || handed != "" {
		t.Fatalf("ack of A2: applied %v, handed over %q; want nothing (A4 is delayed)", applied, handed)
	}
	if got := claim(14); got != fmt.Sprintf("delayed@%d ", offsetOf(t, ctx, db, tables, "A4")) {
		t.Fatalf("claim after A2 acked: %q, want A4 passed as delayed and nothing claimed", got)
	}
}

func offsetOf(t *testing.T, ctx context.Context, db orderedDB, tables offsets.Tables, uuid string) int64 {
	t.Helper()
	var off int64
	if err := dbx.QueryRow(ctx, db, `SELECT "offset" FROM `+tables.Messages+` WHERE "uuid" = $1`, []any{uuid}, &off); err != nil {
		t.Fatal(err)
	}
	return off
}

// The ordered claim returns a time no later than when the database began its leases, also
// when its statement waited after the group's lock was had (here on a table lock): a local
// deadline counted from then never outlives the lease. The wait is not taken off the lease
// either: the time comes after it. Both drivers; on pgx the lock and the claim go to the server
// in one batch, whose replies come back only once the claim has run.
func TestClaimOrdered_leasedNoLaterThanTheDatabaseLease(t *testing.T) {
	for _, driver := range []string{"pgx", "database/sql"} {
		t.Run(driver, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			tables, pool, pgxDB := createTables(t, ctx)
			var b orderedDB
			if driver == "database/sql" {
				b = dbx.NewStdPool(testdb.Std(t))
			} else {
				one, err := pgxpool.New(ctx, testdb.URL()+sep(testdb.URL())+"pool_max_conns=1")
				if err != nil {
					t.Fatal(err)
				}
				defer one.Close()
				b = dbx.NewPgxPool(one)
			}
			store := offsets.NewStore(tables, false)
			gid, err := store.EnsureGroup(ctx, pgxDB, "g", false)
			if err != nil {
				t.Fatal(err)
			}
			// A first claim, of nothing, prepares the statement on the pool's one connection
			// (pgx caches it): the next one then waits on the table inside its transaction.
			if _, _, err := store.ClaimOrdered(ctx, b, gid, 1, time.Minute, 10, 100, nil); err != nil {
				t.Fatal(err)
			}
			rows := []offsets.Row{
				{UUID: "a", Metadata: fmt.Sprintf(`{%q: "A"}`, offsets.MetaOrderKey)},
				{UUID: "b", Metadata: "{}"},
			}
			if err := store.Insert(ctx, pgxDB, rows, ""); err != nil {
				t.Fatal(err)
			}
			// The claim's statement waits on the messages table once the group's row is locked.
			holder, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := holder.Exec(ctx, "LOCK TABLE "+tables.Messages+" IN ACCESS EXCLUSIVE MODE"); err != nil {
				_ = holder.Rollback(ctx)
				t.Fatal(err)
			}
			const wait = time.Second
			committed := make(chan struct{})
			go func() {
				defer close(committed)
				time.Sleep(wait)
				_ = holder.Commit(ctx)
			}()
			defer func() { <-committed }() // the holder is the goroutine's until it has committed
			const token, ttl = 7, time.Minute
			before := time.Now()
			cs, leased, err := store.ClaimOrdered(ctx, b, gid, token, ttl, 10, 100, nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(cs) != 2 {
				t.Fatalf("claimed %d messages, want 2", len(cs))
			}
			var began time.Time
			if err := pool.QueryRow(ctx, `SELECT min("visible_at") - $2::float8 * interval '1 millisecond' FROM `+tables.Claims+` WHERE "token" = $1`,
				token, float64(ttl.Milliseconds())).Scan(&began); err != nil {
				t.Fatal(err)
			}
			if leased.After(began) {
				t.Errorf("the claim's time %s is %s after the database began its leases (%s)", leased.Format("15:04:05.000000"), leased.Sub(began), began.Format("15:04:05.000000"))
			}
			if d := leased.Sub(before); d < wait-50*time.Millisecond {
				t.Errorf("the claim's time came %s after it was called: the wait of %s was taken off the lease", d, wait)
			}
		})
	}
}

// sep is what joins a parameter to url.
func sep(url string) string {
	if strings.Contains(url, "?") {
		return "&"
	}
	return "?"
}

// The bound an ordered ack starts its look for a key's next parked message at
// (Claimed.After) is a hint: given one past that message (or none), the ack still applies,
// and the message is handed over by it or, at worst, by the group's next ordered claim, in
// order; and the bounds the claims and acks give lead each ack to the next message.
func TestAckHandingOver_afterIsAHint(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables, db := orderedTables(t, ctx, "postgres")
	store := offsets.NewStore(tables, false)
	rows := make([]offsets.Row, 4)
	for i := range rows {
		rows[i] = offsets.Row{UUID: fmt.Sprintf("A%d", i+1), Metadata: fmt.Sprintf(`{%q: "A"}`, offsets.MetaOrderKey)}
	}
	if err := store.Insert(ctx, db, rows, ""); err != nil {
		t.Fatal(err)
	}
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	var cs []offsets.Claimed
	testdb.Eventually(t, 30*time.Second, "the first claim", func() bool {
		cs, _, err = store.ClaimOrdered(ctx, db, gid, 1, time.Minute, 10, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		return len(cs) > 0
	})
	if len(cs) != 1 || cs[0].UUID != "A1" {
		t.Fatalf("first claim: %v, want A1 alone (the rest parked)", cs)
	}
	// The bounds as given: A1's ack hands A2 over, whose bound is its parked row's token.
	done, handed, err := store.AckHandingOver(ctx, db, gid, offsets.Fence(cs, 1), 2, time.Minute, nil)
	if err != nil || !done[cs[0].Offset] || len(handed) != 1 || handed[0].UUID != "A2" {
		t.Fatalf("ack of A1: done %v, handed %v, %v; want A2 handed over", done, handed, err)
	}
	if handed[0].After >= 0 {
		t.Fatalf("A2 handed over with bound %d, want its parked row's token (negative)", handed[0].After)
	}
	// A bound past A3's parked row: the ack applies and hands nothing over.
	fs := offsets.Fence(handed, 2)
	fs[0].After = -1
	done, none, err := store.AckHandingOver(ctx, db, gid, fs, 3, time.Minute, nil)
	if err != nil || !done[handed[0].Offset] || len(none) != 0 {
		t.Fatalf("ack of A2 with a bound past A3: done %v, handed %v, %v; want applied, none handed over", done, none, err)
	}
	// The group's next claim takes A3, and A3's ack with no bound hands A4 over.
	cs, _, err = store.ClaimOrdered(ctx, db, gid, 4, time.Minute, 10, 0, nil)
	if err != nil || len(cs) != 1 || cs[0].UUID != "A3" {
		t.Fatalf("claim after the ack of A2: %v, %v; want A3", cs, err)
	}
	fs = offsets.Fence(cs, 4)
	fs[0].After = 0
	done, handed, err = store.AckHandingOver(ctx, db, gid, fs, 5, time.Minute, nil)
	if err != nil || !done[cs[0].Offset] || len(handed) != 1 || handed[0].UUID != "A4" {
		t.Fatalf("ack of A3 without a bound: done %v, handed %v, %v; want A4 handed over", done, handed, err)
	}
}
