package sqlbroker

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/listen"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/wake"
)

// Metadata keys the subscriber sets on every message it delivers.
const (
	// MetadataAttempt is the delivery attempt of the message within its consumer group:
	// "1" the first time, and one more every time it is claimed again after a nack, a lost
	// lease or a dead consumer.
	MetadataAttempt = "sqlbroker_attempt"
	// MetadataOrderKey holds a message's order key: within a consumer group that sets
	// SubscriberConfig.OrderByKey, messages with the same key are handled one after another,
	// in the group's order. Set it before publishing, or let PublisherConfig.OrderKey compute
	// it. A message without it is not ordered.
	MetadataOrderKey = offsets.MetaOrderKey
	// MetadataOffset is the message's offset in its topic.
	MetadataOffset = "sqlbroker_offset"
)

// Subscriber claims messages of a topic for a consumer group and hands them to Watermill. It
// implements message.Subscriber and message.SubscribeInitializer.
type Subscriber struct {
	db     dbx.Pool
	config SubscriberConfig
	logger watermill.LoggerAdapter
	stores *storeCache

	mu       sync.Mutex
	closed   bool
	subs     map[*subscription]struct{}
	shutdown chan struct{} // closed when Shutdown starts
	done     chan struct{} // closed when Shutdown has finished
	report   CloseReport
	err      error

	stats   subscriberStats
	hook    atomic.Pointer[RouterHook] // set when a Router's hook owns the shutdown
	tracker *dbx.Tracker               // every statement of the subscriptions on the pool

	stoppedByRouter CloseReport // guarded by mu: subscriptions that ended as the Router closed
}

// Kinds of the statements a subscription runs through its subscriber's tracker, as
// Shutdown counts them.
const (
	stmtClaim   = "claim"
	stmtAck     = "ack"
	stmtNack    = "nack"
	stmtExtend  = "extend"
	stmtRelease = "release"
	stmtPrune   = "prune"
	stmtBackend = "backend" // the look for a failed claim's server process
)

var (
	_ message.Subscriber           = (*Subscriber)(nil)
	_ message.SubscribeInitializer = (*Subscriber)(nil)
)

// subscriberStats are the counters behind Stats.
type subscriberStats struct {
	claimed, acked, nacked, released, stale, leasesLost, errors, deadLettered, handedOver atomic.Int64
}

// Stats are counters of a Subscriber since it was built.
type Stats struct {
	Claimed          int64 // messages claimed, first deliveries and redeliveries
	Acked            int64 // acks applied
	Nacked           int64 // nacks applied
	Released         int64 // claims given back without reaching a handler
	StaleSettlements int64 // acks and nacks refused because the claim was no longer held
	LeasesLost       int64 // deliveries whose claim was lost while in work (its lease ran out, or, in advisory mode, its lock connection died)
	Errors           int64 // database errors met by claim, extension and settlement (not a claim's lock wait that ran out of LockWaitTimeout, logged at Info)
	DeadLettered     int64 // messages moved to the dead-letter topic (MaxAttempts), counted in Nacked too
	HandedOver       int64 // OrderByKey on PostgreSQL: messages claimed by the ack of the one before them of their key, counted in Claimed too
	InFlight         int   // messages claimed and not yet settled, now
	LocksHeld        int   // advisory locks held by the lock connections, now (advisory mode)
}

// NewSubscriber builds a Subscriber on db, which must wrap a pool (Pgx, StdSQL, SQLite or
// MySQL; on SQLite and MySQL the lease mode only). A nil logger logs nothing. Nothing is sent to the database
// until Subscribe.
func NewSubscriber(db DB, config SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if err := db.refused(); err != nil {
		return nil, err
	}
	if db.pool == nil {
		return nil, &ConfigError{Field: "db", Value: "not a pool", Reason: "must wrap a pool: use sqlbroker.Pgx, sqlbroker.StdSQL, sqlbroker.SQLite or sqlbroker.MySQL (a transaction can only publish)"}
	}
	batch := config.BatchSize
	config.setDefaults()
	if err := config.validate(); err != nil {
		return nil, err
	}
	if err := config.validateOn(db.dialect()); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if batch > config.BatchSize {
		logger.Info("BatchSize lowered to MaxInFlight: a claim takes no more messages than can be in handlers at once",
			watermill.LogFields{"batch_size": batch, "max_in_flight": config.MaxInFlight})
	}
	return &Subscriber{
		db:       db.pool,
		config:   config,
		logger:   logger,
		stores:   newStoreCache(db.dialect(), config.Schema, config.TablePrefix, !config.SynchronousCommit),
		subs:     map[*subscription]struct{}{},
		shutdown: make(chan struct{}),
		done:     make(chan struct{}),
		tracker:  dbx.NewTracker(db.pool),
	}, nil
}

// Stats returns the subscriber's counters.
func (s *Subscriber) Stats() Stats {
	st := Stats{
		Claimed:          s.stats.claimed.Load(),
		Acked:            s.stats.acked.Load(),
		Nacked:           s.stats.nacked.Load(),
		Released:         s.stats.released.Load(),
		StaleSettlements: s.stats.stale.Load(),
		LeasesLost:       s.stats.leasesLost.Load(),
		Errors:           s.stats.errors.Load(),
		DeadLettered:     s.stats.deadLettered.Load(),
		HandedOver:       s.stats.handedOver.Load(),
	}
	s.mu.Lock()
	for sub := range s.subs {
		st.InFlight += sub.inFlight()
		st.LocksHeld += sub.mode.locksHeld()
	}
	s.mu.Unlock()
	return st
}

// SubscribeInitialize creates the tables of topic (message.SubscribeInitializer).
func (s *Subscriber) SubscribeInitialize(topic string) error {
	tables, err := s.tablesOf(topic)
	if err != nil {
		return err
	}
	return publicErr(tables.Create(context.Background(), s.db))
}

func (s *Subscriber) tablesOf(topic string) (offsets.Tables, error) {
	if err := validateTopic(topic); err != nil {
		return offsets.Tables{}, err
	}
	return s.stores.tables(topic), nil
}

// Subscribe starts claiming messages of topic for the consumer group and returns the channel
// they arrive on. ctx bounds the subscription: cancelling it, or Close, stops claiming, gives
// back at once every claim not yet handed to a handler, and closes the channel. Messages
// already handed out stay claimed until they are acked or nacked (their leases are extended
// meanwhile) or until Shutdown.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	sub, err := s.subscribe(ctx, topic)
	if err != nil {
		return nil, err
	}
	if h := s.hook.Load(); h != nil && h.isRouterSubscription(ctx) {
		sub.router.taken.Store(true)
		return h.relay(sub), nil
	}
	return sub.handout.out, nil
}

func (s *Subscriber) subscribe(ctx context.Context, topic string) (*subscription, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	store, dlq, groupID, err := s.begin(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("sqlbroker: subscribe to %q: %w", topic, err)
	}

	sub := newSubscription(s, ctx, store, groupID, dlq)
	mode, err := newClaimMode(ctx, sub)
	if err != nil {
		sub.claimer.unreg()
		sub.claimer.unlisten()
		sub.stop(err)
		return nil, fmt.Errorf("sqlbroker: subscribe to %q: %w", topic, err)
	}
	sub.mode = mode
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		sub.stop(ErrClosed)
		sub.mode.abandon()
		sub.claimer.unreg()
		sub.claimer.unlisten()
		return nil, ErrClosed
	}
	s.subs[sub] = struct{}{}
	s.mu.Unlock()
	sub.start()
	return sub, nil
}

// begin reads what a subscription of topic starts from: the topic's tables (checked once per
// Subscriber, or created with InitializeSchema), the dead-letter topic's, and the consumer
// group's row, created if it is new. On PostgreSQL, unless tables are to be created, that is
// one transaction: run one by one, each statement would be a transaction of its own (two for
// a statement the driver prepares first), and a process that subscribes to many topics would
// start with a burst of them. The transaction is READ COMMITTED whatever the session's
// default, so that each statement sees the rows committed before it (a group row another
// subscriber has just created) as it would on its own.
func (s *Subscriber) begin(ctx context.Context, topic string) (store, dlq *offsets.Store, groupID int32, err error) {
	// Names are refused before anything reaches the database, the transaction's BEGIN too.
	if err := validateTopic(topic); err != nil {
		return nil, nil, 0, err
	}
	if s.config.MaxAttempts > 0 {
		if _, err := s.config.deadLetterTopic(topic); err != nil {
			return nil, nil, 0, fmt.Errorf("dead-letter topic: %w", err)
		}
	}
	run := func(pool dbx.Beginner, q dbx.Querier) error {
		var err error
		if store, err = s.stores.store(ctx, pool, q, topic, s.config.InitializeSchema); err != nil {
			return err
		}
		if dlq, err = s.deadLetterStore(ctx, pool, q, topic); err != nil {
			return fmt.Errorf("dead-letter topic: %w", err)
		}
		if groupID, err = store.EnsureGroup(ctx, q, s.config.ConsumerGroup, s.config.StartAtNewest); err != nil {
			return fmt.Errorf("consumer group %q: %w", s.config.ConsumerGroup, err)
		}
		return nil
	}
	if s.config.InitializeSchema || s.db.Dialect().InProcess {
		err = run(s.db, s.db)
	} else {
		err = dbx.InTx(ctx, s.db, func(tx dbx.Tx) error {
			if err := dbx.ReadCommitted(ctx, tx); err != nil {
				return err
			}
			return run(nil, tx)
		})
	}
	return store, dlq, groupID, err
}

// stopSubscriptions stops every subscription as a cancel of its context would: claiming
// stops, undelivered claims are given back, channels close. Deliveries in work stay claimed
// and their leases keep being extended until they settle or Shutdown runs.
func (s *Subscriber) stopSubscriptions() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for sub := range s.subs {
		sub.stop(ErrClosed)
	}
}

// Close shuts the subscriber down, bounded by CloseTimeout (see Shutdown). It is idempotent
// and safe to call concurrently; every call returns the first shutdown's error.
//
// Under a RouterHook, Close stops the subscriptions only (as the Router calls it when it
// begins to close), and the hook runs the shutdown once the handlers have drained.
func (s *Subscriber) Close() error {
	if h := s.hook.Load(); h != nil && !s.isDone() {
		h.closeBegun()
		s.stopSubscriptions()
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.config.CloseTimeout)
	defer cancel()
	_, err := s.Shutdown(ctx)
	return err
}

func (s *Subscriber) isDone() bool {
	select {
	case <-s.done:
		return true
	default:
		return false
	}
}

func (s *Subscriber) removeSubscription(sub *subscription) {
	h := s.hook.Load()
	s.mu.Lock()
	delete(s.subs, sub)
	if h != nil && !s.closed && !sub.stoppedAlone() && h.routerClosing() {
		// It stopped with the Router's closing, before Shutdown: Shutdown counts it.
		s.stoppedByRouter.add(sub.stopReport())
	}
	s.mu.Unlock()
	if h != nil {
		h.forget(sub)
	}
}

// stopReport is what the stop of sub did by itself: the claims it gave back, their locks and
// the connections it closed, and the claim rounds on its lock connection it cancelled. (The
// statements on the pool it cancelled are counted by the tracker.)
func (sub *subscription) stopReport() CloseReport {
	return CloseReport{
		Subscriptions:     1,
		ClaimsReleased:    int(sub.atStop.released.Load()),
		LocksReleased:     int(sub.atStop.unlocked.Load()),
		ConnectionsClosed: int(sub.atStop.connsClosed.Load()),

		QueriesCancelled:         int(sub.atStop.lockClaimsCancelled.Load()),
		ClaimStatementsCancelled: int(sub.atStop.lockClaimsCancelled.Load()),
	}
}

func validateTopic(topic string) error { return validateName("topic", topic) }

// subscription is one Subscribe call, composed of its parts: the claimer (claim loop), the
// hand-out loop, the settler, the pruner (partitions and Retention), and the claim mode, lease or advisory
// lock, which holds the claims (the lease extender, or the lock connection). The work set
// holds the deliveries between them.
type subscription struct {
	s       *Subscriber
	store   *offsets.Store
	groupID int32
	cfg     *SubscriberConfig
	logger  watermill.LoggerAdapter

	ctx context.Context // the Subscribe context, cancelled also by Close (stop)

	work    *workSet
	mode    claimMode
	claimer *claimer
	handout *handout
	settler *settler

	loops  loopGroup
	atStop stopCounts
	router routerState // hook.go
}

// loopGroup is the subscription's goroutines and their stop.
type loopGroup struct {
	cancel context.CancelCauseFunc // cancels the subscription's ctx
	wg     sync.WaitGroup          // every goroutine of the subscription but the awaits of deliveries
	loops  sync.WaitGroup          // the subscription's loops (loop), which Shutdown waits for
	// ended is closed once the loops ended: in lease mode no goroutine of the subscription
	// runs from then on.
	ended chan struct{}
	// finished is closed once every goroutine of the subscription has done its last work (the
	// loops, the awaits of deliveries, the subscription's removal from its subscriber).
	finished chan struct{}
}

// stopCounts is what the stop of a subscription did by itself, for the CloseReport.
type stopCounts struct {
	released    atomic.Int64 // claims given back when the subscription stopped
	unlocked    atomic.Int64 // advisory locks of those claims dropped then
	connsClosed atomic.Int64 // the LISTEN connection, or the lock connection, when the stop closed it
	// lockClaimsCancelled counts the advisory claim rounds on the lock connection that the
	// server cancelled as the subscription stopped (the pool's statements are the tracker's).
	lockClaimsCancelled atomic.Int64
}

func newSubscription(s *Subscriber, ctx context.Context, store *offsets.Store, groupID int32, dlq *offsets.Store) *subscription {
	sctx, cancel := context.WithCancelCause(ctx)
	sub := &subscription{
		s:       s,
		store:   store,
		groupID: groupID,
		cfg:     &s.config,
		logger: s.logger.With(watermill.LogFields{
			"topic":          store.T.Topic,
			"consumer_group": s.config.ConsumerGroup,
			"claim_mode":     s.config.ClaimMode.String(),
		}),
		ctx:   sctx,
		work:  newWorkSet(&s.config, context.WithoutCancel(ctx)),
		loops: loopGroup{cancel: cancel, ended: make(chan struct{}), finished: make(chan struct{})},
	}
	sub.claimer = newClaimer(sub)
	sub.handout = newHandout(sub)
	sub.settler = newSettler(sub, dlq)
	sub.claimer.woken, sub.claimer.unreg = wake.Register(store.T.Messages)
	sub.claimer.unlisten = listen.Acquire(s.db, s.logger)
	return sub
}

func (sub *subscription) start() {
	if prunes(sub.store.T.Dialect(), *sub.cfg) {
		sub.loop(newPruner(sub).run)
	}
	sub.loop(sub.claimer.run)
	sub.loop(sub.handout.run)
	sub.loop(sub.mode.run)
	sub.loop(sub.settler.run)
	sub.loop(func() { sub.settler.closeQueue(sub.handout.ended) })
	go func() {
		sub.loops.loops.Wait()
		close(sub.loops.ended)
	}()
	go func() {
		sub.loops.wg.Wait()
		sub.settler.producers.Wait()
		<-sub.mode.idle()
		sub.claimer.unreg()
		sub.s.removeSubscription(sub)
		close(sub.loops.finished)
	}()
}

// stop stops the subscription as a cancel of its Subscribe context would, with cause.
func (sub *subscription) stop(cause error) { sub.loops.cancel(cause) }

// loop runs f as one of the subscription's loops, which Shutdown waits for.
func (sub *subscription) loop(f func()) {
	sub.loops.wg.Add(1)
	sub.loops.loops.Add(1)
	go func() {
		defer sub.loops.wg.Done()
		defer sub.loops.loops.Done()
		f()
	}()
}

// stopping reports whether Shutdown has stopped the tracker: no statement runs any more.
func (sub *subscription) stopping() bool {
	select {
	case <-sub.s.tracker.Stopping():
		return true
	default:
		return false
	}
}
