package sqlbroker

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// statements records the statements a groupInsert asks for, as the UUIDs of their rows, and
// holds the first one until release is closed, so that the calls behind it queue.
type statements struct {
	write   func(ctx context.Context, rows []offsets.Row) error // runs one statement; nil: none
	started chan struct{}                                       // closed when the first statement starts
	release chan struct{}

	mu   sync.Mutex
	runs [][]string
	once sync.Once
}

func newStatements(write func(ctx context.Context, rows []offsets.Row) error) *statements {
	return &statements{write: write, started: make(chan struct{}), release: make(chan struct{})}
}

func (s *statements) run(ctx context.Context, rows []offsets.Row) error {
	first := false
	s.once.Do(func() { first = true })
	if first {
		close(s.started)
		<-s.release
	}
	ids := make([]string, len(rows))
	for i, r := range rows {
		ids[i] = r.UUID
	}
	s.mu.Lock()
	s.runs = append(s.runs, ids)
	s.mu.Unlock()
	if s.write != nil {
		return s.write(ctx, rows)
	}
	return nil
}

func (s *statements) all() [][]string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([][]string(nil), s.runs...)
}

// gcall is one publish of a test, with its outcome.
type gcall struct {
	ctx  context.Context
	rows []offsets.Row
	sent bool
	err  error
	done chan struct{}
}

// rowsOf builds one row per id, each with a payload of size bytes.
func rowsOf(size int, ids ...string) []offsets.Row {
	rows := make([]offsets.Row, len(ids))
	for i, id := range ids {
		rows[i] = offsets.Row{UUID: id, Payload: []byte(strings.Repeat("x", size)), Metadata: "{}"}
	}
	return rows
}

// queueCalls starts the first call, which leads and is held in its statement, then the others
// one at a time, each once the one before it has queued: the queue holds them in the order
// given. It returns once all of them wait; closing s.release lets them run.
func queueCalls(t *testing.T, gi *groupInsert, s *statements, calls ...*gcall) {
	t.Helper()
	const table = `"t"`
	start := func(c *gcall) {
		if c.ctx == nil {
			c.ctx = context.Background()
		}
		c.done = make(chan struct{})
		go func() {
			defer close(c.done)
			c.sent, c.err = gi.publish(c.ctx, table, c.rows, s.run)
		}()
	}
	start(calls[0])
	<-s.started
	for i, c := range calls[1:] {
		start(c)
		testdb.Eventually(t, 10*time.Second, fmt.Sprintf("call %d queued", i+1), func() bool { return gi.queued(table) == i+1 })
	}
}

func waitCalls(calls ...*gcall) {
	for _, c := range calls {
		<-c.done
	}
}

// The calls that queue behind a running statement go into the next one in the order they
// came, as many as MaxGroupRows allows; a call that would go past it starts the next
// statement.
func TestPublisher_groupInsert_queueOrderWithinMaxGroupRows(t *testing.T) {
	t.Parallel()
	gi := newGroupInsert(3, 1<<20)
	s := newStatements(nil)
	a := &gcall{rows: rowsOf(1, "a")}
	b := &gcall{rows: rowsOf(1, "b")}
	c := &gcall{rows: rowsOf(1, "c1", "c2")}
	d := &gcall{rows: rowsOf(1, "d")}
	e := &gcall{rows: rowsOf(1, "e")}
	queueCalls(t, gi, s, a, b, c, d, e)
	close(s.release)
	waitCalls(a, b, c, d, e)
	for _, x := range []*gcall{a, b, c, d, e} {
		assert.True(t, x.sent)
		assert.NoError(t, x.err)
	}
	assert.Equal(t, [][]string{{"a"}, {"b", "c1", "c2"}, {"d", "e"}}, s.all())
	assert.Zero(t, gi.queued(`"t"`))
}

// MaxStatementBytes bounds a grouped statement as MaxGroupRows does, and a call larger than
// the bound runs alone, ahead of the calls queued behind it.
func TestPublisher_groupInsert_boundedByMaxStatementBytes(t *testing.T) {
	t.Parallel()
	small := rowBytes(rowsOf(100, "b")[0])
	gi := newGroupInsert(1000, 3*small)
	s := newStatements(nil)
	a := &gcall{rows: rowsOf(100, "a")}
	b := &gcall{rows: rowsOf(100, "b")}
	c := &gcall{rows: rowsOf(100, "c")}
	big := &gcall{rows: rowsOf(4*small, "big")}
	d := &gcall{rows: rowsOf(100, "d")}
	e := &gcall{rows: rowsOf(100, "e")}
	f := &gcall{rows: rowsOf(100, "f")}
	g := &gcall{rows: rowsOf(100, "g")}
	queueCalls(t, gi, s, a, b, c, big, d, e, f, g)
	close(s.release)
	waitCalls(a, b, c, big, d, e, f, g)
	for _, x := range []*gcall{a, b, c, big, d, e, f, g} {
		assert.True(t, x.sent)
		assert.NoError(t, x.err)
	}
	assert.Equal(t, [][]string{{"a"}, {"b", "c"}, {"big"}, {"d", "e", "f"}, {"g"}}, s.all())
}

// A call whose context ends while it is queued returns sent = false, and its rows go into no
// statement; the calls around it are written.
func TestPublisher_groupInsert_cancelledWhileQueuedIsNotSent(t *testing.T) {
	t.Parallel()
	gi := newGroupInsert(100, 1<<20)
	s := newStatements(nil)
	ctx, cancel := context.WithCancel(context.Background())
	a := &gcall{rows: rowsOf(1, "a")}
	b := &gcall{rows: rowsOf(1, "b")}
	c := &gcall{ctx: ctx, rows: rowsOf(1, "c")}
	d := &gcall{rows: rowsOf(1, "d")}
	queueCalls(t, gi, s, a, b, c, d)
	cancel()
	waitCalls(c)
	assert.False(t, c.sent)
	assert.NoError(t, c.err)
	close(s.release)
	waitCalls(a, b, d)
	assert.True(t, b.sent)
	assert.True(t, d.sent)
	assert.Equal(t, [][]string{{"a"}, {"b", "d"}}, s.all())
}

// A grouped statement the server refuses for the values of one call (here a unique index)
// runs again call by call: the call at fault fails with the server's error, the others are
// written.
func TestPublisher_groupInsert_refusedStatementRerunsPerCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := dbx.NewPgxPool(testdb.Pgx(t))
	table := fmt.Sprintf("groupinsert_%s", strings.ReplaceAll(uuid.NewString()[:8], "-", ""))
	_, err := pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE %q (uuid text PRIMARY KEY)`, table))
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), fmt.Sprintf(`DROP TABLE %q`, table)) })
	_, err = pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %q VALUES ('taken')`, table))
	require.NoError(t, err)

	gi := newGroupInsert(100, 1<<20)
	s := newStatements(func(ctx context.Context, rows []offsets.Row) error {
		ids := make([]string, len(rows))
		for i, r := range rows {
			ids[i] = r.UUID
		}
		_, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %q SELECT unnest($1::text[])`, table), ids)
		return err
	})
	a := &gcall{rows: rowsOf(1, "a")}
	b := &gcall{rows: rowsOf(1, "b")}
	bad := &gcall{rows: rowsOf(1, "taken")}
	d := &gcall{rows: rowsOf(1, "d")}
	queueCalls(t, gi, s, a, b, bad, d)
	close(s.release)
	waitCalls(a, b, bad, d)

	assert.NoError(t, a.err)
	assert.NoError(t, b.err)
	assert.NoError(t, d.err)
	require.Error(t, bad.err)
	assert.Equal(t, "23505", dbx.SQLState(bad.err), "unique_violation")
	assert.Equal(t, [][]string{{"a"}, {"b", "taken", "d"}, {"b"}, {"taken"}, {"d"}}, s.all())

	rows, err := pool.Query(ctx, fmt.Sprintf(`SELECT uuid FROM %q ORDER BY uuid`, table))
	require.NoError(t, err)
	var ids []string
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	rows.Close()
	require.NoError(t, rows.Err())
	assert.Equal(t, []string{"a", "b", "d", "taken"}, ids)
}

// A statement that fails for another reason than its rows' values fails every call in it: a
// rerun would fail the same way.
func TestPublisher_groupInsert_otherErrorFailsTheWholeStatement(t *testing.T) {
	t.Parallel()
	pool := dbx.NewPgxPool(testdb.Pgx(t))
	missing := "groupinsert_missing_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	gi := newGroupInsert(100, 1<<20)
	s := newStatements(func(ctx context.Context, rows []offsets.Row) error {
		_, err := pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %q VALUES (1)`, missing))
		return err
	})
	a := &gcall{rows: rowsOf(1, "a")}
	b := &gcall{rows: rowsOf(1, "b")}
	c := &gcall{rows: rowsOf(1, "c")}
	queueCalls(t, gi, s, a, b, c)
	close(s.release)
	waitCalls(a, b, c)
	for _, x := range []*gcall{a, b, c} {
		assert.Equal(t, dbx.CodeUndefinedTable, dbx.SQLState(x.err))
	}
	assert.Equal(t, [][]string{{"a"}, {"b", "c"}}, s.all())
}

func TestPublisher_splitBytes(t *testing.T) {
	t.Parallel()
	one := rowBytes(rowsOf(10, "x")[0])
	ids := func(chunks [][]offsets.Row) [][]string {
		var out [][]string
		for _, ch := range chunks {
			var s []string
			for _, r := range ch {
				s = append(s, r.UUID)
			}
			out = append(out, s)
		}
		return out
	}
	rows := rowsOf(10, "a", "b", "c", "d", "e")
	assert.Equal(t, [][]string{{"a", "b"}, {"c", "d"}, {"e"}}, ids(splitBytes(rows, 2*one)))
	assert.Equal(t, [][]string{{"a", "b", "c", "d", "e"}}, ids(splitBytes(rows, 5*one)))
	// A row larger than the limit is a run of its own, and the rows around it go on.
	mixed := append(append(rowsOf(10, "a"), rowsOf(3*one, "big")...), rowsOf(10, "c", "d")...)
	assert.Equal(t, [][]string{{"a"}, {"big"}, {"c", "d"}}, ids(splitBytes(mixed, 2*one)))
	assert.Equal(t, [][]string{{"big"}}, ids(splitBytes(rowsOf(3*one, "big"), one)))
}
