package sqlbroker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/wake"
)

// Publisher writes messages to a topic's messages table. It is safe for concurrent use.
type Publisher struct {
	db     DB
	config PublisherConfig
	logger watermill.LoggerAdapter
	stores *storeCache

	mu       sync.Mutex
	closed   bool
	inFlight sync.WaitGroup

	// ownerClosed reports whether the broker that built this transaction publisher has shut
	// down (a broker does not keep its transaction publishers).
	ownerClosed func() bool

	// notifier debounces the NOTIFYs of a pool publisher; nil inside a caller's transaction
	// (its commit notifies) and when notifications are off.
	notifier *notifier

	// grouped groups the concurrent publishes of a pool publisher (see groupInsert.publish).
	grouped *groupInsert

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
	if err := db.refused(); err != nil {
		return nil, err
	}
	if !db.valid() {
		return nil, &ConfigError{Field: "db", Value: "empty DB", Reason: "must wrap a pool or transaction: use sqlbroker.Pgx, StdSQL, SQLite, MySQL, PgxTx, StdTx, SQLiteTx or MySQLTx"}
	}
	config.setDefaults()
	if err := config.validate(); err != nil {
		return nil, err
	}
	d := db.dialect()
	if err := schemaOn(d, config.Schema); err != nil {
		return nil, err
	}
	if !d.Notify {
		config.DisableNotify = true // no NOTIFY there: the wake-ups of this process remain
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	var tracker *dbx.Tracker
	if db.pool != nil {
		tracker = dbx.NewTracker(db.pool)
	}
	p := &Publisher{
		db:     db,
		config: config,
		logger: logger,
		stores: newStoreCache(d, config.Schema, config.TablePrefix, false),

		grouped: newGroupInsert(config.MaxGroupRows, config.MaxStatementBytes),
		tracker: tracker,
	}
	if tracker != nil && !config.DisableNotify {
		p.notifier = newNotifier(config.NotifyDebounce, p.notify)
	}
	return p, nil
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
// caller's transaction decides the rest. On pgx (a pool or a pgx.Tx), a call of 500 messages
// or more is written with COPY.
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
		sent, err := p.grouped.publish(ctx, store.T.Messages, rows, func(ctx context.Context, rows []offsets.Row) error {
			return p.run(ctx, stmtPublish, p.config.GroupTimeout, func(ctx context.Context, q dbx.Querier) error {
				return p.write(ctx, q, store, rows)
			})
		})
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
		return p.stores.store(ctx, nil, p.db.tx, topic, p.config.InitializeSchema)
	}
	if s := p.stores.cached(topic); s != nil {
		return s, nil
	}
	var s *offsets.Store
	err := p.run(ctx, stmtSchema, 0, func(ctx context.Context, q dbx.Querier) error {
		var err error
		s, err = p.stores.store(ctx, q.(dbx.Beginner), q, topic, p.config.InitializeSchema)
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
	if store != nil && p.db.tx != nil && store.NoPartition(err) {
		return fmt.Errorf("sqlbroker: publish to %q: no partition of %s takes the new offsets: no maintenance has added one since they ran out (a subscriber of the topic does while it claims, so does a publish outside a transaction, and sqlbroker retention); the transaction is aborted, run it again once one has: %w", topic, store.T.Messages, err)
	}
	if store != nil && dbx.SQLState(err) == dbx.CodeUndefinedTable {
		p.stores.forget(topic)
		return fmt.Errorf("sqlbroker: publish to %q: %w", topic, &MissingTableError{Topic: topic, Table: store.T.Messages, Database: store.T.Dialect().Name})
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
//
// On PostgreSQL, a write that finds no partition of the messages table for a row (no
// maintenance pass added one in time: no subscriber of the topic runs, or a burst outran
// them) adds the partitions and writes once more; in the caller's transaction, which the
// failed statement aborted, it fails (publishErr says what to do).
func (p *Publisher) write(ctx context.Context, q dbx.Querier, store *offsets.Store, rows []offsets.Row) error {
	err := p.writeOnce(ctx, q, store, rows)
	if err == nil || p.db.tx != nil || !store.NoPartition(err) {
		return err
	}
	if aerr := store.AddPartitions(ctx, q, len(rows)); aerr != nil {
		return fmt.Errorf("%w; adding partitions for it: %w", err, aerr)
	}
	return p.writeOnce(ctx, q, store, rows)
}

// writeOnce is write without the partitions added on a refusal.
func (p *Publisher) writeOnce(ctx context.Context, q dbx.Querier, store *offsets.Store, rows []offsets.Row) error {
	table := store.T.Messages
	channel := p.notifyChannel(table)
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
		if channel == "" && p.notifier != nil {
			p.notifier.later(table)
		}
	}
	return nil
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
	if p.notifier != nil {
		p.notifier.Close(ctx)
	}
	// 4.
	res := p.tracker.Stop(ctx)
	// 5. The statements have returned (or were given up on, their connections closed): what
	// is left of the calls that ran them is no database work.
	wctx, cancel := context.WithTimeout(context.Background(), dbx.CancelWait)
	defer cancel()
	done := waitCtx(wctx, func() {
		p.inFlight.Wait()
		if p.notifier != nil {
			p.notifier.wait()
		}
	})
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
