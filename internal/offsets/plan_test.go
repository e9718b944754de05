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
	Filtered    float64    `json:"Rows Removed by Filter"`
	IndexCond   string     `json:"Index Cond"`
	Subplan     string     `json:"Subplan Name"`       // "CTE name" for a CTE's node
	HitBlocks   float64    `json:"Shared Hit Blocks"`  // with auto_explain.log_buffers
	ReadBlocks  float64    `json:"Shared Read Blocks"` // with auto_explain.log_buffers
	Plans       []planNode `json:"Plans"`
}

// blocksRead sums the blocks that the scans of table (by name, quoted) read in the plans
// reported for one statement (what; see parsePlans), and says whether one of them was a
// sequential scan. It needs auto_explain.log_buffers.
func blocksRead(t *testing.T, what string, raw []string, table string) (blocks float64, seq bool) {
	t.Helper()
	for _, p := range parsePlans(t, what, raw) {
		for _, s := range scansOf(p.root, table) {
			blocks += s.HitBlocks + s.ReadBlocks
			seq = seq || s.NodeType == "Seq Scan"
		}
	}
	return blocks, seq
}

// scansOf returns the nodes of the plan that scan table (by name, quoted) itself: the index
// scans of its indexes and its heap scans.
func scansOf(n planNode, table string) []planNode {
	var out []planNode
	if n.Relation == strings.Trim(table, `"`) && strings.Contains(n.NodeType, "Scan") {
		out = append(out, n)
	}
	for _, c := range n.Plans {
		out = append(out, scansOf(c, table)...)
	}
	return out
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

// subtree returns the node of the plan whose Subplan Name is name ("CTE hdel"), if any.
func subtree(n planNode, name string) (planNode, bool) {
	if n.Subplan == name {
		return n, true
	}
	for _, c := range n.Plans {
		if s, ok := subtree(c, name); ok {
			return s, true
		}
	}
	return planNode{}, false
}

// indexScans returns the nodes of the plan that scan an index whose name ends with suffix.
func indexScans(n planNode, suffix string) []planNode {
	var out []planNode
	if n.Index != "" && strings.HasSuffix(n.Index, suffix) {
		out = append(out, n)
	}
	for _, c := range n.Plans {
		out = append(out, indexScans(c, suffix)...)
	}
	return out
}

// mostReadOn is widestOn counting the rows a node read: those it produced and those its
// filter removed (rows x loops).
func mostReadOn(n planNode, table string) (planNode, float64) {
	var best planNode
	most := -1.0
	name := strings.Trim(table, `"`)
	if strings.HasPrefix(n.Relation, name) || strings.HasPrefix(n.Index, strings.TrimSuffix(name, "claims")+"c_") {
		best, most = n, (n.ActualRows+n.Filtered)*n.ActualLoops
	}
	for _, c := range n.Plans {
		if b, m := mostReadOn(c, table); m > most {
			best, most = b, m
		}
	}
	return best, most
}

// dueSuffix names the claim statements' forms in the plan tests' messages.
var dueSuffix = map[offsets.Due]string{offsets.DueAll: "", offsets.DueRecent: ", recent leases", offsets.DueGivenBack: ", given back", offsets.DueNone: ", new only"}

// explainedConn is a session with auto_explain reporting every plan it runs, in JSON, as a
// notice: the plans of the prepared statements as the library really runs them. settings
// are run after auto_explain's own.
func explainedConn(t *testing.T, ctx context.Context, settings ...string) (*pgx.Conn, func() []string) {
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
	for _, s := range append([]string{
		"LOAD 'auto_explain'",
		"SET auto_explain.log_min_duration = 0",
		"SET auto_explain.log_analyze = on",
		"SET auto_explain.log_format = json",
		"SET auto_explain.log_level = notice",
	}, settings...) {
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
	insertMessages(t, ctx, store, db, backlog, 64)
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
	// Each statement in its three forms: with the due step, with the step of the claims given
	// back, and for new messages only. The tokens are as large as real ones (62 bits), so that
	// a parameter the server types as int4 fails here.
	claims := map[string]func(int64) (int, error){}
	for _, due := range []offsets.Due{offsets.DueAll, offsets.DueRecent, offsets.DueGivenBack, offsets.DueNone} {
		suffix := dueSuffix[due]
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
	insertMessages(t, ctx, store, db, settled+21*batch, 64)
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	for token := int64(1 << 61); token < 1<<61+settled/100; token++ {
		cs, err := store.Claim(ctx, db, gid, token, time.Minute, 100, offsets.DueNone, nil)
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
		cs, err := store.Claim(ctx, q, gid, token, time.Minute, batch, offsets.DueNone, nil)
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

// TestGivenBackClaimSkipsSettledClaims checks that the claim's look at the claims given back
// (offsets.DueGivenBack, which a subscription makes whenever its last claim was short) reads
// their range of the primary key only (negative tokens), and its look at the leases that ran
// out recently (offsets.DueRecent, once per idle poll interval) the window of the leases
// index, not the versions of the claims settled while a snapshot holds vacuum back: with 2,000
// claims settled under a held snapshot (their deadlines a minute past, as those of claims
// settled a minute ago would be), their scans of the claims table read a few blocks, generic
// plan or custom, while the look at every claim (DueAll) reads them all.
func TestGivenBackClaimSkipsSettledClaims(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables, pool, db := createTables(t, ctx)
	store := offsets.NewStore(tables, true)
	const settled, batch, rounds = 2_000, 10, 8
	insertMessages(t, ctx, store, db, (settled+2*rounds+2)*batch, 16)
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	conn, plans := explainedConn(t, ctx, "SET auto_explain.log_buffers = on")
	q := dbx.PgxConn(conn)
	token := int64(1 << 61)
	// blocks runs a claim with due and returns the blocks its scans of the claims table read,
	// and whether one of them read its heap whole.
	blocks := func(due offsets.Due, round int) (float64, bool) {
		t.Helper()
		token++
		cs, err := store.Claim(ctx, q, gid, token, time.Minute, batch, due, nil)
		if err != nil || len(cs) != batch {
			t.Fatalf("claim%s, round %d: %d claimed, %v", dueSuffix[due], round, len(cs), err)
		}
		n, seq := blocksRead(t, fmt.Sprintf("claim%s, round %d", dueSuffix[due], round), plans(), tables.Claims)
		// Nacked at once: the next claim finds them given back and due.
		if _, err := store.Nack(ctx, q, gid, offsets.Fence(cs, token), 0); err != nil {
			t.Fatal(err)
		}
		plans() // the nack's
		return n, seq
	}
	plans()
	// The first claim takes new messages, whose nack gives the next ones something to take.
	blocks(offsets.DueNone, 0)
	looks := []offsets.Due{offsets.DueGivenBack, offsets.DueRecent}

	// A reader holding its snapshot: no version of a settled claim can be removed from here on.
	holdSnapshot(t, ctx, pool, tables.Claims)
	for range settled {
		token++
		cs, err := store.Claim(ctx, db, gid, token, -time.Minute, batch, offsets.DueNone, nil)
		if err != nil || len(cs) != batch {
			t.Fatalf("claim: %d claimed, %v", len(cs), err)
		}
		if done, err := store.Ack(ctx, db, gid, offsets.Fence(cs, token)); err != nil || len(done) != batch {
			t.Fatalf("ack: %d of %d applied, %v", len(done), batch, err)
		}
	}

	// The statistics the maintenance pass leaves once the claims table has grown: a few live
	// rows of the group in many pages. Planned with them, a claim expects a row or two of the
	// group, and a join that reads the group's range of the key reads every dead version.
	if _, err := pool.Exec(ctx, "ANALYZE "+tables.Claims); err != nil {
		t.Fatal(err)
	}
	most := map[offsets.Due]float64{}
	for _, due := range looks {
		for round := range rounds {
			n, seq := blocks(due, round)
			if seq {
				t.Errorf("claim%s, round %d: a sequential scan of the claims table", dueSuffix[due], round)
			}
			most[due] = max(most[due], n)
		}
	}
	all, _ := blocks(offsets.DueAll, 0)
	t.Logf("blocks of the claims table read by a claim after %d claims settled under a held snapshot: given back at most %.0f, recent leases at most %.0f, every claim %.0f",
		settled, most[offsets.DueGivenBack], most[offsets.DueRecent], all)
	// The bound of the two looks, and the sanity of the set-up: the versions held back are
	// many more blocks than the bound, or the bound proves nothing.
	const bound = 40
	if all < 2*bound {
		t.Errorf("the look at every claim read %.0f blocks, under twice the bound of %d: the snapshot held nothing back?", all, bound)
	}
	for due, n := range most {
		if n > bound {
			t.Errorf("the look%s read %.0f blocks of the claims table, more than %d", dueSuffix[due], n, bound)
		}
	}
}

// TestMaintainReplansGrownClaims checks that a maintenance pass has the settlements planned
// again once the claims table has grown: their generic plans, made while the table was a
// page, read it by a sequential scan, and the server keeps a plan until the table's
// statistics change. With 20,000 claim rows that vacuum has not removed, an ack read the
// whole table until the pass analyzed it, and a few blocks after.
func TestMaintainReplansGrownClaims(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables, pool, db := createTables(t, ctx)
	if _, err := pool.Exec(ctx, "ALTER TABLE "+tables.Claims+" SET (autovacuum_enabled = false)"); err != nil {
		t.Fatal(err)
	}
	store := offsets.NewStore(tables, true)
	const rounds = 16
	insertMessages(t, ctx, store, db, 2*rounds, 16)
	conn, plans := explainedConn(t, ctx, "SET auto_explain.log_buffers = on")
	q := dbx.PgxConn(conn)
	gid, err := store.EnsureGroup(ctx, q, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	token := int64(1 << 61)
	// ack claims one message and acks it on the explained session, and returns the blocks of
	// the claims table the ack's scans read.
	ack := func() float64 {
		t.Helper()
		token++
		cs, err := store.Claim(ctx, q, gid, token, time.Minute, 1, offsets.DueNone, nil)
		if err != nil || len(cs) != 1 {
			t.Fatalf("claim: %d claimed, %v", len(cs), err)
		}
		plans()
		if done, err := store.Ack(ctx, q, gid, offsets.Fence(cs, token)); err != nil || len(done) != 1 {
			t.Fatalf("ack: %d applied, %v", len(done), err)
		}
		n, _ := blocksRead(t, "ack", plans(), tables.Claims)
		return n
	}
	for range rounds / 2 { // the generic plan, made on a table of a page
		ack()
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s ("group_id", "token", "attempts", "visible_at", "offsets")
		SELECT %d, i, 1, now() + interval '1 hour', ARRAY[i] FROM generate_series(1, 20000) i`, tables.Claims, gid+1)); err != nil {
		t.Fatal(err)
	}
	before := ack()
	mc, err := db.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = store.Maintain(ctx, mc, offsets.MaintainOptions{})
	mc.Release()
	if err != nil {
		t.Fatal(err)
	}
	var after float64
	for range rounds/2 - 1 { // planned again: custom plans, then the generic one
		after = max(after, ack())
	}
	t.Logf("blocks of the claims table an ack read with 20,000 claims: %.0f before the pass, at most %.0f after", before, after)
	if after > 20 {
		t.Errorf("after the maintenance pass an ack read %.0f blocks of the claims table (%.0f before it)", after, before)
	}
	if before < 5*after {
		t.Errorf("before the pass an ack read %.0f blocks, after it %.0f: was it ever planned for a small table?", before, after)
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

	conn, q := statementsSession(t, ctx)
	lease, err := store.EnsureGroup(ctx, q, "lease", false)
	if err != nil {
		t.Fatal(err)
	}
	advisory, err := store.EnsureGroup(ctx, q, "advisory", false)
	if err != nil {
		t.Fatal(err)
	}
	for round := range runs {
		for _, due := range []offsets.Due{offsets.DueAll, offsets.DueGivenBack, offsets.DueNone} {
			token := int64(1<<61 + 3*round + int(due))
			cs, err := store.Claim(ctx, q, lease, token, time.Minute, batch, due, nil)
			if err != nil || len(cs) != batch {
				t.Fatalf("lease claim%s, round %d: %d claimed, %v", dueSuffix[due], round, len(cs), err)
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
				t.Fatalf("advisory claim%s, round %d: %d claimed, %v", dueSuffix[due], round, len(cs), err)
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
	// Six claims (two modes, each with the due step, with that of the claims given back, and
	// for new messages only), extend, ack, the orphan walk.
	if seen != 9 {
		t.Errorf("saw %d statements run at least six times, want 9", seen)
	}
}

// TestSettlementsKeepGenericPlans checks that acks and extensions of one message at a time keep
// their generic plan once the claims table has statistics: its rows few, its pages many (the
// dead versions of settled claims), as the maintenance pass's ANALYZE leaves it. A plan made
// for the values given that knows the arrays hold one pair, against a generic plan that
// guesses ten, made the generic plan look dearer on such a table, and the server planned every
// settlement anew (a millisecond or more of CPU each, on the path of the next claim).
func TestSettlementsKeepGenericPlans(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables, pool, db := createTables(t, ctx)
	store := offsets.NewStore(tables, true)
	const runs = 8
	insertMessages(t, ctx, store, db, runs, 16)
	// Dead versions: rows written and deleted, as settled claims leave them until a vacuum.
	if _, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s ("group_id", "token", "attempts", "visible_at", "offsets")
		SELECT 1000, i, 1, now(), ARRAY[i] FROM generate_series(1, 20000) i`, tables.Claims)); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, fmt.Sprintf(`DELETE FROM %s WHERE "group_id" = 1000`, tables.Claims)); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+tables.Claims); err != nil {
		t.Fatal(err)
	}

	conn, q := statementsSession(t, ctx)
	group, err := store.EnsureGroup(ctx, q, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	for round := range runs {
		token := int64(1<<61 + round)
		cs, err := store.Claim(ctx, q, group, token, time.Minute, 1, offsets.DueNone, nil)
		if err != nil || len(cs) != 1 {
			t.Fatalf("claim, round %d: %d claimed, %v", round, len(cs), err)
		}
		fs := offsets.Fence(cs, token)
		if done, err := store.Extend(ctx, q, group, fs, time.Minute); err != nil || !done[cs[0].Offset] {
			t.Fatalf("extend, round %d: %v, %v", round, done, err)
		}
		if done, err := store.Ack(ctx, q, group, fs); err != nil || !done[cs[0].Offset] {
			t.Fatalf("ack, round %d: %v, %v", round, done, err)
		}
	}

	for _, name := range []string{"ack", "extend"} {
		var generic, custom int64
		err := conn.QueryRow(ctx, `SELECT generic_plans, custom_plans FROM pg_prepared_statements
			WHERE starts_with(statement, $1)`, "/* sqlbroker "+name+" */").Scan(&generic, &custom)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if generic+custom != runs {
			t.Errorf("%s: %d runs seen, want %d", name, generic+custom, runs)
		}
		if generic == 0 {
			t.Errorf("%s: planned anew on each of its %d runs (no generic plan) once the claims table had statistics", name, custom)
		}
	}
}

// createTables creates the tables of a new topic and returns them with the pool they were

// insertMessages writes n messages of payload bytes each through store (their UUIDs 0 to
// n-1) and waits until every claim can see them.
func insertMessages(t *testing.T, ctx context.Context, store *offsets.Store, db dbx.Querier, n, payload int) {
	t.Helper()
	rows := make([]offsets.Row, n)
	for i := range rows {
		rows[i] = offsets.Row{UUID: fmt.Sprint(i), Payload: make([]byte, payload), Metadata: "{}"}
	}
	insertRows(t, ctx, store, db, rows)
}

// insertRows inserts rows and waits until every transaction older than the insert has ended,
// so that claims see them.
func insertRows(t *testing.T, ctx context.Context, store *offsets.Store, db dbx.Querier, rows []offsets.Row) {
	t.Helper()
	if err := store.Insert(ctx, db, rows, ""); err != nil {
		t.Fatal(err)
	}
	testdb.WaitHorizon(t, ctx, db, store.T.Messages)
}

// created through.
// keyedRows makes n messages whose order keys go round keys keys ("k0", "k1", ...), each
// with its index as its uuid.
func keyedRows(n, keys int) []offsets.Row {
	rows := make([]offsets.Row, n)
	for i := range rows {
		rows[i] = offsets.Row{UUID: fmt.Sprint(i), Payload: []byte("x"), Metadata: fmt.Sprintf(`{%q: "k%d"}`, offsets.MetaOrderKey, i%keys)}
	}
	return rows
}

// insertGroup inserts rows and returns the id of group "g", made after them and reading them
// from the start.
func insertGroup(t *testing.T, ctx context.Context, store *offsets.Store, db dbx.Querier, rows []offsets.Row) int32 {
	t.Helper()
	insertRows(t, ctx, store, db, rows)
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	return gid
}

// holdSnapshot opens a REPEATABLE READ transaction that has read table, held until the test
// ends: no version written from now on can be removed meanwhile.
func holdSnapshot(t *testing.T, ctx context.Context, pool *pgxpool.Pool, table string) {
	t.Helper()
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = holder.Rollback(context.Background()) })
	if _, err := holder.Exec(ctx, "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ"); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, "SELECT count(*) FROM "+table); err != nil {
		t.Fatal(err)
	}
}

func createTables(t testing.TB, ctx context.Context) (offsets.Tables, *pgxpool.Pool, *dbx.PgxPool) {
	t.Helper()
	tables := offsets.NewTables("", "sqlbroker_", testdb.Topic(t, ""))
	pool := testdb.Pgx(t)
	db := dbx.NewPgxPool(pool)
	if err := tables.Create(ctx, db); err != nil {
		t.Fatal(err)
	}
	return tables, pool, db
}

// statementsSession opens a connection of its own, closed when the test ends: one session, so
// that pg_prepared_statements shows the plans of every statement the test runs on it.
func statementsSession(t *testing.T, ctx context.Context) (*pgx.Conn, dbx.Querier) {
	t.Helper()
	conn, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn, dbx.PgxConn(conn)
}

// planModeConn opens a connection of its own whose prepared statements run under mode
// (plan_cache_mode), closed when the test ends.
func planModeConn(t *testing.T, ctx context.Context, mode string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, "SET plan_cache_mode = "+mode); err != nil {
		t.Fatal(err)
	}
	return conn
}

// lockByHand takes, on conn's session, the advisory lock a claim would take for offset o.
func lockByHand(t *testing.T, ctx context.Context, conn *pgx.Conn, key1 int32, o int64) {
	t.Helper()
	var ok bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock($1::int4, ($2::bigint::bit(32))::int4)", key1, o).Scan(&ok); err != nil || !ok {
		t.Fatalf("lock of offset %d: %v %v", o, ok, err)
	}
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
			conn := planModeConn(t, ctx, mode)
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
			lockByHand(t, ctx, conn, key1, first)
			cs, err := store.ClaimLocked(ctx, q, gid, 1<<61, 3, key1, []int64{first}, offsets.DueNone, nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(cs) != 2 {
				t.Fatalf("claimed %d messages, want the 2 whose locks were free", len(cs))
			}
			// One unlock for the one lock taken by hand; a second one finds nothing to drop.
			var ok, again bool
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

// TestClaimLockedDropsSettledLocks checks the unlocks an advisory claim carries (its $7):
// whatever the claim takes, even nothing, every offset given is unlocked once, and those the
// session did not hold are returned. A lock dropped and taken again by the same claim (a
// nacked message due again at once) stays held once. Under both plan modes.
func TestClaimLockedDropsSettledLocks(t *testing.T) {
	for _, mode := range []string{"force_custom_plan", "force_generic_plan"} {
		t.Run(mode, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			tables, _, db := createTables(t, ctx)
			store := offsets.NewStore(tables, true)
			conn := planModeConn(t, ctx, mode)
			q := dbx.PgxConn(conn)
			gid, err := store.EnsureGroup(ctx, q, "g", false)
			if err != nil {
				t.Fatal(err)
			}
			const key1 = 0x4C0000AB
			held := func(o int64) int {
				var n int
				if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()
					AND classid = $1::int4::oid AND objid = ($2::bigint::bit(32))::int4::oid AND objsubid = 2`, key1, o).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n
			}
			// Two settled messages' locks, held by hand; 1<<40+3 is not held.
			lockByHand(t, ctx, conn, key1, 1<<40)
			lockByHand(t, ctx, conn, key1, 1<<40+1)
			// Nothing to claim: the unlocks run all the same.
			cs, refused, err := store.ClaimLockedPassing(ctx, q, gid, 1<<61, 3, 0, key1, nil, []int64{1 << 40, 1<<40 + 1, 1<<40 + 3}, offsets.DueNone, nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(cs) != 0 || len(refused) != 1 || refused[0] != 1<<40+3 {
				t.Fatalf("claimed %v, refused %v; want nothing claimed and %d refused", cs, refused, int64(1<<40+3))
			}
			if held(1<<40) != 0 || held(1<<40+1) != 0 {
				t.Fatal("a lock given to the claim to drop is still held")
			}

			// A message whose lock the session holds, due again: dropped and taken again, held once.
			if err := store.Insert(ctx, db, []offsets.Row{{UUID: "a", Metadata: "{}"}}, ""); err != nil {
				t.Fatal(err)
			}
			testdb.WaitHorizon(t, ctx, db, tables.Messages)
			var first int64
			if err := conn.QueryRow(ctx, `SELECT min("offset") FROM `+tables.Messages).Scan(&first); err != nil {
				t.Fatal(err)
			}
			lockByHand(t, ctx, conn, key1, first)
			cs, refused, err = store.ClaimLockedPassing(ctx, q, gid, 1<<61, 3, 0, key1, nil, []int64{first}, offsets.DueNone, nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(cs) != 1 || len(refused) != 0 {
				t.Fatalf("claimed %d, refused %v; want the message claimed and nothing refused", len(cs), refused)
			}
			var once, twice bool
			if err := conn.QueryRow(ctx, "SELECT pg_advisory_unlock($1::int4, ($2::bigint::bit(32))::int4), pg_advisory_unlock($1::int4, ($2::bigint::bit(32))::int4)", key1, first).Scan(&once, &twice); err != nil {
				t.Fatal(err)
			}
			if !once || twice {
				t.Errorf("the claimed message's lock is not held exactly once (unlocks: %v, %v)", once, twice)
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
	insertMessages(t, ctx, store, db, size*parts, 64)
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
			c, err := store.Claim(ctx, q, groups["lease"], tok, time.Minute, batch, offsets.DueAll, nil)
			return len(c), err
		},
		"lease, new only": func(tok int64) (int, error) {
			c, err := store.Claim(ctx, q, groups["lease, new only"], tok, time.Minute, batch, offsets.DueNone, nil)
			return len(c), err
		},
		"advisory": func(tok int64) (int, error) {
			c, err := store.ClaimLocked(ctx, q, groups["advisory"], tok, batch, 0x4C000001+groups["advisory"], nil, offsets.DueAll, nil)
			return len(c), err
		},
		"advisory, new only": func(tok int64) (int, error) {
			c, err := store.ClaimLocked(ctx, q, groups["advisory, new only"], tok, batch, 0x4C000001+groups["advisory, new only"], nil, offsets.DueNone, nil)
			return len(c), err
		},
		"ordered": func(tok int64) (int, error) {
			c, _, err := store.ClaimOrdered(ctx, connBeginner{conn}, groups["ordered"], tok, time.Minute, batch, 0, nil)
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

// TestRecentLookTakesRecentLeasesOnly checks what each look at the leases that ran out takes
// back: a lease that ran out within offsets.RecentWindow is taken by DueRecent and DueAll; one
// that ran out before, only by DueAll (a subscription makes that look first, and whenever its
// looks left a gap).
func TestRecentLookTakesRecentLeasesOnly(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables, _, db := createTables(t, ctx)
	store := offsets.NewStore(tables, true)
	rows := []offsets.Row{{UUID: "old", Payload: []byte("old"), Metadata: "{}"}, {UUID: "recent", Payload: []byte("recent"), Metadata: "{}"}}
	if err := store.Insert(ctx, db, rows[:1], ""); err != nil {
		t.Fatal(err)
	}
	testdb.WaitHorizon(t, ctx, db, tables.Messages)
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	claim := func(token int64, ttl time.Duration, due offsets.Due) []string {
		t.Helper()
		cs, err := store.Claim(ctx, db, gid, token, ttl, 10, due, nil)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, c := range cs {
			got = append(got, fmt.Sprintf("%s/%d", c.UUID, c.Attempts))
		}
		return got
	}
	// Leases that ran out twice the window ago and a second ago.
	if got := claim(1, -2*offsets.RecentWindow, offsets.DueNone); fmt.Sprint(got) != "[old/1]" {
		t.Fatalf("first claim: %v", got)
	}
	if err := store.Insert(ctx, db, rows[1:], ""); err != nil {
		t.Fatal(err)
	}
	testdb.WaitHorizon(t, ctx, db, tables.Messages)
	if got := claim(2, -time.Second, offsets.DueNone); fmt.Sprint(got) != "[recent/1]" {
		t.Fatalf("second claim: %v", got)
	}
	if got := claim(3, time.Minute, offsets.DueGivenBack); len(got) != 0 {
		t.Errorf("the look at the claims given back took %v, which someone holds", got)
	}
	if got := claim(4, time.Minute, offsets.DueRecent); fmt.Sprint(got) != "[recent/2]" {
		t.Errorf("the look at recent leases took %v, want the lease that ran out a second ago", got)
	}
	if got := claim(5, time.Minute, offsets.DueAll); fmt.Sprint(got) != "[old/2]" {
		t.Errorf("the look at every claim took %v, want the lease that ran out before the window", got)
	}
}

// TestRecentLookRunsTheFrequentLooksPlan checks that the look at the leases that ran out
// recently (offsets.DueRecent), which a subscription makes about once per IdlePollInterval,
// runs the prepared statement and the generic plan of the look at the claims given back,
// which its claims make all the time: as a statement of its own, spread over a pool's
// connections, nearly every run of it was one of a connection's first five, planned anew for
// its parameters, which made it take several times as long as the claims around it. It also
// checks that the shared plan takes what each look should: the given-back look leaves a lease
// that ran out to the recent look, which takes it.
func TestRecentLookRunsTheFrequentLooksPlan(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tables, _, db := createTables(t, ctx)
	store := offsets.NewStore(tables, true)
	insertRows(t, ctx, store, db, []offsets.Row{{UUID: "m", Payload: []byte("m"), Metadata: "{}"}})
	gid, err := store.EnsureGroup(ctx, db, "g", false)
	if err != nil {
		t.Fatal(err)
	}
	// A lease that ran out a second ago.
	if cs, err := store.Claim(ctx, db, gid, 1, -time.Second, 10, offsets.DueNone, nil); err != nil || len(cs) != 1 {
		t.Fatalf("first claim: %d claimed, %v", len(cs), err)
	}

	conn, q := statementsSession(t, ctx)
	looks := func() (generic, custom int64, statements int) {
		t.Helper()
		rows, err := conn.Query(ctx, `SELECT generic_plans, custom_plans FROM pg_prepared_statements
			WHERE strpos(statement, $1) > 0 AND strpos(statement, 'd0l AS') > 0`, strings.Trim(tables.Claims, `"`))
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		for rows.Next() {
			var g, c int64
			if err := rows.Scan(&g, &c); err != nil {
				t.Fatal(err)
			}
			generic, custom, statements = generic+g, custom+c, statements+1
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return generic, custom, statements
	}
	// Enough looks at the claims given back for the server to settle on its generic plan.
	for i := range 8 {
		cs, err := store.Claim(ctx, q, gid, int64(10+i), time.Minute, 10, offsets.DueGivenBack, nil)
		if err != nil || len(cs) != 0 {
			t.Fatalf("look %d at the claims given back: took %d, %v; want none (the lease that ran out is held)", i, len(cs), err)
		}
	}
	generic, _, _ := looks()
	if generic == 0 {
		t.Fatal("after 8 runs, the server has no generic plan of the look at the claims given back")
	}
	cs, err := store.Claim(ctx, q, gid, 20, time.Minute, 10, offsets.DueRecent, nil)
	if err != nil || len(cs) != 1 || cs[0].UUID != "m" || cs[0].Attempts != 2 {
		t.Fatalf("the look at recent leases took %v, %v; want m on its second attempt", cs, err)
	}
	after, custom, statements := looks()
	if statements != 1 {
		t.Errorf("the looks ran as %d prepared statements, want one", statements)
	}
	if after != generic+1 {
		t.Errorf("the look at recent leases did not run the generic plan (generic plans %d, then %d; custom %d)", generic, after, custom)
	}
}

// TestAckHandingOverReadsTheFirstParkedOfEachKey checks that an ordered ack finds the next
// message of each key it settles through the parked rows' index, one entry per key, and not
// by reading the group's parked rows: with 8 keys and about 100 parked messages each, no node
// of the statement's plan reading the claims table produces more than a few rows per key,
// over enough rounds that the server's generic plan is checked too.
func TestAckHandingOverReadsTheFirstParkedOfEachKey(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables, _, db := createTables(t, ctx)
	store := offsets.NewStore(tables, false)
	const keys, each, rounds = 8, 100, 21
	rows := keyedRows(keys*each, keys)
	gid := insertGroup(t, ctx, store, db, rows)
	var held []offsets.Fenced
	for token := int64(1); token < 20 && len(held) < keys; token++ {
		cs, _, err := store.ClaimOrdered(ctx, db, gid, token, time.Hour, keys, len(rows), nil)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, offsets.Fence(cs, token)...)
	}
	if len(held) != keys {
		t.Fatalf("the ordered claims took %d messages, want the first of each of %d keys", len(held), keys)
	}
	// With every key busy, a claim parks the rest.
	if cs, _, err := store.ClaimOrdered(ctx, db, gid, 99, time.Hour, keys, len(rows), nil); err != nil || len(cs) != 0 {
		t.Fatalf("a claim with every key busy took %d messages, %v", len(cs), err)
	}
	conn, plans := explainedConn(t, ctx)
	q := dbx.PgxConn(conn)
	for round := range rounds {
		token := int64(1000 + round)
		plans()
		done, handed, err := store.AckHandingOver(ctx, q, gid, held, token, time.Hour, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(done) != keys || len(handed) != keys {
			t.Fatalf("round %d: %d acks applied and %d handed over, want %d and %d", round, len(done), len(handed), keys, keys)
		}
		for _, p := range parsePlans(t, fmt.Sprintf("ack handing over, round %d", round), plans()) {
			if node, most := mostReadOn(p.root, tables.Claims); most > 4*keys {
				t.Errorf("round %d: %s on %s%s read %.0f rows for %d keys with %d parked messages:\n%s",
					round, node.NodeType, node.Relation, node.Index, most, keys, keys*(each-1-round), p.text)
			}
			// The look starts at the key's bound (offsets.Claimed.After): the index entries of
			// the parked rows handed out before, which stay until a vacuum, lie below it.
			parked := indexScans(p.root, "_c_park")
			if len(parked) == 0 {
				t.Errorf("round %d: no scan of the parked rows' index:\n%s", round, p.text)
			}
			for _, s := range parked {
				if !strings.Contains(s.IndexCond, "token > ") {
					t.Errorf("round %d: the look for a key's next parked message starts at the key's first entry (%s), not at its bound:\n%s", round, s.IndexCond, p.text)
				}
			}
		}
		held = offsets.Fence(handed, token)
	}
}

// TestOrderedClaimReadsItsRoomWhenNoKeyIsBusy checks that an ordered claim of a group with no
// parked message, whose next messages have keys that are neither busy nor repeated, reads about
// its room's worth of new messages: not the hundreds it may pass when keys are busy, which it
// would read and sort by key only to leave them for the next claim. With every message of a key
// of its own, no scan of the messages' (xid, offset) index may produce more than a few times
// the batch, over enough rounds that the generic plan is checked too; the messages read past
// the room are left unclaimed, so each claim takes the next batch.
func TestOrderedClaimReadsItsRoomWhenNoKeyIsBusy(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables, _, db := createTables(t, ctx)
	store := offsets.NewStore(tables, false)
	const n, batch, rounds = 3000, 10, 8
	gid := insertGroup(t, ctx, store, db, keyedRows(n, n)) // a key each
	conn, plans := explainedConn(t, ctx)
	stem := tables.PartitionName(0)
	stem = stem[:len(stem)-1]
	var newRead func(n planNode) float64
	newRead = func(n planNode) float64 {
		read := 0.0
		if strings.HasPrefix(n.Relation, stem) && strings.HasSuffix(n.Index, "_xid") {
			read = (n.ActualRows + n.Filtered) * n.ActualLoops
		}
		for _, c := range n.Plans {
			read += newRead(c)
		}
		return read
	}
	next := 0
	for round := range rounds {
		plans()
		token := int64(1 + round)
		cs, _, err := store.ClaimOrdered(ctx, connBeginner{conn}, gid, token, time.Hour, batch, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range cs {
			if c.UUID != fmt.Sprint(next) {
				t.Fatalf("round %d: claimed %s, want %d (in order, none passed)", round, c.UUID, next)
			}
			next++
		}
		if len(cs) != batch {
			t.Fatalf("round %d: claimed %d, want %d", round, len(cs), batch)
		}
		for _, p := range parsePlans(t, fmt.Sprintf("ordered claim, round %d", round), plans()) {
			if read := newRead(p.root); read > 3*batch {
				t.Errorf("round %d: read %.0f new messages for a room of %d:\n%s", round, read, batch, p.text)
			}
			// Nothing is due: the due step and the moves out of the rows due do not scan the
			// claims table (whose range of the group holds the versions of the claims acked).
			for _, step := range []string{"CTE d0", "CTE rdel", "CTE rupd"} {
				sub, ok := subtree(p.root, step)
				if !ok {
					continue // the lock of the group's row
				}
				for _, s := range scansOf(sub, tables.Claims) {
					if s.ActualLoops > 0 {
						t.Errorf("round %d: %s ran a %s of the claims table with nothing due:\n%s", round, step, s.NodeType, p.text)
					}
				}
			}
		}
		if _, err := store.Ack(ctx, db, gid, offsets.Fence(cs, token)); err != nil {
			t.Fatal(err)
		}
	}
	// A key that comes twice in the room's worth lets the claim pass many: behind the first
	// message of a run of one key, the rest of the run is parked by one claim.
	if _, err := conn.Exec(ctx, "DELETE FROM "+tables.Messages+" WHERE \"offset\" > (SELECT \"last_offset\" FROM "+tables.Groups+")"); err != nil {
		t.Fatal(err)
	}
	hot := make([]offsets.Row, 200)
	for i := range hot {
		hot[i] = offsets.Row{UUID: fmt.Sprint("hot", i), Payload: []byte("x"), Metadata: fmt.Sprintf(`{%q: "hot"}`, offsets.MetaOrderKey)}
	}
	insertRows(t, ctx, store, db, hot)
	cs, _, err := store.ClaimOrdered(ctx, db, gid, 99, time.Hour, batch, 0, nil)
	if err != nil || len(cs) != 1 || cs[0].UUID != "hot0" {
		t.Fatalf("claim of a run of one key: %v, %v; want hot0", cs, err)
	}
	if got := testdb.Int(t, "SELECT count(*) FROM "+tables.Claims+" WHERE \"order_key\" IS NOT NULL"); got != int64(len(hot)-1) {
		t.Errorf("one claim parked %d of the run's %d messages behind its first, want them all", got, len(hot)-1)
	}
	// With the key busy, a claim hands out no parked message, and its delete of the parked
	// rows it hands out reads none.
	for round := range 7 {
		plans()
		cs, _, err := store.ClaimOrdered(ctx, connBeginner{conn}, gid, int64(200+round), time.Hour, batch, 0, nil)
		if err != nil || len(cs) != 0 {
			t.Fatalf("claim %d with the only key busy: %v, %v", round, cs, err)
		}
		seen := false
		for _, p := range parsePlans(t, fmt.Sprintf("claim with the key busy, round %d", round), plans()) {
			hdel, ok := subtree(p.root, "CTE hdel")
			if !ok {
				continue // the lock of the group's row
			}
			seen = true
			if node, most := mostReadOn(hdel, tables.Claims); most > 0 {
				t.Errorf("round %d: the delete of the parked rows handed out read %.0f rows (%s %s) with none to delete:\n%s", round, most, node.NodeType, node.Index, p.text)
			}
		}
		if !seen {
			t.Fatalf("round %d: no plan of the claim has its step hdel", round)
		}
	}
}

// TestOrderedClaimReadsParkedRowsFromItsFloor checks that an ordered claim given a floor
// (Store.ClaimOrderedFrom) reads the group's parked rows from there: while a snapshot holds
// vacuum back, the parked rows handed out since it began leave their versions and index
// entries below the live ones, and a claim from the bottom of the range reads them all, more
// with every message handed out. The scan of the group's parked rows in step cl, from the
// floor the claims before gave back, must read a small fraction of the blocks that the same
// claim from NoParkFloor reads.
func TestOrderedClaimReadsParkedRowsFromItsFloor(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tables, pool, db := createTables(t, ctx)
	store := offsets.NewStore(tables, false)
	const keys, each = 8, 300
	rows := keyedRows(keys*each, keys)
	gid := insertGroup(t, ctx, store, db, rows)
	// A snapshot that keeps every version written from now on.
	holdSnapshot(t, ctx, pool, tables.Groups)

	conn, plans := explainedConn(t, ctx, "SET auto_explain.log_buffers = on")
	floor := offsets.NoParkFloor
	var held []offsets.Fenced
	claim := func(token int64, from *int64) []offsets.Claimed {
		t.Helper()
		cs, _, err := store.ClaimOrderedFrom(ctx, connBeginner{conn}, gid, token, time.Hour, keys, 100, from, nil)
		if err != nil {
			t.Fatal(err)
		}
		return cs
	}
	// Claims park the messages behind the first of each key; acks hand them over one by one,
	// each taken out of its parked row.
	held = offsets.Fence(claim(1, &floor), 1)
	handed := 0
	// Until few are left parked: the versions of those handed out outnumber the live ones.
	for round := 0; handed < len(rows)-4*keys; round++ {
		if round > 2*each {
			t.Fatalf("after %d rounds, %d of %d handed over", round, handed, len(rows))
		}
		token := int64(2 + round)
		// With every key busy, the claim parks what it passes.
		held = append(held, offsets.Fence(claim(token, &floor), token)...)
		_, next, err := store.AckHandingOver(ctx, db, gid, held, int64(10_000+round), time.Hour, nil)
		if err != nil {
			t.Fatal(err)
		}
		handed += len(next)
		held = offsets.Fence(next, int64(10_000+round))
	}
	if floor == offsets.NoParkFloor {
		t.Fatal("the claims gave back no floor")
	}
	// The scan of cl that reads the parked rows: the range of the primary key up to the
	// highest parked token.
	blocksOfCl := func(raw []string) float64 {
		b, seen := 0.0, false
		for _, p := range parsePlans(t, "ordered claim", raw) {
			if cl, ok := subtree(p.root, "CTE cl"); ok {
				for _, s := range scansOf(cl, tables.Claims) {
					if strings.Contains(s.IndexCond, "<= '-4611686018427387904'") {
						b += s.HitBlocks + s.ReadBlocks
						seen = true
					}
				}
			}
		}
		if !seen {
			t.Fatal("no scan of the parked rows' range in step cl")
		}
		return b
	}
	plans()
	claim(900, &floor)
	fromFloor := blocksOfCl(plans())
	bottom := offsets.NoParkFloor
	claim(901, &bottom)
	fromBottom := blocksOfCl(plans())
	t.Logf("the group's parked rows read %.0f blocks from the floor, %.0f from the bottom, after %d messages handed over", fromFloor, fromBottom, handed)
	if fromBottom < 20 {
		t.Fatalf("from the bottom the claim read %.0f blocks: the held snapshot kept too little for the test", fromBottom)
	}
	if fromFloor*4 > fromBottom {
		t.Errorf("from its floor the claim read %.0f blocks of the group's parked rows, from the bottom %.0f: the floor saves too little", fromFloor, fromBottom)
	}

	// Once every parked message is handed out, the group's next parked rows follow the
	// highest token it ever gave (parked_top), not the bottom of the range: the floor the
	// last claim gave back stays below them.
	for range 4 * each {
		_, next, err := store.AckHandingOver(ctx, db, gid, held, 20_000, time.Hour, nil)
		if err != nil {
			t.Fatal(err)
		}
		held = offsets.Fence(next, 20_000)
		cs := claim(20_001, &floor)
		held = append(held, offsets.Fence(cs, 20_001)...)
		if len(held) == 0 {
			break
		}
	}
	if n := testdb.Int(t, `SELECT count(*) FROM `+tables.Claims); n != 0 {
		t.Fatalf("%d claims rows left after the backlog was handed out", n)
	}
	top := testdb.Int(t, `SELECT "parked_top" FROM `+tables.Groups+` WHERE "group_id" = `+fmt.Sprint(gid))
	if floor > top {
		t.Fatalf("the floor given back, %d, is above the group's highest parked token %d", floor, top)
	}
	insertRows(t, ctx, store, db, rows[:4*keys])
	held = offsets.Fence(claim(20_002, &floor), 20_002)
	if len(held) != keys {
		t.Fatalf("the claim after the backlog took %d messages, want one of each of %d keys", len(held), keys)
	}
	claim(20_003, &floor) // every key busy: parks the rest
	if low := testdb.Int(t, `SELECT min("token") FROM `+tables.Claims+` WHERE "order_key" IS NOT NULL`); low <= top {
		t.Errorf("a parked row after the group had none took token %d, at or below the highest one before, %d", low, top)
	}
	if floor > top+1 {
		t.Errorf("the floor given back, %d, is above the group's parked rows (from %d)", floor, top+1)
	}
	_, next, err := store.AckHandingOver(ctx, db, gid, held, 20_004, time.Hour, nil)
	if err != nil || len(next) != keys {
		t.Fatalf("the ack handed over %d messages (%v), want the next of each of %d keys", len(next), err, keys)
	}
}

// TestSchemaAddsParkedTop checks that groups tables of this schema version made before the
// column parked_top are refused by Check with an error that names it, and that Create adds it.
func TestSchemaAddsParkedTop(t *testing.T) {
	ctx := context.Background()
	tables, pool, db := createTables(t, ctx)
	if _, err := pool.Exec(ctx, `ALTER TABLE `+tables.Groups+` DROP COLUMN "parked_top"`); err != nil {
		t.Fatal(err)
	}
	err := tables.Check(ctx, db)
	if err == nil || !strings.Contains(err.Error(), "parked_top") || !strings.Contains(err.Error(), "InitializeSchema") {
		t.Fatalf("Check without parked_top: %v", err)
	}
	if err := tables.Create(ctx, db); err != nil {
		t.Fatal(err)
	}
	if err := tables.Check(ctx, db); err != nil {
		t.Fatalf("Check after Create: %v", err)
	}
}
