package sqlbroker

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/wake"
	"github.com/sqlbroker/watermill-sqlbroker/offsets"
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

	// NOTIFY debouncing, per messages table.
	notifyMu     sync.Mutex
	lastNotify   map[string]time.Time
	notifyTimers map[string]*time.Timer

	// Grouped publishes, per messages table (see publishGrouped).
	groupsMu sync.Mutex
	groups   map[string]*group

	// base is the parent context of grouped statements: shutdown cancels it when its wait for
	// them runs out, so that nothing is written after it returns.
	base       context.Context
	cancelBase context.CancelFunc
}

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
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	base, cancelBase := context.WithCancel(context.Background())
	return &Publisher{
		db:     db,
		config: config,
		logger: logger,
		topics: newTopics(config.Schema, config.TablePrefix, false),

		lastNotify:   map[string]time.Time{},
		notifyTimers: map[string]*time.Timer{},

		groups:     map[string]*group{},
		base:       base,
		cancelBase: cancelBase,
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
// ambiguous; the statement is bounded by GroupTimeout. Calls with more than MaxGroupRows
// messages, and all calls when grouping is off, run their own statement under the messages'
// contexts, as a publisher inside a transaction does: there a cancel during the statement
// returns the context's error, and whether the rows were committed is then not known.
//
// With a transaction DB, the messages join the caller's transaction and become visible when
// it commits. On pgx (a pool or a pgx.Tx), large writes use COPY (offsets.CopyMinRows).
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

	q := p.db.querier()
	store, err := p.topics.store(ctx, p.db.pool, q, topic, p.config.InitializeSchema)
	if err != nil {
		return fmt.Errorf("sqlbroker: publish to %q: %w", topic, err)
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
	if err := p.write(ctx, q, store, rows); err != nil {
		return p.publishErr(topic, store, err)
	}
	p.logger.Trace("Published messages", watermill.LogFields{"topic": topic, "count": len(rows)})
	return nil
}

// notWritten is the error of a call whose context ended before its rows were sent.
func notWritten(ctx context.Context, topic string) error {
	return fmt.Errorf("sqlbroker: publish to %q: %w; nothing was written", topic, context.Cause(ctx))
}

// publishErr turns the error of a write to topic into the error of one Publish call.
func (p *Publisher) publishErr(topic string, store *offsets.Store, err error) error {
	if err == nil {
		return nil
	}
	if dbx.SQLState(err) == dbx.CodeUndefinedTable {
		p.topics.forget(topic)
		return fmt.Errorf("sqlbroker: publish to %q: %w", topic, &MissingTableError{Topic: topic, Table: store.T.Messages})
	}
	return fmt.Errorf("sqlbroker: publish to %q: %w", topic, err)
}

// write writes rows to store's messages table through q, all or none, and wakes the topic's
// subscribers: in this process at once (on a pool), elsewhere by NOTIFY (debounced).
//   - From offsets.CopyMinRows rows on pgx: COPY, in one statement whatever the count. The
//     NOTIFY then follows in the caller's transaction, or right after the COPY on a pool (a
//     NOTIFY is only a latency aid: subscribers poll as well).
//   - Otherwise a multi-row INSERT that carries the NOTIFY; more rows than one statement
//     holds run in one transaction (on a pool; the caller's otherwise).
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
	case p.db.pool != nil && len(rows) > offsets.MaxRowsPerStatement():
		err = dbx.InTx(ctx, p.db.pool, func(tx dbx.Tx) error { return store.Insert(ctx, tx, rows, channel) })
	default:
		err = store.Insert(ctx, q, rows, channel)
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
	c := &pending{ctx: ctx, rows: rows, wake: make(chan struct{}, 1)}
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
// then passes the lead on. Calls whose context ended before they were taken are done with
// nothing written. The statement runs under the publisher's base context and GroupTimeout,
// never under a caller's: one caller giving up must not fail the rows of the others.
func (p *Publisher) lead(g *group, store *offsets.Store, me *pending) {
	g.mu.Lock()
	var batch []*pending
	n, taken := 0, 0
	for _, c := range g.queue {
		if c.ctx.Err() != nil {
			c.state = pendingDone
			if c != me {
				c.signal()
			}
			taken++
			continue
		}
		if len(batch) > 0 && n+len(c.rows) > p.config.MaxGroupRows {
			break
		}
		c.state = pendingSent
		c.sent = true
		batch = append(batch, c)
		n += len(c.rows)
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
		ctx, cancel := context.WithTimeout(p.base, p.config.GroupTimeout)
		err := p.write(ctx, p.db.pool, store, rows)
		cancel()
		g.mu.Lock()
		for _, c := range batch {
			c.err = err
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
// NotifyDebounce after the last one.
func (p *Publisher) notifyLater(table string) {
	if p.config.DisableNotify {
		return
	}
	p.notifyMu.Lock()
	defer p.notifyMu.Unlock()
	if p.notifyTimers[table] != nil {
		return
	}
	wait := max(p.config.NotifyDebounce-time.Since(p.lastNotify[table]), 0)
	p.notifyTimers[table] = time.AfterFunc(wait, func() {
		p.notifyMu.Lock()
		delete(p.notifyTimers, table)
		p.lastNotify[table] = time.Now()
		p.notifyMu.Unlock()
		ctx, cancel := dbx.CleanupContext(context.Background())
		defer cancel()
		if _, err := p.db.pool.Exec(ctx, "SELECT pg_notify($1, $2)", listen.Channel, table); err != nil {
			p.logger.Debug("NOTIFY failed; subscribers will poll", watermill.LogFields{"err": err})
		}
	})
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
		if !utf8.ValidString(msg.UUID) || strings.IndexByte(msg.UUID, 0) >= 0 {
			return nil, fail("UUID is not valid UTF-8 text")
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
	}
	return rows, nil
}

// encodeMetadata turns metadata into a JSON object. encoding/json would silently replace
// invalid UTF-8, and PostgreSQL's jsonb refuses NUL: both are refused here, naming the key.
func encodeMetadata(md message.Metadata) (string, error) {
	if len(md) == 0 {
		return "{}", nil
	}
	for k, v := range md {
		if !utf8.ValidString(k) || strings.IndexByte(k, 0) >= 0 {
			return "", fmt.Errorf("metadata key %q is not valid UTF-8 text", k)
		}
		if !utf8.ValidString(v) || strings.IndexByte(v, 0) >= 0 {
			return "", fmt.Errorf("metadata value of key %q is not valid UTF-8 text", k)
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

// Close makes every later Publish return ErrClosed, then waits, up to DefaultCloseTimeout, for
// the publishes already running to commit or fail, so that no row is written after Close
// returns. Grouped calls that were accepted before Close and still wait in a queue are
// publishes already running: they are written, and Close waits for them. If the wait runs
// out, the grouped statements still running are cancelled. It is idempotent.
func (p *Publisher) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), DefaultCloseTimeout)
	defer cancel()
	return p.shutdown(ctx)
}

func (p *Publisher) shutdown(ctx context.Context) error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.notifyMu.Lock()
	for table, t := range p.notifyTimers {
		t.Stop()
		delete(p.notifyTimers, table)
	}
	p.notifyMu.Unlock()
	done := make(chan struct{})
	go func() {
		p.inFlight.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		// Grouped statements still running are cancelled, so that none commits after this.
		p.cancelBase()
		return fmt.Errorf("sqlbroker: publisher close: publishes still running: %w", ctx.Err())
	}
}
