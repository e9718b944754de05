package main

import (
	"fmt"
	"html"
	"math"
	"slices"
	"sort"
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

// short is v as a row's title shows it: 100k, 1M.
func short(v int) string {
	switch {
	case v >= 1_000_000 && v%1_000_000 == 0:
		return fmt.Sprintf("%dM", v/1_000_000)
	case v >= 1000 && v%1000 == 0:
		return fmt.Sprintf("%dk", v/1000)
	}
	return fmt.Sprint(v)
}

func rowDefs(c *config) []rowDef {
	n := short
	h := c.slowHandler.String()
	return append([]rowDef{
		{"1", 1, fmt.Sprintf("drain %s, no-op handler", n(c.drainN)), "msg/s", false},
		{"1c", 1, "  client CPU per message", "µs", true},
		{"1s", 1, "  server CPU per message", "µs", true},
		{"1a", 1, "  drain of this claim mode / the lease mode's (row 1)", "x", false},
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
		{"8c", 8, "  start, pgx: transactions per subscription beyond the steady rate", "tx", true},
		{"8d", 8, "  start, database/sql: transactions per subscription beyond the steady rate", "tx", true},
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
		{"11f", 11, "  InnoDB: rows read per message handled, last 5 s of the hold", "rows", true},
		{"11g", 11, "  InnoDB: history list length at the end of the hold", "trx", true},
	}, orderedRows(c)...)
}

// cell is one row's figures of one contender: one per round that measured it, or why there is
// none.
type cell struct {
	byRound map[int]float64
	text    string // shown when no round has a figure: "n/a", "error", "= lease"
}

// results holds every figure of the run, by row, contender and round. Scenarios run in rounds
// (see runScenarios), and set the figures of the round running now.
type results struct {
	mu    sync.Mutex
	round int // the round running now, from 0
	cells map[string]map[contender]*cell
	notes []note
	defs  []rowDef
}

// note is a remark on the run; the same text from several rounds is printed once.
type note struct {
	text   string
	rounds []int
}

func (r *results) cellOf(id string, c contender) *cell {
	if r.cells == nil {
		r.cells = map[string]map[contender]*cell{}
	}
	if r.cells[id] == nil {
		r.cells[id] = map[contender]*cell{}
	}
	x := r.cells[id][c]
	if x == nil {
		x = &cell{byRound: map[int]float64{}}
		r.cells[id][c] = x
	}
	return x
}

// startRound makes the figures set from now on those of round n.
func (r *results) startRound(n int) {
	r.mu.Lock()
	r.round = n
	r.mu.Unlock()
}

// set records c's figure of row id in the current round.
func (r *results) set(id string, c contender, v float64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.cellOf(id, c).byRound[r.round] = v
}

// setText says why c has no figure in row id, unless it has one already (or a reason).
func (r *results) setText(id string, c contender, text string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	x := r.cellOf(id, c)
	if len(x.byRound) == 0 && x.text == "" {
		x.text = text
	}
}

// get is c's figure of row id in the current round.
func (r *results) get(id string, c contender) (float64, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	x := r.cells[id][c]
	if x == nil {
		return 0, false
	}
	v, ok := x.byRound[r.round]
	return v, ok
}

// rounds are c's figures of row id by round.
func (r *results) rounds(id string, c contender) map[int]float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	x := r.cells[id][c]
	if x == nil {
		return nil
	}
	out := make(map[int]float64, len(x.byRound))
	for k, v := range x.byRound {
		out[k] = v
	}
	return out
}

func (r *results) note(s string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range r.notes {
		if r.notes[i].text == s {
			if rs := r.notes[i].rounds; rs[len(rs)-1] != r.round {
				r.notes[i].rounds = append(rs, r.round)
			}
			return
		}
	}
	r.notes = append(r.notes, note{text: s, rounds: []int{r.round}})
}

// noteLines are the notes to print; with several rounds, each says the rounds it comes from
// unless it came from every one.
func (r *results) noteLines(rounds int) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, n := range r.notes {
		if rounds <= 1 || len(n.rounds) == rounds {
			out = append(out, n.text)
			continue
		}
		rs := make([]string, len(n.rounds))
		for i, x := range n.rounds {
			rs[i] = fmt.Sprint(x + 1)
		}
		word := "round"
		if len(rs) > 1 {
			word = "rounds"
		}
		out = append(out, fmt.Sprintf("%s %s: %s", word, strings.Join(rs, ", "), n.text))
	}
	return out
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
	return formatRatioNumber(v) + "x"
}

func formatRatioNumber(v float64) string {
	switch {
	case v >= 10:
		return fmt.Sprintf("%.0f", v)
	case v >= 0.1:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.3f", v)
	}
}

// median of vs, which it sorts; the mean of the middle two for an even count.
func median(vs []float64) float64 {
	sort.Float64s(vs)
	n := len(vs)
	if n%2 == 1 {
		return vs[n/2]
	}
	return (vs[n/2-1] + vs[n/2]) / 2
}

// stats are the median and the range (min, max) of figures over rounds.
type stats struct {
	med, lo, hi float64
	n           int
}

func statsOf(vs []float64) (stats, bool) {
	if len(vs) == 0 {
		return stats{}, false
	}
	vs = append([]float64(nil), vs...)
	m := median(vs) // sorts
	return stats{med: m, lo: vs[0], hi: vs[len(vs)-1], n: len(vs)}, true
}

// value is the median of c's figures of row id over the rounds.
func (r *results) value(id string, c contender) (stats, bool) {
	var vs []float64
	for _, v := range r.rounds(id, c) {
		vs = append(vs, v)
	}
	return statsOf(vs)
}

// derive fills the rows computed from others of the same run, round by round: 1a, the
// advisory mode's drain over the lease mode's; 7e, how much of the raw limit of its own claim
// and settle statements (7c) a contender's end-to-end drain (1) reaches. Round n of one
// scenario is paired with round n of the other.
func (r *results) derive(cs []contender) {
	if slices.Contains(cs, lease) && slices.Contains(cs, advisory) {
		base := r.rounds("1", lease)
		for k, av := range r.rounds("1", advisory) {
			if lv, ok := base[k]; ok && lv > 0 {
				r.mu.Lock()
				r.cellOf("1a", advisory).byRound[k] = av / lv
				r.mu.Unlock()
			}
		}
	}
	for _, c := range cs {
		if !c.isLibrary() {
			continue
		}
		d, raw := r.rounds("1", c), r.rounds("7c", c)
		for k, dv := range d {
			if rv, ok := raw[k]; ok && rv > 0 {
				r.mu.Lock()
				r.cellOf("7e", c).byRound[k] = dv / rv
				r.mu.Unlock()
			}
		}
	}
}

// comparedWithPeer reports whether c's figures get a ratio to its peer's, watermill-sql on the
// same database: the library on PostgreSQL and on MySQL does; on SQLite it runs on a database
// watermill-sql is not measured on, where a ratio would say nothing about either.
func (c contender) comparedWithPeer() bool { return c.isLibrary() && !c.onSQLite() }

// peer is the watermill-sql that c's figures are compared with: the one on c's database.
func (c contender) peer() contender {
	if c.onMySQL() {
		return watermillSQLMySQL
	}
	return watermillSQL
}

// markdown renders the table: every library figure on PostgreSQL or MySQL beside its ratio to
// its peer's figure, watermill-sql's on the same database (value / the peer's value, whatever
// the direction of the unit), when the peer ran too. A figure is the median over the rounds;
// a ratio is the median of the ratios of each round (the two contenders ran one after the
// other in it), with their range, min to max. A range that has 1x inside it is marked: the
// row shows no lead either way.
func (r *results) markdown(cs []contender) string {
	var b strings.Builder
	var libs []contender
	for _, c := range cs {
		if c.comparedWithPeer() && slices.Contains(cs, c.peer()) {
			libs = append(libs, c)
		}
	}
	b.WriteString("| # | scenario | unit | better |")
	for _, c := range cs {
		fmt.Fprintf(&b, " %s |", c)
	}
	for _, c := range libs {
		fmt.Fprintf(&b, " %s / %s |", c, c.peer())
	}
	b.WriteString("\n|---|---|---|---|")
	for range cs {
		b.WriteString("---:|")
	}
	for range libs {
		b.WriteString("---:|")
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
		for _, c := range libs {
			fmt.Fprintf(&b, " %s |", r.ratio(d.id, c))
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

// show is c's figure of row id: the median over the rounds.
func (r *results) show(id string, c contender) string {
	if st, ok := r.value(id, c); ok {
		return formatValue(st.med)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if x := r.cells[id][c]; x != nil && x.text != "" {
		return x.text
	}
	return "-"
}

// ratioStats are the median and range of c's figure over its peer's for row id, each round's
// figures divided by each other.
func (r *results) ratioStats(id string, c contender) (stats, bool) {
	mine, peer := r.rounds(id, c), r.rounds(id, c.peer())
	var vs []float64
	for k, v := range mine {
		if p, ok := peer[k]; ok && p != 0 {
			vs = append(vs, v/p)
		}
	}
	return statsOf(vs)
}

// ratio is "median" with one round, "median (min-max)" with more, and a * when the range has
// 1x inside it.
func (r *results) ratio(id string, c contender) string {
	st, ok := r.ratioStats(id, c)
	if !ok {
		return "-"
	}
	if st.n == 1 {
		return formatRatio(st.med)
	}
	mark := ""
	if st.lo < 1 && st.hi > 1 {
		mark = " *"
	}
	return fmt.Sprintf("%s (%s-%s)%s", formatRatio(st.med), formatRatioNumber(st.lo), formatRatioNumber(st.hi), mark)
}

// svg draws, for every row, each library contender's figure over its peer's (watermill-sql's
// on the same database) in the same run: the ratio of the table's last columns (the median
// over the rounds), in the same direction (never inverted), on a log scale with watermill-sql
// at 1x, with a whisker over the range of the rounds' ratios. Every row says which side is better, so a bar to the left
// of 1x is the library ahead on a lower-is-better row. A ratio beyond the axis is drawn to the
// axis end with an arrow, and its true value is written beside it. Hand-written SVG: no
// dependency.
func (r *results) svg(cs []contender, rounds int) string {
	type bar struct {
		c     contender
		ratio stats
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
			st, ok := r.ratioStats(d.id, c)
			if !ok || st.lo <= 0 {
				continue
			}
			bars = append(bars, bar{c: c, ratio: st, raw: fmt.Sprintf("%s vs %s %s", r.show(d.id, c), r.show(d.id, c.peer()), d.unit)})
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
	colors := map[contender]string{lease: "#2b6cb0", advisory: "#38a169", mysqlLease: "#dd6b20"}
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
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="15" font-weight="bold">watermill-sqlbroker / watermill-sql (same run, %d interleaved rounds), log scale</text>`+"\n", leftPad, rounds)
	fmt.Fprintf(&b, `<text x="%d" y="40" fill="#555">bar = median of the rounds' library figure / watermill-sql figure on the same database, as in the table; whisker = their range; red line = watermill-sql (1x); an arrow marks a bar cut at the axis end</text>`+"\n", leftPad)
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
			lg := math.Log10(br.ratio.med)
			clipped := lg > maxLog || lg < minLog
			end := pos(math.Max(minLog, math.Min(maxLog, lg)))
			x0, x1 := pos(0), end
			if x1 < x0 {
				x0, x1 = x1, x0
			}
			col := colors[br.c]
			fmt.Fprintf(&b, `<rect x="%.1f" y="%.0f" width="%.1f" height="%d" fill="%s"><title>%s: %s</title></rect>`+"\n",
				x0, by+1, math.Max(x1-x0, 1), barH-2, col, br.c, html.EscapeString(br.raw))
			if br.ratio.n > 1 {
				clip := func(v float64) float64 { return pos(math.Max(minLog, math.Min(maxLog, math.Log10(v)))) }
				wl, wh, wy := clip(br.ratio.lo), clip(br.ratio.hi), by+float64(barH)/2
				fmt.Fprintf(&b, `<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#222" stroke-width="1.5"/>`+"\n", wl, wy, wh, wy)
				for _, wx := range []float64{wl, wh} {
					fmt.Fprintf(&b, `<line x1="%.1f" y1="%.0f" x2="%.1f" y2="%.0f" stroke="#222" stroke-width="1.5"/>`+"\n", wx, by+3, wx, by+barH-3)
				}
			}
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
				labelW+plotW+12, by+barH-3, mark, ratioLabel(br.ratio), html.EscapeString(br.raw))
		}
		y += blockH + gap
	}
	b.WriteString("</svg>\n")
	return b.String()
}

// ratioLabel is a ratio as the table shows it, without the mark.
func ratioLabel(st stats) string {
	if st.n == 1 {
		return formatRatio(st.med)
	}
	return fmt.Sprintf("%s (%s-%s)", formatRatio(st.med), formatRatioNumber(st.lo), formatRatioNumber(st.hi))
}
