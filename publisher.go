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

	// NOTIFY debouncing, per messages table.
	notifyMu     sync.Mutex
	lastNotify   map[string]time.Time
	notifyTimers map[string]*time.Timer
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
	return &Publisher{
		db:     db,
		config: config,
		logger: logger,
		topics: newTopics(config.Schema, config.TablePrefix, false),

		lastNotify:   map[string]time.Time{},
		notifyTimers: map[string]*time.Timer{},
	}, nil
}

// Publish writes messages to topic, all or none: in one statement, or in one transaction when
// there are more than one statement holds. The statement runs under the messages' contexts
// (cancelling any of them cancels the publish). With a transaction DB, the messages join the
// caller's transaction and become visible when it commits. After Close it returns ErrClosed
// and writes nothing.
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
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
		return fmt.Errorf("sqlbroker: publish to %q: %w; nothing was written", topic, context.Cause(ctx))
	}

	q := p.db.querier()
	store, err := p.topics.store(ctx, p.db.pool, q, topic, p.config.InitializeSchema)
	if err != nil {
		return fmt.Errorf("sqlbroker: publish to %q: %w", topic, err)
	}
	channel := p.notifyInline(store.T.Messages)
	if p.db.pool != nil && len(rows) > offsets.MaxRowsPerStatement() {
		err = dbx.InTx(ctx, p.db.pool, func(tx dbx.Tx) error { return store.Insert(ctx, tx, rows, channel) })
	} else {
		err = store.Insert(ctx, q, rows, channel)
	}
	if err != nil {
		if dbx.SQLState(err) == dbx.CodeUndefinedTable {
			p.topics.forget(topic)
			return fmt.Errorf("sqlbroker: publish to %q: %w", topic, &MissingTableError{Topic: topic, Table: store.T.Messages})
		}
		return fmt.Errorf("sqlbroker: publish to %q: %w", topic, err)
	}
	if p.db.tx == nil {
		wake.Notify(store.T.Messages)
		if channel == "" {
			p.notifyLater(store.T.Messages)
		}
	}
	p.logger.Trace("Published messages", watermill.LogFields{"topic": topic, "count": len(rows)})
	return nil
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
// returns. It is idempotent.
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
		return fmt.Errorf("sqlbroker: publisher close: publishes still running: %w", ctx.Err())
	}
}
