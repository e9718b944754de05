package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/offsets"
)

// explainClaim runs the library's own claim statement (offsets.Store.Claim, batch of 100) once
// for the bench group, inside a transaction that is rolled back, with auto_explain loaded in
// that session and reporting at NOTICE level: the plan PostgreSQL really ran, with timings and
// buffers, without copying the SQL text out of the library and without changing the data.
// Failures are noted and do not stop the run.
//
// atTail first moves the group's position to the last message, inside the same rolled-back
// transaction: the plan of a claim deep into a large table, without draining it first.
func (b *bench) explainClaim(ctx context.Context, topic, label string, atTail bool) {
	plan, err := explainClaimPlan(ctx, b.cfg.url, topic, atTail)
	if err != nil {
		b.results.note(fmt.Sprintf("EXPLAIN of the claim (%s) failed: %v", label, err))
		return
	}
	b.mu.Lock()
	b.plans = append(b.plans, fmt.Sprintf("Plan of the library's claim statement, %s (auto_explain, ANALYZE, BUFFERS; rolled back):\n\n```\n%s\n```\n", label, plan))
	b.mu.Unlock()
}

func explainClaimPlan(ctx context.Context, url, topic string, atTail bool) (string, error) {
	cc, err := pgx.ParseConfig(url)
	if err != nil {
		return "", err
	}
	var mu sync.Mutex
	var notices []string
	cc.RuntimeParams["application_name"] = "sqlbroker-bench-explain"
	cc.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		notices = append(notices, n.Message)
		mu.Unlock()
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, s := range []string{
		"LOAD 'auto_explain'",
		"SET auto_explain.log_min_duration = 0",
		"SET auto_explain.log_analyze = on",
		"SET auto_explain.log_buffers = on",
		"SET auto_explain.log_nested_statements = off",
		"SET auto_explain.log_level = notice",
	} {
		if _, err := conn.Exec(ctx, s); err != nil {
			return "", fmt.Errorf("%s: %w (auto_explain needs the postgresql contrib modules and a superuser)", s, err)
		}
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	store := offsets.NewStore(libTables(topic))
	q := dbx.PgxTx(tx)
	gid, err := store.EnsureGroup(ctx, q, group, false)
	if err != nil {
		return "", fmt.Errorf("group: %w", err)
	}
	if atTail {
		t := libTables(topic)
		if _, err := tx.Exec(ctx, fmt.Sprintf(`UPDATE %s g SET last_xid = l.xid, last_offset = l."offset"
			FROM (SELECT xid, "offset" FROM %s ORDER BY xid DESC, "offset" DESC LIMIT 1) l WHERE g.group_id = $1`,
			t.Groups, t.Messages), gid); err != nil {
			return "", fmt.Errorf("move the group to the tail: %w", err)
		}
	}
	mu.Lock()
	notices = nil
	mu.Unlock()
	claimed, err := store.Claim(ctx, q, gid, 1, 30*time.Second, 100, nil)
	if err != nil {
		return "", fmt.Errorf("claim: %w", err)
	}
	// auto_explain reports a statement when its portal is dropped: in a transaction block that
	// is when the next statement starts. Run one, then take the largest plan seen since the
	// claim began (EnsureGroup's last statement reports during the claim, with a small plan).
	if _, err := tx.Exec(ctx, "SELECT 1"); err != nil {
		return "", err
	}
	mu.Lock()
	defer mu.Unlock()
	best := ""
	for _, n := range notices {
		if p := planOnly(n); len(p) > len(best) {
			best = p
		}
	}
	if best == "" {
		return "", fmt.Errorf("auto_explain sent no plan (%d notices)", len(notices))
	}
	return fmt.Sprintf("claimed %d rows\n%s", len(claimed), best), nil
}

// planOnly cuts the query text out of an auto_explain message: the plan starts at the first
// line that carries a cost or an actual time.
func planOnly(msg string) string {
	lines := strings.Split(msg, "\n")
	for i, l := range lines {
		if strings.Contains(l, "(cost=") || strings.Contains(l, "(actual time=") {
			head := strings.TrimSpace(lines[0])
			if i := strings.Index(head, "plan:"); i >= 0 {
				head = strings.TrimSpace(head[:i])
			}
			return head + "\n" + strings.Join(lines[i:], "\n")
		}
	}
	return ""
}
