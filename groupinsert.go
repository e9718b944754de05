package sqlbroker

import (
	"context"
	"strings"
	"sync"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// groupInsert groups the concurrent publishes of a pool publisher, per messages table (see
// publish): the rows of the calls that queue while a statement for the table runs go into
// the next one together, up to maxRows rows and maxBytes bytes.
type groupInsert struct {
	maxRows  int // MaxGroupRows
	maxBytes int // MaxStatementBytes

	mu     sync.Mutex
	groups map[string]*group // by messages table
}

func newGroupInsert(maxRows, maxBytes int) *groupInsert {
	return &groupInsert{maxRows: maxRows, maxBytes: maxBytes, groups: map[string]*group{}}
}

// group queues the calls for one messages table while a statement for it runs.
type group struct {
	mu      sync.Mutex
	running bool       // a leader is writing, or has been chosen
	queue   []*pending // calls waiting, in arrival order
}

type pendingState int

const (
	pendingQueued  pendingState = iota // in the queue, rows not sent
	pendingLeading                     // told to write the next statement
	pendingSent                        // rows in a running statement
	pendingDone                        // err is final
)

// pending is one Publish call waiting in a group. Its fields are guarded by the group's mu.
type pending struct {
	ctx   context.Context
	rows  []offsets.Row
	bytes int // rowBytes of rows
	state pendingState
	sent  bool  // its rows went into a statement (or it was cancelled first: false)
	err   error // the statement's outcome, once done
	wake  chan struct{}
}

// writeRows writes rows in one statement (or one transaction), all or none. ctx carries the
// values of the context of the batch's first call, not its cancellation: the statement's
// bound is writeRows's own.
type writeRows func(ctx context.Context, rows []offsets.Row) error

func (gi *groupInsert) group(table string) *group {
	gi.mu.Lock()
	defer gi.mu.Unlock()
	g := gi.groups[table]
	if g == nil {
		g = &group{}
		gi.groups[table] = g
	}
	return g
}

// queued is the number of calls waiting for table's next statement.
func (gi *groupInsert) queued(table string) int {
	gi.mu.Lock()
	g := gi.groups[table]
	gi.mu.Unlock()
	if g == nil {
		return 0
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.queue)
}

// publish writes rows to table in a statement shared with the other calls for it that queued
// beside it (group insert), through write. There is no goroutine of its own: the call that
// finds no statement running leads, writing one statement with every call queued, up to
// maxRows rows; when it ends, it hands the lead to the first call still queued, or marks the
// group idle. It returns the statement's outcome and sent = true, or sent = false when ctx
// ended before the rows were sent (nothing was written).
func (gi *groupInsert) publish(ctx context.Context, table string, rows []offsets.Row, write writeRows) (sent bool, err error) {
	g := gi.group(table)
	c := &pending{ctx: ctx, rows: rows, bytes: rowsBytes(rows), wake: make(chan struct{}, 1)}
	g.mu.Lock()
	g.queue = append(g.queue, c)
	if !g.running {
		g.running = true
		c.state = pendingLeading
		g.mu.Unlock()
		gi.lead(g, c, write)
		return c.sent, c.err
	}
	g.mu.Unlock()

	done := ctx.Done()
	for {
		select {
		case <-c.wake:
		case <-done:
		}
		g.mu.Lock()
		switch c.state {
		case pendingQueued:
			if ctx.Err() != nil {
				g.remove(c)
				c.state = pendingDone
				g.mu.Unlock()
				return false, nil
			}
		case pendingLeading:
			g.mu.Unlock()
			gi.lead(g, c, write)
			return c.sent, c.err
		case pendingSent:
			done = nil // the outcome is the statement's now
		case pendingDone:
			g.mu.Unlock()
			return c.sent, c.err
		}
		g.mu.Unlock()
	}
}

func (g *group) remove(c *pending) {
	for i, q := range g.queue {
		if q == c {
			g.queue = append(g.queue[:i], g.queue[i+1:]...)
			return
		}
	}
}

// signal wakes c's caller; its state says why.
func (c *pending) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// lead writes one statement for the calls at the head of g's queue (me, the leader, is first),
// up to maxRows rows and maxBytes bytes (the first call always goes in), then passes the lead
// on. Calls whose context ended before they were taken are done with nothing written. The
// statement is bounded by write (GroupTimeout, the publisher's shutdown), never by a caller's
// context: one caller giving up must not fail the rows of the others. It carries the values
// of the context of the batch's first call (a tracing span, a request id), not its
// cancellation.
func (gi *groupInsert) lead(g *group, me *pending, write writeRows) {
	g.mu.Lock()
	var batch []*pending
	n, size, taken := 0, 0, 0
	for _, c := range g.queue {
		if c.ctx.Err() != nil {
			c.state = pendingDone
			if c != me {
				c.signal()
			}
			taken++
			continue
		}
		// A call that would take the statement past either bound starts the next one: the
		// bounds are PostgreSQL's, and one call's size must never fail the others.
		if len(batch) > 0 && (n+len(c.rows) > gi.maxRows || size+c.bytes > gi.maxBytes) {
			break
		}
		c.state = pendingSent
		c.sent = true
		batch = append(batch, c)
		n += len(c.rows)
		size += c.bytes
		taken++
	}
	g.queue = append(g.queue[:0], g.queue[taken:]...)
	g.mu.Unlock()

	if len(batch) > 0 {
		rows := batch[0].rows
		if len(batch) > 1 {
			rows = make([]offsets.Row, 0, n)
			for _, c := range batch {
				rows = append(rows, c.rows...)
			}
		}
		ctx := context.WithoutCancel(batch[0].ctx)
		err := write(ctx, rows)
		errs := make([]error, len(batch))
		for i := range batch {
			errs[i] = err
		}
		if err != nil && len(batch) > 1 && refusedData(err) {
			// The server refused the rows of one call (nothing was written): each call runs
			// alone, so that none fails for another's rows.
			for i, c := range batch {
				errs[i] = write(ctx, c.rows)
			}
		}
		g.mu.Lock()
		for i, c := range batch {
			c.err = errs[i]
			c.state = pendingDone
			if c != me {
				c.signal()
			}
		}
		g.mu.Unlock()
	}

	g.mu.Lock()
	if len(g.queue) > 0 {
		next := g.queue[0]
		next.state = pendingLeading
		next.signal()
	} else {
		g.running = false
	}
	g.mu.Unlock()
}

// refusedData reports whether err is the server refusing a statement for the values it
// carries (SQLSTATE classes 22, data exception, 23, integrity constraint violation, as from
// a unique index or a check the user added, and 54, program limit exceeded): the statement
// failed whole, and one without the rows at fault would not.
func refusedData(err error) bool {
	switch code := dbx.SQLState(err); {
	case strings.HasPrefix(code, "22"), strings.HasPrefix(code, "23"), strings.HasPrefix(code, "54"):
		return true
	}
	return false
}

// rowOverhead is what a row adds to a statement besides its UUID, payload and metadata: the
// length words of its parameters, a delayed row's time, the placeholders' text.
const rowOverhead = 64

// rowBytes is the size of r in a statement, as MaxStatementBytes counts it.
func rowBytes(r offsets.Row) int {
	return len(r.UUID) + len(r.Payload) + len(r.Metadata) + rowOverhead
}

func rowsBytes(rows []offsets.Row) int {
	n := 0
	for _, r := range rows {
		n += rowBytes(r)
	}
	return n
}

// splitBytes cuts rows into runs of at most limit bytes (rowBytes), in order; a row larger
// than limit is a run of its own.
func splitBytes(rows []offsets.Row, limit int) [][]offsets.Row {
	var chunks [][]offsets.Row
	start, size := 0, 0
	for i, r := range rows {
		b := rowBytes(r)
		if i > start && size+b > limit {
			chunks = append(chunks, rows[start:i])
			start, size = i, 0
		}
		size += b
	}
	return append(chunks, rows[start:])
}
