package offsets_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// planNode is the part of a JSON plan node the test reads.
type planNode struct {
	NodeType    string     `json:"Node Type"`
	Relation    string     `json:"Relation Name"`
	Index       string     `json:"Index Name"`
	ActualRows  float64    `json:"Actual Rows"`
	ActualLoops float64    `json:"Actual Loops"`
	Plans       []planNode `json:"Plans"`
}

// explained is one plan that auto_explain reported: its root node and its JSON text.
type explained struct {
	root planNode
	text string
}

// parsePlans reads the plans reported for one run of a statement (what); it fails the test
// when there is none.
func parsePlans(t *testing.T, what string, raw []string) []explained {
	t.Helper()
	if len(raw) == 0 {
		t.Fatalf("%s: auto_explain reported no plan", what)
	}
	out := make([]explained, len(raw))
	for i, p := range raw {
		var doc struct {
			Plan planNode `json:"Plan"`
		}
		if err := json.Unmarshal([]byte(p), &doc); err != nil {
			t.Fatalf("%s: plan is not JSON: %v\n%s", what, err, p)
		}
		out[i] = explained{doc.Plan, p}
	}
	return out
}

// widest returns the node of the plan that produced the most rows (rows x loops).
func widest(n planNode) (planNode, float64) {
	best, most := n, n.ActualRows*n.ActualLoops
	for _, c := range n.Plans {
		if b, m := widest(c); m > most {
			best, most = b, m
		}
	}
	return best, most
}

// widestOn is widest among the nodes that read table (by name, quoted) or one of its indexes.
func widestOn(n planNode, table string) (planNode, float64) {
	var best planNode
	most := -1.0
	name := strings.Trim(table, `"`)
	if strings.HasPrefix(n.Relation, name) || strings.HasPrefix(n.Index, strings.TrimSuffix(name, "claims")+"c_") {
		best, most = n, n.ActualRows*n.ActualLoops
	}
	for _, c := range n.Plans {
		if b, m := widestOn(c, table); m > most {
			best, most = b, m
		}
	}
	return best, most
}

// explainedConn is a session with auto_explain reporting every plan it runs, in JSON, as a
// notice: the plans of the prepared statements as the library really runs them.
func explainedConn(t *testing.T, ctx context.Context) (*pgx.Conn, func() []string) {
	t.Helper()
	cc, err := pgx.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var plans []string
	cc.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		if i := strings.IndexByte(n.Message, '{'); i >= 0 {
			mu.Lock()
			plans = append(plans, n.Message[i:])
			mu.Unlock()
		}
	}
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	for _, s := range []string{
		"LOAD 'auto_explain'",
		"SET auto_explain.log_min_duration = 0",
		"SET auto_explain.log_analyze = on",
		"SET auto_explain.log_format = json",
		"SET auto_explain.log_level = notice",
	} {
		if _, err := conn.Exec(ctx, s); err != nil {
			t.Skipf("%s: %v (auto_explain needs the contrib modules and a superuser)", s, err)
		}
	}
	return conn, func() []string {
		mu.Lock()
		defer mu.Unlock()
		out := plans
		plans = nil
		return out
	}
}

// TestClaimPlanStaysFlat checks that a claim reads rows in proportion to what it claims and
// to the claims its group holds, not to the backlog: with 30,000 messages waiting, no node of
// either claim statement's plan may produce more than a few times the batch plus the claims
// held. A plan that scans the backlog (a bitmap scan of the
// whole (xid, offset) range after the position, a scan from the start of the index) fails it,
// and would make every claim slower as the table grows.
func TestClaimPlanStaysFlat(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	topic := testdb.Topic(t, "")
	tables := offsets.NewTables("", "sqlbroker_", topic)
	db := dbx.NewPgxPool(testdb.Pgx(t))
	if err := tables.Create(ctx, db); err != nil {
		t.Fatal(err)
	}
	store := offsets.NewStore(tables, true)
	const backlog, batch = 30_000, 10
	rows := make([]offsets.Row, backlog)
	for i := range rows {
		rows[i] = offsets.Row{UUID: fmt.Sprint(i), Payload: make([]byte, 64), Metadata: "{}"}
	}
	if err := store.Insert(ctx, db, rows, ""); err != nil {
		t.Fatal(err)
	}
	testdb.WaitHorizon(t, ctx, db, tables.Messages)
	if _, err := testdb.Pgx(t).Exec(ctx, "ANALYZE "+tables.Messages); err != nil {
		t.Fatal(err)
	}

	conn, plans := explainedConn(t, ctx)
	q := dbx.PgxConn(conn)
	group := func(name string) int32 {
		gid, err := store.EnsureGroup(ctx, q, name, false)
		if err != nil {
			t.Fatal(err)
		}
		return gid
	}
	// Each statement in both forms: with the due step, and for new messages only. The
	// tokens are as large as real ones (62 bits), so that a parameter the server types as
	// int4 fails here.
	claims := map[string]func(int64) (int, error){}
	for _, due := range []bool{true, false} {
		suffix := map[bool]string{true: "", false: ", new only"}[due]
		leaseGroup, advisoryGroup := group("lease"+suffix), group("advisory"+suffix)
		claims["lease"+suffix] = func(tok int64) (int, error) {
			c, err := store.Claim(ctx, q, leaseGroup, tok, time.Minute, batch, due, nil)
			return len(c), err
		}
		claims["advisory"+suffix] = func(tok int64) (int, error) {
			c, err := store.ClaimLocked(ctx, q, advisoryGroup, tok, batch, 0x4C000001+advisoryGroup, nil, due, nil)
			return len(c), err
		}
	}
	for name, claim := range claims {
		// Several rounds, so that the server has moved to its generic plan of the prepared
		// statement (after five executions) and that plan is checked too.
		for round := range 8 {
			plans()
			n, err := claim(1<<61 + int64(round))
			if err != nil {
				t.Fatalf("%s claim, round %d: %v", name, round, err)
			}
			if n != batch {
				t.Fatalf("%s claim, round %d: claimed %d, want %d", name, round, n, batch)
			}
			for _, p := range parsePlans(t, fmt.Sprintf("%s claim, round %d", name, round), plans()) {
				// The group's own claims are read too (the due step), as many as it holds.
				held := round * batch
				if node, most := widest(p.root); most > float64(5*batch+held) {
					t.Errorf("%s claim, round %d: %s on %s%s produced %.0f rows for a batch of %d with %d claims held and %d waiting:\n%s",
						name, round, node.NodeType, node.Relation, node.Index, most, batch, held, backlog, p.text)
				}
			}
		}
		if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
			t.Fatal(err)
		}
	}
}

// TestSettlePlansStayFlat checks that settlements and claims of new messages read rows in
// proportion to their batch, not to the claims settled before them. Deleted claims leave their
// index entries behind until the table is vacuumed (autovacuum comes about once a minute,
// while a drain settles tens of thousands of claims a second; here it is off), and a plan that
// walks the group's key range reads every one of them: the server's generic plan of a
// settlement joined to its arrays was such a bitmap scan.
func TestSettlePlansStayFlat(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables, pool, db := createTables(t, ctx)
	if _, err := pool.Exec(ctx, "ALTER TABLE "+tables.Claims+" SET (autovacuum_enabled = false)"); err != nil {
		t.Fatal(err)
	}
	store := offsets.NewStore(tables, true)
	const settled, batch = 20_000, 100
	rows := make([]offsets.Row, settled+21*batch)
	for i := range rows {
		rows[i] = offsets.Row{UUID: fmt.Sprint(i), Payload: make([]byte, 64), Metadata: "{}"}
	}
	if err := store.Insert(ctx, db, rows, ""); err != nil {
		t.Fatal(err)
	}
	testdb.WaitHorizon(t, ctx, db, tables.Messages)
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	for token := int64(1 << 61); token < 1<<61+settled/100; token++ {
		cs, err := store.Claim(ctx, db, gid, token, time.Minute, 100, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		if done, err := store.Ack(ctx, db, gid, offsets.Fence(cs, token)); err != nil || len(done) != 100 {
			t.Fatalf("ack: %d of 100 applied, %v", len(done), err)
		}
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+tables.Messages); err != nil {
		t.Fatal(err)
	}

	conn, plans := explainedConn(t, ctx)
	q := dbx.PgxConn(conn)
	check := func(what string, round int) {
		t.Helper()
		for _, p := range parsePlans(t, fmt.Sprintf("%s, round %d", what, round), plans()) {
			if node, most := widestOn(p.root, tables.Claims); most > 2*batch {
				t.Errorf("%s, round %d: %s on %s%s produced %.0f rows for a batch of %d after %d claims were settled:\n%s",
					what, round, node.NodeType, node.Relation, node.Index, most, batch, settled, p.text)
			}
		}
	}
	// Enough rounds that every statement runs seven times: the server's generic plans (from
	// the sixth run) are checked too.
	for round := range 21 {
		token := int64(1<<62 + round)
		plans()
		cs, err := store.Claim(ctx, q, gid, token, time.Minute, batch, false, nil)
		if err != nil || len(cs) != batch {
			t.Fatalf("claim, round %d: %d claimed, %v", round, len(cs), err)
		}
		check("claim of new messages", round)
		fs := offsets.Fence(cs, token)
		type op struct {
			name string
			run  func([]offsets.Fenced) (map[int64]bool, error)
		}
		extend := op{"extend", func(fs []offsets.Fenced) (map[int64]bool, error) { return store.Extend(ctx, q, gid, fs, time.Minute) }}
		settle := []op{
			{"ack", func(fs []offsets.Fenced) (map[int64]bool, error) { return store.Ack(ctx, q, gid, fs) }},
			{"nack", func(fs []offsets.Fenced) (map[int64]bool, error) { return store.Nack(ctx, q, gid, fs, time.Hour) }},
			{"release", func(fs []offsets.Fenced) (map[int64]bool, error) { return store.Release(ctx, q, gid, fs) }},
		}
		for _, st := range []op{extend, settle[round%len(settle)]} {
			done, err := st.run(fs)
			if err != nil || len(done) != batch {
				t.Fatalf("%s, round %d: %d of %d applied, %v", st.name, round, len(done), batch, err)
			}
			check(st.name, round)
		}
	}
}

// TestClaimsKeepGenericPlans checks that the server keeps one generic plan of each prepared
// claim statement on a large table instead of planning it again on every call. After five
// executions, PostgreSQL compares the generic plan's estimated cost with that of the custom
// plans it made with the parameters' values, and plans every later call anew if the generic
// one looks dearer. With the row estimates of a million-row table, a parameter folded into a
// per-row expression (the lease deadline, the array of offsets to leave out) was enough: each
// claim was planned again, which cost the drain of a 1,000,000-message backlog about a sixth
// of its throughput, while at 10,000 messages the generic plan won. So every parameter of the
// claim statements reaches them through a one-time subquery, and this test runs each
// statement, with its settlements, often enough on a table of that size to see which plan
// the server chose.
func TestClaimsKeepGenericPlans(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables, pool, db := createTables(t, ctx)
	store := offsets.NewStore(tables, true)
	const backlog, batch, runs = 1_000_000, 20, 8
	// In steps, so that the table has the partitions a steady publisher would have made.
	for range 10 {
		if err := store.AddPartitions(ctx, db, backlog/10); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s ("uuid", "payload")
			SELECT i::text, '\x00' FROM generate_series(1, %d) i`, tables.Messages, backlog/10)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+tables.Messages); err != nil {
		t.Fatal(err)
	}

	// One session, so that pg_prepared_statements shows the plans of every statement run.
	conn, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	q := dbx.PgxConn(conn)
	lease, err := store.EnsureGroup(ctx, q, "lease", false)
	if err != nil {
		t.Fatal(err)
	}
	advisory, err := store.EnsureGroup(ctx, q, "advisory", false)
	if err != nil {
		t.Fatal(err)
	}
	for round := range runs {
		for _, due := range []bool{true, false} {
			token := int64(1<<61 + 2*round)
			if due {
				token++
			}
			cs, err := store.Claim(ctx, q, lease, token, time.Minute, batch, due, nil)
			if err != nil || len(cs) != batch {
				t.Fatalf("lease claim (due %v), round %d: %d claimed, %v", due, round, len(cs), err)
			}
			fs := offsets.Fence(cs, token)
			if _, err := store.Extend(ctx, q, lease, fs, time.Minute); err != nil {
				t.Fatal(err)
			}
			if _, err := store.Ack(ctx, q, lease, fs); err != nil {
				t.Fatal(err)
			}
			cs, err = store.ClaimLocked(ctx, q, advisory, token, batch, 0x4C000001+advisory, []int64{1 << 40, 1<<40 + 1}, due, nil)
			if err != nil || len(cs) != batch {
				t.Fatalf("advisory claim (due %v), round %d: %d claimed, %v", due, round, len(cs), err)
			}
			if _, err := store.HeldAfter(ctx, q, advisory, 0, []int64{1}, 256); err != nil {
				t.Fatal(err)
			}
			if _, err := store.Ack(ctx, q, advisory, offsets.Fence(cs, token)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		t.Fatal(err)
	}

	rows, err := conn.Query(ctx, `SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements
		WHERE strpos(statement, $1) > 0`, strings.Trim(tables.Claims, `"`))
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	seen := 0
	for rows.Next() {
		var stmt string
		var generic, custom int64
		if err := rows.Scan(&stmt, &generic, &custom); err != nil {
			t.Fatal(err)
		}
		if generic+custom < 6 {
			continue // the group's creation, run once
		}
		seen++
		if generic == 0 {
			t.Errorf("planned anew on each of %d runs (no generic plan) on a table of %d messages:\n%s", custom, backlog, stmt)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	// Four claims (two modes, with and without the due step), extend, ack, the orphan walk.
	if seen != 7 {
		t.Errorf("saw %d statements run at least six times, want 7", seen)
	}
}

// createTables creates the tables of a new topic and returns them with the pool they were
// created through.
func createTables(t *testing.T, ctx context.Context) (offsets.Tables, *pgxpool.Pool, *dbx.PgxPool) {
	t.Helper()
	tables := offsets.NewTables("", "sqlbroker_", testdb.Topic(t, ""))
	pool := testdb.Pgx(t)
	db := dbx.NewPgxPool(pool)
	if err := tables.Create(ctx, db); err != nil {
		t.Fatal(err)
	}
	return tables, pool, db
}

// TestClaimLockedSkipsHeldLocks checks that the advisory claim never takes again a lock its
// session holds already (its $5): session locks are re-entrant, so a lock taken twice stays
// held after the one unlock its settlement makes, for as long as the session lives. The
// filter on $5 must run before pg_try_advisory_lock, and the server orders the conditions of
// one WHERE clause by its own cost estimates: the generic plan put the lock call first. The
// statement runs here under both plan modes.
func TestClaimLockedSkipsHeldLocks(t *testing.T) {
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		t.Run(mode, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			tables, _, db := createTables(t, ctx)
			store := offsets.NewStore(tables, true)
			rows := []offsets.Row{{UUID: "a", Metadata: "{}"}, {UUID: "b", Metadata: "{}"}, {UUID: "c", Metadata: "{}"}}
			if err := store.Insert(ctx, db, rows, ""); err != nil {
				t.Fatal(err)
			}
			testdb.WaitHorizon(t, ctx, db, tables.Messages)
			conn, err := pgx.Connect(ctx, testdb.URL())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(context.Background())
			if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
				t.Fatal(err)
			}
			q := dbx.PgxConn(conn)
			gid, err := store.EnsureGroup(ctx, q, "g", false)
			if err != nil {
				t.Fatal(err)
			}
			const key1 = 0x4C0000AA
			var first int64
			if err := conn.QueryRow(ctx, `SELECT min("offset") FROM `+tables.Messages).Scan(&first); err != nil {
				t.Fatal(err)
			}
			var ok bool
			if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int4, $2::int4)", key1, first).Scan(&ok); err != nil || !ok {
				t.Fatalf("lock of the first message: %v %v", ok, err)
			}
			cs, err := store.ClaimLocked(ctx, q, gid, 1<<61, 3, key1, []int64{first}, false, nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(cs) != 2 {
				t.Fatalf("claimed %d messages, want the 2 whose locks were free", len(cs))
			}
			// One unlock for the one lock taken by hand; a second one finds nothing to drop.
			var again bool
			if err := conn.QueryRow(ctx, "SELECT pg_advisory_unlock($1::int4, $2::int4), pg_advisory_unlock($1::int4, $2::int4)", key1, first).Scan(&ok, &again); err != nil {
				t.Fatal(err)
			}
			if !ok || again {
				t.Errorf("the claim took the held lock of offset %d again (unlocks: %v, %v)", first, ok, again)
			}
			if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestClaimSkipsPassedPartitions checks that a claim reads only the partitions its group may
// still need: with 20 partitions of messages and the groups near the end, after a
// maintenance pass has moved their floors, no node of any claim statement's plan (generic or
// custom; both claim modes, with and without the due step, and ordered by key) that reads a
// partition below the floor runs, so none of those partitions' index or heap pages are read.
func TestClaimSkipsPassedPartitions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables, pool, db := createTables(t, ctx)
	const size, parts, batch = 1000, 20, 10
	testdb.SmallPartitions(t, tables, size, parts)
	store := offsets.NewStore(tables, true)
	rows := make([]offsets.Row, size*parts)
	for i := range rows {
		rows[i] = offsets.Row{UUID: fmt.Sprint(i), Payload: make([]byte, 64), Metadata: "{}"}
	}
	if err := store.Insert(ctx, db, rows, ""); err != nil {
		t.Fatal(err)
	}
	testdb.WaitHorizon(t, ctx, db, tables.Messages)
	if _, err := pool.Exec(ctx, "ANALYZE "+tables.Messages); err != nil {
		t.Fatal(err)
	}
	// Every group has passed all but the last 200 messages.
	const at = size*parts - 200
	groups := map[string]int32{}
	for _, name := range []string{"lease", "lease, new only", "advisory", "advisory, new only", "ordered"} {
		id, err := store.EnsureGroup(ctx, db, name, false)
		if err != nil {
			t.Fatal(err)
		}
		groups[name] = id
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(`UPDATE %s SET ("last_xid", "last_offset") = (SELECT "xid", "offset" FROM %s WHERE "offset" = %d)`,
		tables.Groups, tables.Messages, at)); err != nil {
		t.Fatal(err)
	}
	mc, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 { // the second pass knows the partitions complete
		if _, err := store.Maintain(ctx, mc, offsets.MaintainOptions{Wait: 10 * time.Second}); err != nil {
			t.Fatal(err)
		}
	}
	mc.Release()
	floor := int64(at/size*size + 1)
	if got := testdb.Int(t, `SELECT min("floor_offset") FROM `+tables.Groups); got != floor {
		t.Fatalf("floor %d after the passes, want %d", got, floor)
	}

	conn, plans := explainedConn(t, ctx)
	q := dbx.PgxConn(conn)
	claims := map[string]func(int64) (int, error){
		"lease": func(tok int64) (int, error) {
			c, err := store.Claim(ctx, q, groups["lease"], tok, time.Minute, batch, true, nil)
			return len(c), err
		},
		"lease, new only": func(tok int64) (int, error) {
			c, err := store.Claim(ctx, q, groups["lease, new only"], tok, time.Minute, batch, false, nil)
			return len(c), err
		},
		"advisory": func(tok int64) (int, error) {
			c, err := store.ClaimLocked(ctx, q, groups["advisory"], tok, batch, 0x4C000001+groups["advisory"], nil, true, nil)
			return len(c), err
		},
		"advisory, new only": func(tok int64) (int, error) {
			c, err := store.ClaimLocked(ctx, q, groups["advisory, new only"], tok, batch, 0x4C000001+groups["advisory, new only"], nil, false, nil)
			return len(c), err
		},
		"ordered": func(tok int64) (int, error) {
			c, err := store.ClaimOrdered(ctx, connBeginner{conn}, groups["ordered"], tok, time.Minute, batch, 0, nil)
			return len(c), err
		},
	}
	stem := strings.TrimSuffix(tables.PartitionName(0), "0")
	var below func(n planNode) []string
	below = func(n planNode) []string {
		var out []string
		if lo, err := strconv.ParseInt(strings.TrimPrefix(n.Relation, stem), 10, 64); err == nil && strings.HasPrefix(n.Relation, stem) &&
			lo+size <= floor && n.ActualLoops > 0 {
			out = append(out, n.Relation)
		}
		for _, c := range n.Plans {
			out = append(out, below(c)...)
		}
		return out
	}
	for name, claim := range claims {
		for round := range 8 { // past the fifth run: the generic plan too
			plans()
			n, err := claim(1<<61 + int64(round))
			if err != nil || n != batch {
				t.Fatalf("%s claim, round %d: claimed %d, %v", name, round, n, err)
			}
			for _, p := range parsePlans(t, fmt.Sprintf("%s claim, round %d", name, round), plans()) {
				if read := below(p.root); len(read) > 0 {
					t.Errorf("%s claim, round %d: read partitions below the floor %d: %v\n%s", name, round, floor, read, p.text)
				}
			}
		}
	}
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err != nil {
		t.Fatal(err)
	}
}

// connBeginner begins transactions on one pgx connection (the session auto_explain reports
// the plans of).
type connBeginner struct{ c *pgx.Conn }

func (b connBeginner) Begin(ctx context.Context) (dbx.Tx, error) {
	tx, err := b.c.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return connTx{dbx.PgxTx(tx), tx}, nil
}

type connTx struct {
	dbx.Querier
	tx pgx.Tx
}

func (t connTx) Commit(ctx context.Context) error   { return t.tx.Commit(ctx) }
func (t connTx) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }
