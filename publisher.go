package sqlbroker

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/wake"
)

// Publisher writes messages to a topic's messages table. It is safe for concurrent use.
type Publisher struct {
	db     DB
	config PublisherConfig
	logger watermill.LoggerAdapter
	topics *topics

	mu       sync.Mutex
	closed   bool
	inFlight sync.WaitGroup

	// ownerClosed reports whether the broker that built this transaction publisher has shut
	// down (a broker does not keep its transaction publishers).
	ownerClosed func() bool

	// NOTIFY debouncing, per messages table. timers counts the trailing NOTIFYs scheduled
	// and not yet over (stopped before they fired, or done); once notifyClosed is set, no
	// timer is scheduled any more.
	notifyMu     sync.Mutex
	lastNotify   map[string]time.Time
	notifyTimers map[string]*time.Timer
	notifyClosed bool
	timers       sync.WaitGroup

	// Grouped publishes, per messages table (see publishGrouped).
	groupsMu sync.Mutex
	groups   map[string]*group

	// tracker runs every statement of a pool publisher, so that shutdown can cancel on the
	// server whatever still runs when its wait ends, and wait for the server's answer. nil
	// inside a caller's transaction: its statements are the caller's.
	tracker       *dbx.Tracker
	stopCancelled atomic.Int64 // statements the tracker's Stop cancelled on the server
}

// Kinds of the statements a publisher runs through its tracker.
const (
	stmtSchema  = "schema"
	stmtPublish = "publish"
	stmtNotify  = "notify"
)

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher builds a Publisher on db. A nil logger logs nothing.
func NewPublisher(db DB, config PublisherConfig, logger watermill.LoggerAdapter) (*Publisher, error) {
	if !db.valid() {
		return nil, &ConfigError{Field: "db", Value: "empty DB", Reason: "must wrap a pool or transaction: use sqlbroker.Pgx, StdSQL, PgxTx or StdTx"}
	}
	config.setDefaults()
	if err := config.validate(); err != nil {
		return nil, err
	}
	if db.sqlite() {
		if config.Schema != "" {
			return nil, &ConfigError{Field: "Schema", Value: config.Schema, Reason: "is PostgreSQL's: a SQLite database has no schemas, leave it empty"}
		}
		config.DisableNotify = true // SQLite has no NOTIFY: the wake-ups of this process remain
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	var tracker *dbx.Tracker
	if db.pool != nil {
		tracker = dbx.NewTracker(db.pool)
	}
	return &Publisher{
		db:     db,
		config: config,
		logger: logger,
		topics: newTopics(config.Schema, config.TablePrefix, false, db.sqlite()),

		lastNotify:   map[string]time.Time{},
		notifyTimers: map[string]*time.Timer{},

		groups:  map[string]*group{},
		tracker: tracker,
	}, nil
}

// Publish writes messages to topic, all or none: in one statement, or in one transaction when
// there are more than one statement holds. It is safe from many goroutines. After Close it
// returns ErrClosed and writes nothing.
//
// On a pool, concurrent calls for one topic are grouped (see
// PublisherConfig.DisableGroupInsert): a call waits while a statement of the topic runs and
// then goes into the next one with the calls queued beside it. The messages' contexts (any of
// them done cancels the call) count until the call's rows are sent: a call whose context ends
// while it waits returns the context's error and writes nothing. Once its rows are in a
// running statement, the call waits for that statement's end and returns its outcome, nil
// when the rows are committed and an error when they are not, so the result is never
// ambiguous; the statement is bounded by GroupTimeout, and carries the values (not the
// cancellation) of the context of its first call, for tracing. Calls with more than
// MaxGroupRows messages, and all calls when grouping is off, run their own statement, bounded
// by the messages' contexts. On a pool, a statement whose bound ends is cancelled on the
// server, and the call returns once the server has ended it: its error then says that
// nothing was written.
//
// A publish racing with Close or the broker's Shutdown either committed before they returned
// (Publish returned nil) or fails; a publish still running when their wait runs out is
// cancelled on the server and fails with ErrClosed, nothing of it written.
//
// With a transaction DB, the messages join the caller's transaction and become visible when
// it commits; a cancel during the statement then returns the context's error, and the
// caller's transaction decides the rest. On pgx (a pool or a pgx.Tx), large writes use COPY
// (offsets.CopyMinRows).
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
	if p.ownerClosed != nil && p.ownerClosed() {
		return ErrClosed
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return ErrClosed
	}
	p.inFlight.Add(1)
	p.mu.Unlock()
	defer p.inFlight.Done()

	if len(messages) == 0 {
		return nil
	}
	rows, err := p.rows(topic, messages)
	if err != nil {
		return err
	}
	ctx, cancel := messagesContext(messages)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return notWritten(ctx, topic)
	}

	store, err := p.store(ctx, topic)
	if err != nil {
		return p.publishErr(topic, nil, err)
	}
	if p.db.pool != nil && !p.config.DisableGroupInsert && len(rows) <= p.config.MaxGroupRows {
		sent, err := p.publishGrouped(ctx, store, rows)
		if !sent {
			return notWritten(ctx, topic)
		}
		err = p.publishErr(topic, store, err)
		if err == nil {
			p.logger.Trace("Published messages", watermill.LogFields{"topic": topic, "count": len(rows)})
		}
		return err
	}
	if p.db.tx != nil {
		err = p.write(ctx, p.db.tx, store, rows)
	} else {
		err = p.run(ctx, stmtPublish, 0, func(ctx context.Context, q dbx.Querier) error {
			return p.write(ctx, q, store, rows)
		})
	}
	if err != nil {
		return p.publishErr(topic, store, err)
	}
	p.logger.Trace("Published messages", watermill.LogFields{"topic": topic, "count": len(rows)})
	return nil
}

// store returns the statements of topic, checking (or creating) its tables on first use: in
// the caller's transaction, or on a connection of the tracker's.
func (p *Publisher) store(ctx context.Context, topic string) (*offsets.Store, error) {
	if err := validateTopic(topic); err != nil {
		return nil, err // before a connection is taken for it
	}
	if p.db.tx != nil {
		return p.topics.store(ctx, nil, p.db.tx, topic, p.config.InitializeSchema)
	}
	if s := p.topics.cached(topic); s != nil {
		return s, nil
	}
	var s *offsets.Store
	err := p.run(ctx, stmtSchema, 0, func(ctx context.Context, q dbx.Querier) error {
		var err error
		s, err = p.topics.store(ctx, q.(dbx.Beginner), q, topic, p.config.InitializeSchema)
		return err
	})
	return s, err
}

// notWritten is the error of a call whose context ended before its rows were sent.
func notWritten(ctx context.Context, topic string) error {
	return fmt.Errorf("sqlbroker: publish to %q: %w; nothing was written", topic, context.Cause(ctx))
}

// publishErr turns the error of a write to topic into the error of one Publish call. A
// statement the server says it cancelled (on a caller's cancel, past GroupTimeout, or at
// shutdown) was rolled back: nothing of it was written.
func (p *Publisher) publishErr(topic string, store *offsets.Store, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, dbx.ErrStopped) {
		// Refused before it started, or cancelled on the server and rolled back.
		return fmt.Errorf("sqlbroker: publish to %q: %w: stopped by the shutdown; nothing was written (%w)", topic, ErrClosed, err)
	}
	if dbx.SQLState(err) == dbx.CodeQueryCanceled && (errors.Is(err, dbx.ErrLimit) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return fmt.Errorf("sqlbroker: publish to %q: %w; nothing was written", topic, err)
	}
	if store != nil && dbx.SQLState(err) == dbx.CodeUndefinedTable {
		p.topics.forget(topic)
		return fmt.Errorf("sqlbroker: publish to %q: %w", topic, &MissingTableError{Topic: topic, Table: store.T.Messages})
	}
	return fmt.Errorf("sqlbroker: publish to %q: %w", topic, err)
}

// write writes rows to store's messages table through q (the caller's transaction, or a
// connection of the tracker's), all or none, and wakes the topic's subscribers: in this
// process at once (on a pool), elsewhere by NOTIFY (debounced).
//   - From offsets.CopyMinRows rows on pgx: COPY, in one statement whatever the count. The
//     NOTIFY then follows in the caller's transaction, or right after the COPY on a pool (a
//     NOTIFY is only a latency aid: subscribers poll as well).
//   - Otherwise multi-row INSERTs of at most MaxStatementBytes each (a larger row alone), the
//     last of which carries the NOTIFY; more rows than one statement holds run in one
//     transaction (on a pool; the caller's otherwise).
func (p *Publisher) write(ctx context.Context, q dbx.Querier, store *offsets.Store, rows []offsets.Row) error {
	table := store.T.Messages
	channel := p.notifyInline(table)
	var err error
	copier, canCopy := q.(dbx.Copier)
	switch {
	case canCopy && len(rows) >= offsets.CopyMinRows:
		err = store.Copy(ctx, copier, rows)
		if err == nil && channel != "" {
			nerr := store.Notify(ctx, q, channel)
			if p.db.tx != nil {
				err = nerr // in the caller's transaction: its statement failed, so does the call
			} else if nerr != nil {
				p.logger.Debug("NOTIFY failed; subscribers will poll", watermill.LogFields{"err": nerr})
			}
		}
	default:
		chunks := splitBytes(rows, p.config.MaxStatementBytes)
		insert := func(q dbx.Querier) error {
			for i, chunk := range chunks {
				ch := ""
				if i == len(chunks)-1 {
					ch = channel
				}
				if err := store.Insert(ctx, q, chunk, ch); err != nil {
					return err
				}
			}
			return nil
		}
		if p.db.tx == nil && (len(chunks) > 1 || !store.OneStatement(rows)) {
			err = dbx.InTx(ctx, q.(dbx.Beginner), func(tx dbx.Tx) error { return insert(tx) })
		} else {
			err = insert(q)
		}
	}
	if err != nil {
		return err
	}
	if p.db.tx == nil {
		wake.Notify(table)
		if channel == "" {
			p.notifyLater(table)
		}
	}
	return nil
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

func (p *Publisher) group(table string) *group {
	p.groupsMu.Lock()
	defer p.groupsMu.Unlock()
	g := p.groups[table]
	if g == nil {
		g = &group{}
		p.groups[table] = g
	}
	return g
}

// publishGrouped writes rows in a statement shared with the other calls for the topic that
// queued beside it (group insert). There is no goroutine of its own: the call that finds no
// statement running leads, writing one statement with every call queued, up to MaxGroupRows
// rows; when it ends, it hands the lead to the first call still queued, or marks the group
// idle. It returns the statement's outcome and sent = true, or sent = false when ctx ended
// before the rows were sent (nothing was written).
func (p *Publisher) publishGrouped(ctx context.Context, store *offsets.Store, rows []offsets.Row) (sent bool, err error) {
	g := p.group(store.T.Messages)
	c := &pending{ctx: ctx, rows: rows, bytes: rowsBytes(rows), wake: make(chan struct{}, 1)}
	g.mu.Lock()
	g.queue = append(g.queue, c)
	if !g.running {
		g.running = true
		c.state = pendingLeading
		g.mu.Unlock()
		p.lead(g, store, c)
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
			p.lead(g, store, c)
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
// up to MaxGroupRows rows and MaxStatementBytes bytes (the first call always goes in), then
// passes the lead on. Calls whose context ended before they were taken are done with
// nothing written. The statement is bounded by GroupTimeout and by the publisher's shutdown,
// never by a caller's context: one caller giving up must not fail the rows of the others. It
// carries the values of the context of the batch's first call (a tracing span, a request
// id), not its cancellation.
func (p *Publisher) lead(g *group, store *offsets.Store, me *pending) {
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
		if len(batch) > 0 && (n+len(c.rows) > p.config.MaxGroupRows || size+c.bytes > p.config.MaxStatementBytes) {
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
		write := func(rows []offsets.Row) error {
			return p.run(context.WithoutCancel(batch[0].ctx), stmtPublish, p.config.GroupTimeout, func(ctx context.Context, q dbx.Querier) error {
				return p.write(ctx, q, store, rows)
			})
		}
		err := write(rows)
		errs := make([]error, len(batch))
		for i := range batch {
			errs[i] = err
		}
		if err != nil && len(batch) > 1 && refusedData(err) {
			// The server refused the rows of one call (nothing was written): each call runs
			// alone, so that none fails for another's rows.
			for i, c := range batch {
				errs[i] = write(c.rows)
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

// notifyInline returns the NOTIFY channel when this publish should wake the topic's
// subscribers in other processes from its own statement, or "" when a NOTIFY of the table went
// out less than NotifyDebounce ago: NOTIFY takes a lock shared by the whole cluster at commit,
// so a busy topic notifies at most once per NotifyDebounce (notifyLater sends the trailing
// one). Inside a caller's transaction it always notifies: the commit is the caller's.
func (p *Publisher) notifyInline(table string) string {
	if p.config.DisableNotify {
		return ""
	}
	if p.db.tx != nil {
		return listen.Channel
	}
	p.notifyMu.Lock()
	defer p.notifyMu.Unlock()
	now := time.Now()
	if now.Sub(p.lastNotify[table]) < p.config.NotifyDebounce {
		return ""
	}
	p.lastNotify[table] = now
	return listen.Channel
}

// notifyLater makes sure a NOTIFY of table follows a publish that did not send one, at most
// NotifyDebounce after the last one. Once shutdown has begun, the publish sends it itself
// (shutdown waits for the publishes running, and so for it).
func (p *Publisher) notifyLater(table string) {
	if p.config.DisableNotify {
		return
	}
	p.notifyMu.Lock()
	if p.notifyClosed {
		p.notifyMu.Unlock()
		p.notify(context.Background(), table)
		return
	}
	defer p.notifyMu.Unlock()
	if p.notifyTimers[table] != nil {
		return
	}
	wait := max(p.config.NotifyDebounce-time.Since(p.lastNotify[table]), 0)
	p.timers.Add(1)
	p.notifyTimers[table] = time.AfterFunc(wait, func() {
		defer p.timers.Done()
		p.notifyMu.Lock()
		delete(p.notifyTimers, table)
		p.lastNotify[table] = time.Now()
		p.notifyMu.Unlock()
		p.notify(context.Background(), table)
	})
}

// notify sends a NOTIFY of table through the tracker, bounded by ctx and CleanupTimeout; a
// failure only delays the subscribers of other processes until their next poll.
func (p *Publisher) notify(ctx context.Context, table string) {
	err := p.run(ctx, stmtNotify, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		_, err := q.Exec(ctx, "SELECT pg_notify($1, $2)", listen.Channel, table)
		return err
	})
	if err != nil && !errors.Is(err, dbx.ErrStopped) {
		p.logger.Debug("NOTIFY failed; subscribers will poll", watermill.LogFields{"err": err})
	}
}

// rows validates messages and turns them into rows, before anything reaches the database.
func (p *Publisher) rows(topic string, messages []*message.Message) ([]offsets.Row, error) {
	rows := make([]offsets.Row, len(messages))
	seen := make(map[string]int, len(messages))
	for i, msg := range messages {
		if msg == nil {
			return nil, &PublishError{Topic: topic, Index: i, Reason: "message is nil"}
		}
		fail := func(reason string) error {
			return &PublishError{Topic: topic, Index: i, UUID: msg.UUID, Reason: reason}
		}
		if msg.UUID == "" {
			return nil, fail("UUID is empty")
		}
		if err := textOK(msg.UUID); err != "" {
			return nil, fail("UUID " + err)
		}
		if j, dup := seen[msg.UUID]; dup {
			return nil, fail(fmt.Sprintf("UUID is the same as message %d's in this call", j))
		}
		seen[msg.UUID] = i
		if len(msg.Payload) > p.config.MaxPayloadBytes {
			return nil, fail(fmt.Sprintf("payload is %d bytes, MaxPayloadBytes is %d", len(msg.Payload), p.config.MaxPayloadBytes))
		}
		meta, err := encodeMetadata(msg.Metadata)
		if err != nil {
			return nil, fail(err.Error())
		}
		rows[i] = offsets.Row{UUID: msg.UUID, Payload: msg.Payload, Metadata: meta}
		if until, later, err := delayedUntil(msg.Metadata, time.Now()); err != nil {
			return nil, fail(err.Error())
		} else if later {
			rows[i].DeliverAt = until
		}
	}
	return rows, nil
}

// textOK says what keeps s from being stored as text, or "" if nothing does: invalid UTF-8
// (encoding/json would silently replace it), or a NUL character, which is valid UTF-8 but
// which PostgreSQL cannot store in text or jsonb.
func textOK(s string) string {
	if !utf8.ValidString(s) {
		return "is not valid UTF-8 text"
	}
	if strings.IndexByte(s, 0) >= 0 {
		return "contains a NUL character, which PostgreSQL cannot store in text"
	}
	return ""
}

// encodeMetadata turns metadata into a JSON object. Invalid UTF-8 and NUL characters are
// refused (textOK), naming the key.
func encodeMetadata(md message.Metadata) (string, error) {
	if len(md) == 0 {
		return "{}", nil
	}
	for k, v := range md {
		if err := textOK(k); err != "" {
			return "", fmt.Errorf("metadata key %q %s", k, err)
		}
		if err := textOK(v); err != "" {
			return "", fmt.Errorf("metadata value of key %q %s", k, err)
		}
	}
	b, err := json.Marshal(map[string]string(md))
	if err != nil {
		return "", fmt.Errorf("metadata: %w", err)
	}
	return string(b), nil
}

// messagesContext is cancelled as soon as any message's context is.
func messagesContext(messages []*message.Message) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(messages[0].Context())
	stops := make([]func() bool, 0, len(messages)-1)
	for _, m := range messages[1:] {
		mctx := m.Context()
		if mctx == messages[0].Context() || mctx.Done() == nil {
			continue
		}
		stops = append(stops, context.AfterFunc(mctx, func() { cancel(context.Cause(mctx)) }))
	}
	return ctx, func() {
		for _, stop := range stops {
			stop()
		}
		cancel(context.Canceled)
	}
}

// Close makes every later Publish return ErrClosed, then waits, up to CloseTimeout, for the
// publishes already running to commit or fail. Grouped calls that were accepted before Close
// and still wait in a queue are publishes already running: they are written, and Close waits
// for them. A trailing NOTIFY still due is sent before Close returns. If the wait runs out,
// every statement of the publisher still running is cancelled on the server, and Close waits
// (a short bounded wait of its own, about a second) for the server to end each one; their
// publishes fail with ErrClosed, nothing of theirs committed. So once Close returns, nothing
// of the publisher runs and nothing more of it is committed: a publish racing with Close
// either committed before Close returned (Publish returned nil) or failed. It is idempotent.
//
// Inside a caller's transaction, nothing is cancelled: the statements are the caller's, and
// the caller's commit or rollback decides.
func (p *Publisher) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), p.config.CloseTimeout)
	defer cancel()
	_, err := p.shutdown(ctx)
	return err
}

// publisherStop says what a publisher's shutdown cancelled on the server and gave up on.
type publisherStop struct {
	cancelled, abandoned int
}

// shutdown closes the publisher, bounded by ctx (plus the tracker's CancelWait, when ctx ends
// with statements still running). The order:
//  1. No new Publish: ErrClosed from now on.
//  2. The publishes running finish, while ctx allows.
//  3. No new NOTIFY timer; a NOTIFY still due is sent now, one already firing is awaited.
//  4. The tracker stops: whatever statement still runs (ctx ended) is cancelled on the
//     server, and the server's answer awaited.
//  5. The publishes and NOTIFYs that ran them return: nothing of the publisher runs after.
func (p *Publisher) shutdown(ctx context.Context) (publisherStop, error) {
	// 1.
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	// 2.
	err := waitCtx(ctx, p.inFlight.Wait)
	if p.tracker == nil {
		if err != nil {
			return publisherStop{}, fmt.Errorf("sqlbroker: publisher close: publishes still running in the caller's transaction: %w", err)
		}
		return publisherStop{}, nil
	}
	// 3.
	var due []string
	p.notifyMu.Lock()
	p.notifyClosed = true
	for table, t := range p.notifyTimers {
		if t.Stop() {
			due = append(due, table)
			p.timers.Done()
		}
		delete(p.notifyTimers, table)
	}
	p.notifyMu.Unlock()
	for _, table := range due {
		p.notify(ctx, table)
	}
	// 4.
	res := p.tracker.Stop(ctx)
	// 5. The statements have returned (or were given up on, their connections closed): what
	// is left of the calls that ran them is no database work.
	wctx, cancel := context.WithTimeout(context.Background(), dbx.CancelWait)
	defer cancel()
	done := waitCtx(wctx, func() { p.inFlight.Wait(); p.timers.Wait() })
	stop := publisherStop{cancelled: int(p.stopCancelled.Load())}
	for _, n := range res.Abandoned {
		stop.abandoned += n
	}
	if err != nil {
		return stop, fmt.Errorf("sqlbroker: publisher close: publishes still running were cancelled: %w", err)
	}
	if done != nil {
		return stop, fmt.Errorf("sqlbroker: publisher close: %w", done)
	}
	return stop, nil
}

// waitCtx runs wait (a WaitGroup's Wait) and returns nil when it returns, or ctx's error when
// ctx ends first.
func waitCtx(ctx context.Context, wait func()) error {
	done := make(chan struct{})
	go func() {
		wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run runs fn through the tracker (see dbx.Tracker.Run) and counts the statements that the
// tracker's Stop cancelled on the server. It returns before the WaitGroup of the call that
// runs it is released, so that shutdown reads a complete count.
func (p *Publisher) run(ctx context.Context, kind string, limit time.Duration, fn func(context.Context, dbx.Querier) error) error {
	err := p.tracker.Run(ctx, kind, limit, fn)
	if err != nil && errors.Is(err, dbx.ErrStopped) && dbx.SQLState(err) == dbx.CodeQueryCanceled {
		p.stopCancelled.Add(1)
	}
	return err
}
