package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
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

// explainPeer records the plan of watermill-sql's select, like explainClaim.
func (b *bench) explainPeer(ctx context.Context, topic, label string) {
	plan, err := explainWsqlSelect(ctx, b.cfg.url, topic)
	if err != nil {
		b.results.note(fmt.Sprintf("EXPLAIN of watermill-sql's select (%s) failed: %v", label, err))
		return
	}
	b.mu.Lock()
	b.plans = append(b.plans, fmt.Sprintf("Plan of watermill-sql's select, %s (auto_explain, ANALYZE, BUFFERS; rolled back):\n\n```\n%s\n```\n", label, plan))
	b.mu.Unlock()
}

func explainClaimPlan(ctx context.Context, url, topic string, atTail bool) (string, error) {
	return explainIn(ctx, url, pgx.TxOptions{}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		store := offsets.NewStore(libTables(topic), true)
		q := dbx.PgxTx(tx)
		gid, err := store.EnsureGroup(ctx, q, group, false)
		if err != nil {
			return 0, fmt.Errorf("group: %w", err)
		}
		if atTail {
			t := libTables(topic)
			if _, err := tx.Exec(ctx, fmt.Sprintf(`UPDATE %s g SET last_xid = l.xid, last_offset = l."offset"
				FROM (SELECT xid, "offset" FROM %s ORDER BY xid DESC, "offset" DESC LIMIT 1) l WHERE g.group_id = $1`,
				t.Groups, t.Messages), gid); err != nil {
				return 0, fmt.Errorf("move the group to the tail: %w", err)
			}
		}
		return -1, nil // the statement to explain comes next
	}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		store := offsets.NewStore(libTables(topic), true)
		q := dbx.PgxTx(tx)
		gid, err := store.EnsureGroup(ctx, q, group, false)
		if err != nil {
			return 0, err
		}
		claimed, err := store.Claim(ctx, q, gid, 1, 30*time.Second, 100, offsets.DueAll, nil)
		return len(claimed), err
	})
}

// explainWsqlSelect does the same for watermill-sql's select of the next batch, as its
// subscriber runs it (REPEATABLE READ), with the consumer group at the head.
func explainWsqlSelect(ctx context.Context, url, topic string) (string, error) {
	oa, sa := wsqlOffsets(), wsqlSchema()
	return explainIn(ctx, url, pgx.TxOptions{IsoLevel: pgx.RepeatableRead}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		before, err := oa.BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams{Topic: topic, ConsumerGroup: group})
		if err != nil {
			return 0, err
		}
		for _, q := range before {
			if _, err := tx.Exec(ctx, q.Query, q.Args...); err != nil {
				return 0, err
			}
		}
		return -1, nil
	}, func(ctx context.Context, tx pgx.Tx) (int, error) {
		sel, err := sa.SelectQuery(wsql.SelectQueryParams{Topic: topic, ConsumerGroup: group, OffsetsAdapter: oa})
		if err != nil {
			return 0, err
		}
		rows, err := tx.Query(ctx, sel.Query, sel.Args...)
		if err != nil {
			return 0, err
		}
		n := 0
		for rows.Next() {
			n++
		}
		rows.Close()
		return n, rows.Err()
	})
}

// explainIn opens a session with auto_explain, runs setup and then stmt in one transaction
// that is rolled back, and returns the plan of stmt.
func explainIn(ctx context.Context, url string, opts pgx.TxOptions, setup, stmt func(context.Context, pgx.Tx) (int, error)) (string, error) {
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
	tx, err := conn.BeginTx(ctx, opts)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := setup(ctx, tx); err != nil {
		return "", err
	}
	mu.Lock()
	notices = nil
	mu.Unlock()
	claimed, err := stmt(ctx, tx)
	if err != nil {
		return "", fmt.Errorf("statement: %w", err)
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
	return fmt.Sprintf("returned %d rows\n%s", claimed, best), nil
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
