package main

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// sqlTracer times every statement on the client side, by contender and statement: with no
// pg_stat_statements on the server (it needs a restart to load), this is where a scenario's
// round trips and their time are seen. Enabled by -trace-sql.
var sqlTracer = &tracer{stats: map[traceKey]*traceStat{}}

type traceKey struct{ app, stmt string }

type traceStat struct {
	calls int
	total time.Duration
	rows  int64
	errs  int
}

type tracer struct {
	mu    sync.Mutex
	stats map[traceKey]*traceStat
}

type traceStartKey struct{}

type traceStart struct {
	at  time.Time
	sql string
}

func (t *tracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, traceStartKey{}, traceStart{at: time.Now(), sql: data.SQL})
}

func (t *tracer) TraceQueryEnd(ctx context.Context, conn *pgx.Conn, data pgx.TraceQueryEndData) {
	st, ok := ctx.Value(traceStartKey{}).(traceStart)
	if !ok {
		return
	}
	d := time.Since(st.at)
	k := traceKey{app: conn.Config().RuntimeParams["application_name"], stmt: statementKey(st.sql)}
	t.mu.Lock()
	s := t.stats[k]
	if s == nil {
		s = &traceStat{}
		t.stats[k] = s
	}
	s.calls++
	s.total += d
	s.rows += data.CommandTag.RowsAffected()
	if data.Err != nil {
		s.errs++
	}
	t.mu.Unlock()
}

var (
	spaces     = regexp.MustCompile(`\s+`)
	valuesTail = regexp.MustCompile(`(?i)\bVALUES\s*\(.*$`)
)

// statementKey shortens SQL text to a recognisable key: whitespace folded, multi-row VALUES
// lists cut, at most 90 characters.
func statementKey(sql string) string {
	s := strings.TrimSpace(spaces.ReplaceAllString(sql, " "))
	if strings.HasPrefix(strings.ToUpper(s), "INSERT") {
		n := strings.Count(s, "),(") + strings.Count(s, "), (") + 1
		s = valuesTail.ReplaceAllString(s, fmt.Sprintf("VALUES ... (%d rows)", n))
	}
	if len(s) > 90 {
		s = s[:87] + "..."
	}
	return s
}

// report returns, for app, a Markdown table of the statements seen since the last reset, the
// most time first, and forgets them.
func (t *tracer) report(app, title string, elapsed time.Duration) string {
	t.mu.Lock()
	type kv struct {
		k traceKey
		s traceStat
	}
	var all []kv
	for k, s := range t.stats {
		if k.app == app {
			all = append(all, kv{k, *s})
			delete(t.stats, k)
		}
	}
	t.mu.Unlock()
	if len(all) == 0 {
		return ""
	}
	slices.SortFunc(all, func(a, b kv) int { return int(b.s.total - a.s.total) })
	var b strings.Builder
	fmt.Fprintf(&b, "SQL seen by the client, %s (wall time %.2fs; time is summed over concurrent connections):\n\n", title, elapsed.Seconds())
	b.WriteString("| statement | calls | total ms | mean ms | rows | errors |\n|---|---:|---:|---:|---:|---:|\n")
	for _, x := range all {
		fmt.Fprintf(&b, "| `%s` | %d | %.0f | %.3f | %d | %d |\n", strings.ReplaceAll(x.k.stmt, "|", `\|`),
			x.s.calls, ms(x.s.total), ms(x.s.total)/float64(x.s.calls), x.s.rows, x.s.errs)
	}
	return b.String()
}

// reset forgets everything seen for app.
func (t *tracer) reset(app string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for k := range t.stats {
		if k.app == app {
			delete(t.stats, k)
		}
	}
}
