package main

import (
	"fmt"
	"html"
	"math"
	"strings"
	"sync"
)

// rowDef is one line of the table.
type rowDef struct {
	id          string
	scenario    int
	name        string
	unit        string
	lowerBetter bool
}

func rowDefs(c *config) []rowDef {
	n := func(v int) string {
		switch {
		case v >= 1_000_000 && v%1_000_000 == 0:
			return fmt.Sprintf("%dM", v/1_000_000)
		case v >= 1000 && v%1000 == 0:
			return fmt.Sprintf("%dk", v/1000)
		}
		return fmt.Sprint(v)
	}
	h := c.slowHandler.String()
	return []rowDef{
		{"1", 1, fmt.Sprintf("drain %s, no-op handler", n(c.drainN)), "msg/s", false},
		{"1c", 1, "  client CPU per message", "µs", true},
		{"1s", 1, "  server CPU per message", "µs", true},
		{"2a", 2, fmt.Sprintf("%s handler, 16 in flight", h), "msg/s", false},
		{"2b", 2, fmt.Sprintf("%s handler, 256 in flight", h), "msg/s", false},
		{"3a", 3, fmt.Sprintf("%s handler, 1 subscriber (MaxInFlight %d)", h, c.instInFlight), "msg/s", false},
		{"3b", 3, fmt.Sprintf("%s handler, 4 subscribers, one group", h), "msg/s", false},
		{"3c", 3, "  4 subscribers / 1", "x", false},
		{"4a", 4, fmt.Sprintf("latency p50 at %d msg/s, publisher in process", c.latencyRate), "ms", true},
		{"4b", 4, fmt.Sprintf("latency p99 at %d msg/s, publisher in process", c.latencyRate), "ms", true},
		{"4c", 4, fmt.Sprintf("latency p50 at %d msg/s, publisher elsewhere", c.latencyRate), "ms", true},
		{"4d", 4, fmt.Sprintf("latency p99 at %d msg/s, publisher elsewhere", c.latencyRate), "ms", true},
		{"5a", 5, "publish, batches of 100", "msg/s", false},
		{"5b", 5, fmt.Sprintf("publish, 1 per call, %d goroutines", c.publishWorkers), "msg/s", false},
		{"6a", 6, fmt.Sprintf("drain %s, no-op handler", n(c.memoryN)), "msg/s", false},
		{"6b", 6, fmt.Sprintf("  peak HeapInuse while %s drain", n(c.memoryN)), "MiB", true},
		{"6c", 6, fmt.Sprintf("  peak Sys while %s drain", n(c.memoryN)), "MiB", true},
		{"7a", 7, "raw insert, batches of 100, 1 goroutine", "msg/s", false},
		{"7b", 7, fmt.Sprintf("raw insert, 1 row, %d goroutines", c.publishWorkers), "msg/s", false},
		{"7c", 7, "raw claim+ack, batches of 100, 1 goroutine", "msg/s", false},
		{"7d", 7, "raw insert, 1 row, 1 goroutine (the commit floor)", "msg/s", false},
		{"7e", 7, fmt.Sprintf("  drain %s (row 1) / raw claim+ack (row 7c)", n(c.drainN)), "x", false},
		{"8a", 8, fmt.Sprintf("idle, %d subscriptions (advisory %d), pgx: per subscription", c.idleSubs, c.idleLockSubs), "tx/s", true},
		{"8b", 8, fmt.Sprintf("idle, %d subscriptions (advisory %d), database/sql: per subscription", c.idleSubs, c.idleLockSubs), "tx/s", true},
		{"9a", 9, fmt.Sprintf("%d subscriptions (advisory %d), pgx: connections", c.manySubs, c.idleLockSubs), "conns", true},
		{"9b", 9, "  goroutines per subscription", "", true},
		{"9c", 9, "  heap per subscription", "KiB", true},
		{"9d", 9, "  idle transactions per subscription", "tx/s", true},
		{"9e", 9, fmt.Sprintf("%d subscriptions (advisory %d), database/sql: connections", c.manySubs, c.idleLockSubs), "conns", true},
		{"9f", 9, "  goroutines per subscription", "", true},
		{"9g", 9, "  heap per subscription", "KiB", true},
		{"9h", 9, "  idle transactions per subscription", "tx/s", true},
		{"10a", 10, "one group, 1 consumer, no-op handler", "msg/s", false},
		{"10b", 10, "one group, 2 consumers", "msg/s", false},
		{"10c", 10, "one group, 4 consumers", "msg/s", false},
		{"10d", 10, "one group, 8 consumers", "msg/s", false},
		{"10e", 10, "  claims/s, 1 consumer", "claims/s", false},
		{"10f", 10, "  claims/s, 2 consumers", "claims/s", false},
		{"10g", 10, "  claims/s, 4 consumers", "claims/s", false},
		{"10h", 10, "  claims/s, 8 consumers", "claims/s", false},
		{"11a", 11, fmt.Sprintf("hold: %s msg/s offered, %d group(s), vacuum held %s: lowest handled / offered over %d s", n(c.holdRate), c.holdGroups, c.holdFor, holdWindow), "%", false},
		{"11b", 11, "  max lag", "msgs", true},
		{"11c", 11, "  claims: index entries per scan, last 5 s of the hold", "entries", true},
		{"11d", 11, "  messages: index entries per scan, last 5 s of the hold", "entries", true},
		{"11e", 11, "  tables and indexes at the end of the hold", "MiB", true},
	}
}

// cell is one figure, or why there is none.
type cell struct {
	v    float64
	ok   bool
	text string // shown instead of a figure: "n/a", "error", "= lease"
}

type results struct {
	mu    sync.Mutex
	cells map[string]map[contender]cell
	notes []string
	defs  []rowDef
}

func (r *results) set(id string, c contender, v float64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cells == nil {
		r.cells = map[string]map[contender]cell{}
	}
	if r.cells[id] == nil {
		r.cells[id] = map[contender]cell{}
	}
	r.cells[id][c] = cell{v: v, ok: true}
}

func (r *results) setText(id string, c contender, text string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cells == nil {
		r.cells = map[string]map[contender]cell{}
	}
	if r.cells[id] == nil {
		r.cells[id] = map[contender]cell{}
	}
	if _, done := r.cells[id][c]; !done {
		r.cells[id][c] = cell{text: text}
	}
}

func (r *results) get(id string, c contender) (cell, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	x, ok := r.cells[id][c]
	return x, ok
}

func (r *results) note(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.notes = append(r.notes, s)
}

// markScenario fills every row of scenario id that c has no figure for with text.
func (r *results) markScenario(id int, c contender, text string) {
	for _, d := range r.defs {
		if d.scenario == id {
			r.setText(d.id, c, text)
		}
	}
}

func (r *results) failScenario(id int, c contender, err error) {
	r.markScenario(id, c, "error")
	r.note(fmt.Sprintf("%s, scenario %d failed: %v", c, id, err))
}

func formatValue(v float64) string {
	switch a := math.Abs(v); {
	case a >= 100:
		return fmt.Sprintf("%.0f", v)
	case a >= 10:
		return fmt.Sprintf("%.1f", v)
	default:
		return fmt.Sprintf("%.2f", v)
	}
}

func formatRatio(v float64) string {
	switch {
	case v >= 10:
		return fmt.Sprintf("%.0fx", v)
	case v >= 0.1:
		return fmt.Sprintf("%.2fx", v)
	default:
		return fmt.Sprintf("%.3fx", v)
	}
}

// derive fills the rows computed from others of the same run: 7e, how much of the raw limit of
// its own claim and settle statements (7c) a contender's end-to-end drain (1) reaches.
func (r *results) derive(cs []contender) {
	for _, c := range cs {
		if !c.isLibrary() {
			continue
		}
		d, ok1 := r.get("1", c)
		raw, ok2 := r.get("7c", c)
		if ok1 && ok2 && d.ok && raw.ok && raw.v > 0 {
			r.set("7e", c, d.v/raw.v)
		}
	}
}

// comparedWithPeer reports whether c's figures get a ratio to watermill-sql's: the library on
// the same PostgreSQL does; on SQLite it runs on another database, where a ratio would say
// nothing about either.
func (c contender) comparedWithPeer() bool { return c.isLibrary() && !c.onSQLite() }

// markdown renders the table: every library figure on PostgreSQL beside its ratio to
// watermill-sql's figure in the same run (value / watermill-sql's value, whatever the
// direction of the unit).
func (r *results) markdown(cs []contender) string {
	var b strings.Builder
	var libs []contender
	hasPeer := false
	for _, c := range cs {
		switch {
		case c.comparedWithPeer():
			libs = append(libs, c)
		case c == watermillSQL:
			hasPeer = true
		}
	}
	b.WriteString("| # | scenario | unit | better |")
	for _, c := range cs {
		fmt.Fprintf(&b, " %s |", c)
	}
	if hasPeer {
		for _, c := range libs {
			fmt.Fprintf(&b, " %s / watermill-sql |", c)
		}
	}
	b.WriteString("\n|---|---|---|---|")
	for range cs {
		b.WriteString("---:|")
	}
	if hasPeer {
		for range libs {
			b.WriteString("---:|")
		}
	}
	b.WriteString("\n")
	for _, d := range r.defs {
		if !r.hasRow(d.id) {
			continue
		}
		better := "higher"
		if d.lowerBetter {
			better = "lower"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |", d.id, strings.TrimSpace(d.name), d.unit, better)
		for _, c := range cs {
			fmt.Fprintf(&b, " %s |", r.show(d.id, c))
		}
		if hasPeer {
			for _, c := range libs {
				fmt.Fprintf(&b, " %s |", r.ratio(d.id, c))
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

func (r *results) hasRow(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.cells[id]) > 0
}

func (r *results) show(id string, c contender) string {
	x, ok := r.get(id, c)
	switch {
	case !ok:
		return "-"
	case x.ok:
		return formatValue(x.v)
	default:
		return x.text
	}
}

// ratioValue is c's figure over watermill-sql's for row id.
func (r *results) ratioValue(id string, c contender) (float64, bool) {
	x, ok1 := r.get(id, c)
	p, ok2 := r.get(id, watermillSQL)
	if !ok1 || !ok2 || !x.ok || !p.ok || p.v == 0 {
		return 0, false
	}
	return x.v / p.v, true
}

func (r *results) ratio(id string, c contender) string {
	if v, ok := r.ratioValue(id, c); ok {
		return formatRatio(v)
	}
	return "-"
}

// svg draws, for every row, each claim mode's figure over watermill-sql's figure in the same
// run: the ratio of the table's last columns, in the same direction (never inverted), on a log
// scale with watermill-sql at 1x. Every row says which side is better, so a bar to the left of
// 1x is the library ahead on a lower-is-better row. A ratio beyond the axis is drawn to the axis
// end with an arrow, and its true value is written beside it. Hand-written SVG: no dependency.
func (r *results) svg(cs []contender) string {
	type bar struct {
		c     contender
		ratio float64
		raw   string
	}
	type line struct {
		label string
		bars  []bar
	}
	var lines []line
	for _, d := range r.defs {
		var bars []bar
		for _, c := range cs {
			if !c.comparedWithPeer() {
				continue
			}
			v, ok := r.ratioValue(d.id, c)
			if !ok || v <= 0 {
				continue
			}
			bars = append(bars, bar{c: c, ratio: v, raw: fmt.Sprintf("%s vs %s %s", r.show(d.id, c), r.show(d.id, watermillSQL), d.unit)})
		}
		if len(bars) > 0 {
			better := "higher is better"
			if d.lowerBetter {
				better = "lower is better"
			}
			lines = append(lines, line{label: fmt.Sprintf("%s  %s (%s)", d.id, strings.TrimSpace(d.name), better), bars: bars})
		}
	}
	const (
		width   = 1160
		labelW  = 450 // the plot starts here; labels end well before it, clear of an arrow head
		plotW   = 450
		barH    = 14
		gap     = 10
		top     = 70
		minLog  = -3.0 // 0.001x
		maxLog  = 3.0  // 1000x
		leftPad = 10
		arrow   = 7.0 // length of the arrow head on a clipped bar
	)
	colors := map[contender]string{lease: "#2b6cb0", advisory: "#38a169"}
	height := top + 40
	for _, l := range lines {
		height += len(l.bars)*barH + gap
	}
	pos := func(lg float64) float64 {
		return labelW + (lg-minLog)/(maxLog-minLog)*plotW
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="15" font-weight="bold">watermill-sqlbroker / watermill-sql (same run), log scale</text>`+"\n", leftPad)
	fmt.Fprintf(&b, `<text x="%d" y="40" fill="#555">bar = library figure / watermill-sql figure, as in the table; the red line is watermill-sql (1x); an arrow marks a bar cut at the axis end, its true ratio written beside</text>`+"\n", leftPad)
	lx := leftPad
	for _, c := range cs {
		if col, ok := colors[c]; ok {
			fmt.Fprintf(&b, `<rect x="%d" y="48" width="12" height="12" fill="%s"/><text x="%d" y="58">%s</text>`+"\n", lx, col, lx+16, c)
			lx += 110
		}
	}
	// Grid.
	for lg := minLog; lg <= maxLog; lg++ {
		gx := pos(lg)
		stroke := "#ddd"
		if lg == 0 {
			stroke = "#c53030"
		}
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="%s"/>`+"\n", gx, top-4, gx, height-30, stroke)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle" fill="#555">%gx</text>`+"\n", gx, height-14, math.Pow(10, lg))
	}
	y := top
	for _, l := range lines {
		blockH := len(l.bars) * barH
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", leftPad, y+blockH/2+4, html.EscapeString(l.label))
		for i, br := range l.bars {
			by := float64(y + i*barH)
			lg := math.Log10(br.ratio)
			clipped := lg > maxLog || lg < minLog
			end := pos(math.Max(minLog, math.Min(maxLog, lg)))
			x0, x1 := pos(0), end
			if x1 < x0 {
				x0, x1 = x1, x0
			}
			col := colors[br.c]
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.0f" width="%.1f" height="%d" fill="%s"><title>%s: %s</title></rect>`+"\n",
				x0, by+1, math.Max(x1-x0, 1), barH-2, col, br.c, html.EscapeString(br.raw))
			mark := ""
			if clipped {
				// An arrow head past the axis end, pointing the way the bar goes on.
				dir := 1.0
				mark = "› "
				if lg < minLog {
					dir = -1
					mark = "‹ "
				}
				fmt.Fprintf(&b, `<polygon points="%.1f,%.0f %.1f,%.0f %.1f,%.0f" fill="%s"/>`+"\n",
					end, by, end+dir*arrow, by+barH/2, end, by+barH, col)
				mark += "clipped, "
			}
			fmt.Fprintf(&b, `<text x="%d" y="%.0f" font-size="10" fill="#333">%s%s (%s)</text>`+"\n",
				labelW+plotW+12, by+barH-3, mark, formatRatio(br.ratio), html.EscapeString(br.raw))
		}
		y += blockH + gap
	}
	b.WriteString("</svg>\n")
	return b.String()
}
