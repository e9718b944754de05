package sqlbroker

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

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
	// MetadataOffset is the message's offset in its topic.
	MetadataOffset = "sqlbroker_offset"
)

// Subscriber claims messages of a topic for a consumer group and hands them to Watermill. It
// implements message.Subscriber and message.SubscribeInitializer.
type Subscriber struct {
	db     dbx.Pool
	config SubscriberConfig
	logger watermill.LoggerAdapter
	topics *topics

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
	claimed, acked, nacked, released, stale, leasesLost, errors, deadLettered atomic.Int64
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
	InFlight         int   // messages claimed and not yet settled, now
	LocksHeld        int   // advisory locks held by the lock connections, now (advisory mode)
}

// NewSubscriber builds a Subscriber on db, which must wrap a pool (Pgx or StdSQL). A nil
// logger logs nothing. Nothing is sent to the database until Subscribe.
func NewSubscriber(db DB, config SubscriberConfig, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if db.pool == nil {
		return nil, &ConfigError{Field: "db", Value: "not a pool", Reason: "must wrap a pool: use sqlbroker.Pgx or sqlbroker.StdSQL (a transaction can only publish)"}
	}
	batch := config.BatchSize
	config.setDefaults()
	if err := config.validate(); err != nil {
		return nil, err
	}
	if db.sqlite() {
		if err := config.validateSQLite(); err != nil {
			return nil, err
		}
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
		topics:   newTopics(config.Schema, config.TablePrefix, !config.SynchronousCommit, db.sqlite()),
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
	}
	s.mu.Lock()
	for sub := range s.subs {
		st.InFlight += sub.inFlight()
		if sub.adv != nil {
			st.LocksHeld += sub.adv.locksHeld()
		}
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
	return s.topics.tables(topic), nil
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
		sub.routerSub.Store(true)
		return h.relay(sub), nil
	}
	return sub.out, nil
}

func (s *Subscriber) subscribe(ctx context.Context, topic string) (*subscription, error) {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	store, err := s.topics.store(ctx, s.db, s.db, topic, s.config.InitializeSchema)
	if err != nil {
		return nil, fmt.Errorf("sqlbroker: subscribe to %q: %w", topic, err)
	}
	dlq, err := s.deadLetterStore(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("sqlbroker: subscribe to %q: dead-letter topic: %w", topic, err)
	}
	groupID, err := store.EnsureGroup(ctx, s.db, s.config.ConsumerGroup, s.config.StartAtNewest)
	if err != nil {
		return nil, fmt.Errorf("sqlbroker: subscribe to %q: consumer group %q: %w", topic, s.config.ConsumerGroup, err)
	}

	sub := newSubscription(s, ctx, store, groupID)
	sub.dlq = dlq
	if err := sub.openAdvisory(ctx); err != nil {
		sub.unreg()
		sub.unlisten()
		sub.cancel(err)
		return nil, fmt.Errorf("sqlbroker: subscribe to %q: %w", topic, err)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		sub.cancel(ErrClosed)
		if sub.adv != nil {
			sub.adv.conn.Close()
		}
		sub.unreg()
		sub.unlisten()
		return nil, ErrClosed
	}
	s.subs[sub] = struct{}{}
	s.mu.Unlock()
	sub.start()
	return sub, nil
}

// stopSubscriptions stops every subscription as a cancel of its context would: claiming
// stops, undelivered claims are given back, channels close. Deliveries in work stay claimed
// and their leases keep being extended until they settle or Shutdown runs.
func (s *Subscriber) stopSubscriptions() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for sub := range s.subs {
		sub.cancel(ErrClosed)
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
		ClaimsReleased:    int(sub.releasedAtStop.Load()),
		LocksReleased:     int(sub.unlockedAtStop.Load()),
		ConnectionsClosed: int(sub.connsClosed.Load()),

		QueriesCancelled:         int(sub.lockClaimsCancelled.Load()),
		ClaimStatementsCancelled: int(sub.lockClaimsCancelled.Load()),
	}
}

func validateTopic(topic string) error { return validateName("topic", topic) }

// subscription is one Subscribe call: its claim loop, lease extension and deliveries.
type subscription struct {
	s       *Subscriber
	store   *offsets.Store
	groupID int32
	logger  watermill.LoggerAdapter
	cfg     *SubscriberConfig

	ctx    context.Context // the Subscribe context, cancelled also by Close
	cancel context.CancelCauseFunc
	msgCtx context.Context // parent of message contexts: Subscribe's values, not its cancel

	out      chan *message.Message
	slots    chan struct{}  // one token a message in a handler (MaxInFlight)
	held     chan struct{}  // one token a claim held: in a handler, queued in ready, or settling
	ready    chan *delivery // claimed, waiting for a slot to be handed out (FIFO)
	prefetch int            // claims held beyond MaxInFlight, ready for the next free slot
	woken    <-chan struct{}
	unreg    func()
	unlisten func() bool // releases the process's LISTEN connection; true if that closed it

	mu     sync.Mutex
	inWork map[int64]*delivery // claimed and not yet settled or given up

	releasedAtStop atomic.Int64 // claims given back when the subscription stopped
	unlockedAtStop atomic.Int64 // advisory locks of those claims dropped then
	connsClosed    atomic.Int64 // the LISTEN connection, when the subscription's stop closed it
	notApplied     atomic.Int64 // settlements given up on because the subscriber shut down
	// lockClaimsCancelled counts the advisory claim rounds on the lock connection that the
	// server cancelled as the subscription stopped (the pool's statements are the tracker's).
	lockClaimsCancelled atomic.Int64
	routerSub           atomic.Bool // taken by a handler of a hooked Router
	alone               atomic.Bool // a Router subscription that stopped while the Router ran on

	adv *advisoryState // advisory-lock mode only (subscriber_advisory.go)
	dlq *offsets.Store // the dead-letter topic's, with MaxAttempts only (deadletter.go)

	dueAt      dueTimes     // when claims of this subscription come due again (delay.go)
	passed     atomic.Int32 // delayed messages the last claim passed (passDelayed)
	passRoom   int          // delayed messages the next claim may pass besides its room (claim loop)
	idle       idleState    // parking while there is nothing to claim (idlepoll.go)
	sqliteIdle sqliteIdle   // on SQLite: when an idle claim may be skipped (sqlitewatch.go)

	settleCh   chan settlement
	awaits     sync.WaitGroup // await goroutines; settleCh closes when they are all done
	settleQuit chan struct{}  // closed by Shutdown once no settlement can be queued any more

	claimDone chan struct{}  // the claim loop ended and out is closed
	stopExt   chan struct{}  // closed by shutdown: stop extending leases, stop awaiting settlements
	wg        sync.WaitGroup // every goroutine of the subscription but the await goroutines
	loops     sync.WaitGroup // the subscription's loops (loop), which Shutdown waits for
	// loopsEnded is closed once the loops ended: in lease mode no goroutine of the
	// subscription runs from then on.
	loopsEnded chan struct{}
	// finished is closed once every goroutine of the subscription has done its last work (the
	// loops, the awaits of deliveries, the subscription's removal from its subscriber).
	finished chan struct{}
}

// delivery is one claimed message.
type delivery struct {
	offset   int64
	token    int64
	attempts int // the claim's attempt count when it was delivered
	msg      *message.Message
	cancel   context.CancelCauseFunc
	gen      uint64 // advisory mode: generation of the lock connection that took its lock
	sub      *subscription

	mu       sync.Mutex
	deadline time.Time // local lease deadline
	lost     bool
	settling bool
	slot     bool // holds a handler slot (taken by handOutLoop, given back by freeSlot)
	unheld   bool // its held token was given back (freeHeld)
	inTx     bool // acked in the caller's transaction (AckInTx)
}

func newSubscription(s *Subscriber, ctx context.Context, store *offsets.Store, groupID int32) *subscription {
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
		ctx:        sctx,
		cancel:     cancel,
		msgCtx:     context.WithoutCancel(ctx),
		out:        make(chan *message.Message),
		slots:      make(chan struct{}, s.config.MaxInFlight),
		prefetch:   prefetchFor(&s.config),
		inWork:     map[int64]*delivery{},
		claimDone:  make(chan struct{}),
		settleCh:   make(chan settlement, s.config.MaxInFlight),
		settleQuit: make(chan struct{}),
		stopExt:    make(chan struct{}),
		loopsEnded: make(chan struct{}),
		finished:   make(chan struct{}),
	}
	sub.held = make(chan struct{}, s.config.MaxInFlight+sub.prefetch)
	sub.ready = make(chan *delivery, s.config.MaxInFlight+sub.prefetch)
	sub.initIdle()
	sub.woken, sub.unreg = wake.Register(store.T.Messages)
	sub.unlisten = listen.Acquire(s.db, s.logger)
	return sub
}

func (sub *subscription) start() {
	if sub.cfg.Retention > 0 {
		sub.loop(sub.pruneLoop)
	}
	sub.loop(sub.claimLoop)
	sub.loop(sub.handOutLoop)
	if sub.adv != nil {
		sub.loop(sub.adv.run)
	} else {
		sub.loop(sub.extendLoop)
	}
	sub.loop(sub.settleLoop)
	sub.loop(sub.closeSettleCh)
	go func() {
		sub.loops.Wait()
		close(sub.loopsEnded)
	}()
	go func() {
		sub.wg.Wait()
		sub.awaits.Wait()
		if sub.adv != nil {
			<-sub.adv.idle
		}
		sub.unreg()
		sub.s.removeSubscription(sub)
		close(sub.finished)
	}()
}

// loop runs f as one of the subscription's loops, which Shutdown waits for.
func (sub *subscription) loop(f func()) {
	sub.wg.Add(1)
	sub.loops.Add(1)
	go func() {
		defer sub.wg.Done()
		defer sub.loops.Done()
		f()
	}()
}

// closeSettleCh closes settleCh once the claim loop has ended and no await goroutine is left
// to queue a settlement. In advisory mode Shutdown's settleQuit comes first (the settle loop
// ends on it), and the awaits of deliveries still in work end on it too: this loop, which
// Shutdown waits for, ends once they have.
func (sub *subscription) closeSettleCh() {
	<-sub.claimDone
	awaited := make(chan struct{})
	go func() {
		sub.awaits.Wait()
		close(awaited)
	}()
	select {
	case <-awaited:
		close(sub.settleCh)
	case <-sub.settleQuit:
		<-awaited
	}
}

func (sub *subscription) inFlight() int {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	return len(sub.inWork)
}

func (sub *subscription) fields(offset int64) watermill.LogFields {
	return watermill.LogFields{"offset": offset}
}

// wait sleeps for d, or until the topic is woken (a publisher of this process, or a NOTIFY
// through the LISTEN connection), or ctx ends. It reports whether to go on, and whether it
// was woken.
func (sub *subscription) wait(d time.Duration, wakeable bool) (goOn, woken bool) {
	t := time.NewTimer(d)
	defer t.Stop()
	var wakeCh <-chan struct{}
	if wakeable {
		wakeCh = sub.woken
	}
	select {
	case <-t.C:
		return true, false
	case <-wakeCh:
		return true, true
	case <-sub.ctx.Done():
		return false, false
	}
}

// firstRetryAfterWake is the first pause after a wake-up that found nothing: the message that
// woke the subscription may still be held back by the xmin horizon (an older transaction
// elsewhere in the cluster is still running), so it is looked for again soon, at doubling
// intervals up to PollInterval.
const firstRetryAfterWake = 5 * time.Millisecond

// prefetchFor is how many claims a subscription holds beyond MaxInFlight, so that a handler
// slot that frees is filled from memory while the next claim runs, and claims can be large
// (the consumers of a group take turns on its row: with small claims, four subscribers of
// one group were bound by those turns). In the advisory mode every claim holds a lock, so
// a subscription holds at most MaxInFlight + BatchSize locks (A6). None with MaxInFlight 1,
// where order must hold across nacks (M3): a message claimed ahead would overtake one nacked
// before it.
func prefetchFor(c *SubscriberConfig) int {
	if c.MaxInFlight == 1 {
		return 0
	}
	return min(c.MaxInFlight, c.BatchSize)
}

// claimLoop claims messages while claims may be held, and queues them for handOutLoop.
func (sub *subscription) claimLoop() {
	defer close(sub.ready)
	defer func() {
		if sub.unlisten() {
			sub.connsClosed.Add(1)
		}
	}()
	defer sub.joinIdlePoll()()

	buf := make([]offsets.Claimed, 0, sub.cfg.BatchSize)
	idle := sub.cfg.PollInterval // the next pause when a claim finds nothing
	due := dueState{again: true}
	passed := false // the last claim passed delayed messages
	for {
		// Room for at least one claim, then as many as are free, up to BatchSize.
		select {
		case sub.held <- struct{}{}:
		case <-sub.ctx.Done():
			return
		}
		n := sub.gather()

		now := time.Now()
		var claimed []offsets.Claimed
		var token int64
		var err error
		withDue, ownDue, missed := false, false, false
		if sub.lookNeeded(now) { // else nothing changed since a claim found nothing (sqlitewatch.go)
			sub.looking(now)
			withDue, ownDue = sub.wantDue(&due, now)
			sub.passRoom = 0
			if passed {
				sub.passRoom = passAfterPassing
			}
			sub.passed.Store(0)
			claimed, token, err = sub.claim(buf[:0], n, withDue) // none when err != nil
			due.claimed(withDue, now.Add(sub.cfg.PollInterval), claimed, n, err)
			// The claim passed delayed messages: more of them, and messages to hand out behind
			// them, may be waiting. The next claim runs at once, not after the idle pause, with
			// room to pass many (passAfterPassing).
			passed = err == nil && sub.passed.Load() > 0
			// A due time of its own came and the claim took nothing again: the claim may have
			// run a moment before the database's clock reached that time. It is looked for
			// again soon, once (firstRetryAfterWake), not only at the next idle look.
			missed = err == nil && ownDue && (len(claimed) == 0 || !claimed[0].Again)
			sub.sqliteIdle.mustLook = err != nil || len(claimed) > 0 || passed || missed
		}
		for range n - len(claimed) {
			<-sub.held
		}
		if err != nil {
			if sub.ctx.Err() != nil {
				return
			}
			if dbx.SQLState(err) == dbx.CodeLockNotAvailable {
				// The advisory claim waited out LockWaitTimeout on a lock held elsewhere (a
				// migration's table lock): expected contention, not a failure.
				sub.logger.Info("Claim waited too long for a lock, retrying", watermill.LogFields{"err": err, "retry_in": sub.cfg.RetryInterval})
			} else {
				sub.s.stats.errors.Add(1)
				sub.logger.Error("Claim failed, retrying", err, watermill.LogFields{"retry_in": sub.cfg.RetryInterval})
			}
			if goOn, _ := sub.wait(sub.cfg.RetryInterval, false); !goOn {
				return
			}
			continue
		}
		if len(claimed) == 0 {
			if passed {
				continue
			}
			if missed {
				idle = firstRetryAfterWake
			}
			var goOn, woken bool
			if withDue && !missed && sub.idle.entry != nil && idle >= min(sub.cfg.PollInterval, sub.cfg.IdlePollInterval) {
				// Nothing now, nothing due: sleep until told (idlepoll.go).
				goOn, woken = sub.park()
			} else {
				goOn, woken = sub.wait(sub.untilDue(idle), true)
			}
			if !goOn {
				return
			}
			if woken {
				sub.sqliteIdle.mustLook = true
				idle = firstRetryAfterWake
			} else {
				idle = min(idle*2, sub.cfg.PollInterval)
			}
			continue
		}
		idle = sub.cfg.PollInterval
		sub.s.stats.claimed.Add(int64(len(claimed)))
		sub.register(claimed, token, now)
	}
}

// dueState tells the claim loop when its claims run the due step (offsets.Store.Claim), which
// takes back claims whose lease ran out or whose nack backoff passed. Looking for them costs a
// walk of the group's claims and of the index entries of every claim settled since the last
// vacuum, so a subscription draining a backlog looks once per PollInterval (claims of other
// consumers, whose times it cannot know), and at once when it knows better:
//   - one of its own claims came due: a nack's backoff ended, a lease was lost, or the time
//     of a delayed message it passed came (dueAt);
//   - its last claim failed, was short (the backlog ran out, or in the advisory mode a lock
//     was taken elsewhere and the claim left due for a later round), or took claims again:
//     there may be more.
//
// With MaxInFlight 1 a nacked message is thus claimed again by the first claim after its
// backoff, ahead of new messages (M3).
type dueState struct {
	next  time.Time // the next periodic look
	again bool      // look at the next claim
}

// wantDue says whether the claim made at now runs the due step, and takes the subscription's
// own due times that have come; own says whether there were any.
func (sub *subscription) wantDue(st *dueState, now time.Time) (want, own bool) {
	own = sub.dueAt.take(now.UnixNano())
	return own || st.again || !now.Before(st.next), own
}

// claimed records the outcome of a claim of up to n messages; next is the periodic look after
// one that ran the due step.
func (st *dueState) claimed(withDue bool, next time.Time, cs []offsets.Claimed, n int, err error) {
	if withDue {
		st.next = next
	}
	st.again = err != nil || len(cs) < n || (len(cs) > 0 && cs[0].Again) // taken again come first
}

// markDue notes that a claim of this subscription is due again from t on.
func (sub *subscription) markDue(t time.Time) {
	if sub.dueAt.add(t.UnixNano()) {
		sub.pokeDue()
	}
}

// gather takes the free held tokens, up to BatchSize, for the next claim; the caller holds
// one already. With claims held ahead (prefetch), it waits until at least half of them are
// free: under load tokens free one at a time, and claiming each at once would make a claim
// statement a message, every one of them locking the group's row (the consumers of a group
// take turns on it) and paying a round trip, while the handlers are fed from the claims held
// ahead meanwhile. Tokens are then certain to free: fewer than half free means more than
// MaxInFlight held, so some are in handlers or settling. An idle subscription has every token
// free and claims at once.
func (sub *subscription) gather() int {
	n := 1
	want := max(1, sub.prefetch/2)
	for n < sub.cfg.BatchSize {
		if n < want {
			select {
			case sub.held <- struct{}{}:
				n++
			case <-sub.ctx.Done():
				return n
			}
			continue
		}
		select {
		case sub.held <- struct{}{}:
			n++
		default:
			return n
		}
	}
	return n
}

// claimTimeout bounds one claim statement, as a safety net: it runs under no caller's
// context (see claim).
const claimTimeout = time.Minute

// claim takes up to n messages in one short statement: no transaction is left open.
//
// The statement runs through the subscriber's tracker, never under the subscription's context
// directly: a context cancelled in the middle of a query makes the driver return at once while
// the server may still be running it (pgx then closes the socket in the background), so the
// caller's error is not the server's word. When the subscription stops during a claim (or
// while it waits for a connection of an exhausted pool), the server is asked to cancel that
// very statement, and the claim returns only once the server has ended it and rolled it back
// (S3, S11).
func (sub *subscription) claim(buf []offsets.Claimed, n int, due bool) ([]offsets.Claimed, int64, error) {
	if sub.adv != nil {
		return sub.adv.claim(buf, n, due)
	}
	token := rand.Int64N(1<<62) + 1
	if sub.ctx.Err() != nil {
		return nil, 0, sub.ctx.Err()
	}
	var pid uint32
	claimed := buf
	err := sub.s.tracker.RunConn(sub.ctx, stmtClaim, claimTimeout, func(ctx context.Context, conn dbx.Conn) error {
		// Known without a round trip on pgx, and asked once per connection on database/sql;
		// 0 if it cannot be had. dropUnsure needs it after the connection is gone.
		pid, _ = conn.PID(ctx)
		var err error
		claimed, err = sub.store.ClaimPassing(ctx, conn, sub.groupID, token, sub.cfg.LeaseTTL, n, sub.passRoom, due, buf)
		return err
	})
	claimed = sub.passDelayed(claimed, err)
	if err != nil && len(claimed) > 0 {
		if dbx.SQLState(err) != dbx.CodeQueryCanceled {
			sub.dropUnsure(claimed, token, pid)
		} // else the server ended the statement and rolled it back: its claims never were
		claimed = claimed[:0]
	}
	return claimed, token, err
}

// dropUnsure gives back claims whose rows arrived before their statement failed, which none
// of them is handed out for: the connection may have been cut after the server committed
// (a restart of the server does that), or before it did, since rows go out while the
// statement still runs and its writes are made last. So it first waits, up to
// CleanupTimeout, for the statement's backend (pid) to end, which settles whether the claim
// committed; then a release fenced by the claim's token makes the rows visible again at once
// if they were claimed, and matches nothing if they were not. If the backend cannot be seen
// to end, or the release fails, the rows return when their lease runs out (L5). Handing them
// out instead would deliver messages whose claim may have been rolled back, and keeping them
// would hold their MaxInFlight places forever: with MaxInFlight 1 the subscription stopped
// claiming at a restart.
func (sub *subscription) dropUnsure(cs []offsets.Claimed, token int64, pid uint32) {
	fs := offsets.Fence(cs, token)
	if pid != 0 && !sub.backendEnded(pid) {
		sub.logger.Info("A failed claim's statement may still be running; its claims return when their lease runs out", watermill.LogFields{"count": len(fs), "backend_pid": pid})
		return
	}
	if n, ok := sub.releaseRows(fs, "Releasing the claims of a failed claim statement failed; they return when their lease runs out"); ok && n > 0 {
		sub.markDue(time.Now())
	}
}

// backendEnded waits up to CleanupTimeout for the server process pid to be gone, and says
// whether it saw it go. A failed look is tried again: after a restart the server is back
// within that time, without the process. (A new backend given the same pid meanwhile only
// makes it wait.)
func (sub *subscription) backendEnded(pid uint32) bool {
	ctx, cancel := dbx.CleanupContext(sub.ctx)
	defer cancel()
	for {
		var alive bool
		err := sub.s.tracker.Run(ctx, stmtBackend, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
			return dbx.QueryRow(ctx, q, "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", []any{int64(pid)}, &alive)
		})
		if err == nil && !alive {
			return true
		}
		pause := 10 * time.Millisecond
		if err != nil {
			pause = 100 * time.Millisecond // the server may be restarting
		}
		select {
		case <-time.After(pause):
		case <-ctx.Done():
			return false
		case <-sub.s.tracker.Stopping():
			return false
		}
	}
}

// releaseRows makes claims visible again at once, fenced by their tokens, and returns how
// many the database released. A failure is counted and logged as failed, which says what
// becomes of the claims then.
func (sub *subscription) releaseRows(fs []offsets.Fenced, failed string) (int, bool) {
	var done map[int64]bool
	err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtRelease, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		var err error
		done, err = sub.store.Release(ctx, q, sub.groupID, fs)
		return err
	})
	if err != nil {
		sub.s.stats.errors.Add(1)
		sub.logger.Error(failed, err, watermill.LogFields{"count": len(fs)})
		return 0, false
	}
	sub.s.stats.released.Add(int64(len(done)))
	return len(done), true
}

// register puts claimed messages in the work set and queues them for handOutLoop; the queue
// holds every token of held, so this never blocks.
func (sub *subscription) register(claimed []offsets.Claimed, token int64, sent time.Time) {
	// The database counts the lease from when it wrote the claim, which is after sent (the
	// statement may have waited on a lock): counted from sent, the local deadline never
	// outlives the database's. A claim that waited longer than the lease arrives with its
	// local deadline passed; its first extension moves both.
	deadline := sent.Add(sub.cfg.LeaseTTL)
	ds := make([]*delivery, len(claimed))
	sub.mu.Lock()
	for i, c := range claimed {
		d := sub.newDelivery(c, token, deadline)
		ds[i] = d
		sub.inWork[c.Offset] = d
	}
	sub.mu.Unlock()
	if sub.adv != nil {
		sub.adv.registered(ds)
	}
	for _, d := range ds {
		if sub.dlq != nil && d.attempts > sub.cfg.MaxAttempts {
			sub.deadOnArrival(d)
			continue
		}
		sub.ready <- d
	}
}

// handOutLoop sends queued messages on out, one by one, each once a handler slot is free.
// When the subscription stops, the claims not yet handed out are given back at once and out
// is closed (M5).
func (sub *subscription) handOutLoop() {
	defer close(sub.claimDone)
	defer close(sub.out)
	expire := time.NewTimer(time.Hour)
	expire.Stop()
	defer expire.Stop()
	for d := range sub.ready {
		if sub.ctx.Err() != nil {
			sub.giveBackQueued(d)
			return
		}
		if d.isLost() {
			sub.dropLost(d)
			continue
		}
		select {
		case sub.slots <- struct{}{}:
		case <-sub.ctx.Done():
			sub.giveBackQueued(d)
			return
		}
		d.mu.Lock()
		d.slot = true
		d.mu.Unlock()
		handed, stop := sub.send(d, expire)
		switch {
		case stop:
			sub.giveBackQueued(d)
			return
		case !handed:
			sub.dropLost(d)
			continue
		}
		sub.awaits.Add(1)
		go sub.await(d)
	}
}

// send offers d's message on out until a handler takes it (handed), the subscription stops
// (stop), or d is lost meanwhile (neither). In lease mode a claim whose local deadline passed
// (the process was frozen, extensions failed) may be another consumer's already: it is lost,
// not handed out, whether the deadline passed before the send or while it waited for a
// handler. The deadline is read again right before each attempt, and the wait ends when it
// passes (expire, a timer of the caller's, is armed for it) or when d is lost otherwise (its
// context ends).
func (sub *subscription) send(d *delivery, expire *time.Timer) (handed, stop bool) {
	for {
		if sub.ctx.Err() != nil {
			return false, true
		}
		d.mu.Lock()
		if sub.adv == nil && !d.lost && !time.Now().Before(d.deadline) {
			d.lost = true
		}
		lost, deadline := d.lost, d.deadline
		d.mu.Unlock()
		if lost {
			return false, false
		}
		var expired <-chan time.Time
		if sub.adv == nil {
			expire.Reset(time.Until(deadline))
			expired = expire.C
		}
		select {
		case sub.out <- d.msg:
			expire.Stop()
			return true, false
		case <-expired:
			// Checked again above: an extension may have moved the deadline meanwhile.
		case <-d.msg.Context().Done():
			// Lost (its extension refused, its lock gone with its connection): nothing is
			// handed a message whose context ended.
			expire.Stop()
			return false, false
		case <-sub.ctx.Done():
			expire.Stop()
			return false, true
		}
	}
}

// dropLost drops a claim that lost its lease, or its lock with the lock connection, while it
// was held ahead: no handler runs it here. Its row is due (the lease ran out) or an orphan
// (no lock holds it): the group's next claim or orphan search takes it, this subscription's
// included once the claim has left its work set.
func (sub *subscription) dropLost(d *delivery) {
	sub.logger.Debug("Claim held ahead lost before it was handed out", sub.fields(d.offset))
	sub.forget(d)
}

func (d *delivery) isLost() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.lost
}

// giveBackQueued gives back d and every claim still queued, once the claim loop has ended.
func (sub *subscription) giveBackQueued(d *delivery) {
	ds := []*delivery{d}
	for d := range sub.ready {
		ds = append(ds, d)
	}
	sub.giveBack(ds)
}

func (sub *subscription) newDelivery(c offsets.Claimed, token int64, deadline time.Time) *delivery {
	msg := message.NewMessage(c.UUID, c.Payload)
	if c.Metadata != "" && c.Metadata != "{}" {
		md := map[string]string{}
		if err := json.Unmarshal([]byte(c.Metadata), &md); err != nil {
			sub.logger.Error("Message metadata is not a JSON object of strings; delivering without it", err, sub.fields(c.Offset))
		}
		for k, v := range md {
			msg.Metadata.Set(k, v)
		}
	}
	msg.Metadata.Set(MetadataAttempt, strconv.Itoa(c.Attempts))
	msg.Metadata.Set(MetadataOffset, strconv.FormatInt(c.Offset, 10))
	ctx, cancel := context.WithCancelCause(sub.msgCtx)
	d := &delivery{offset: c.Offset, token: token, attempts: c.Attempts, msg: msg, cancel: cancel, deadline: deadline, sub: sub}
	msg.SetContext(context.WithValue(ctx, deliveryKey{}, d))
	return d
}

// giveBack releases claims that never reached a handler.
func (sub *subscription) giveBack(ds []*delivery) {
	fs := make([]offsets.Fenced, len(ds))
	sub.mu.Lock()
	for i, d := range ds {
		fs[i] = offsets.Fenced{Offset: d.offset, Token: d.token}
		delete(sub.inWork, d.offset)
		d.cancel(ErrClosed)
	}
	sub.mu.Unlock()
	for _, d := range ds {
		sub.freeSlot(d)
		sub.freeHeld(d)
	}
	if sub.adv != nil {
		sub.adv.release(ds, fs)
		return
	}
	n, ok := sub.releaseRows(fs, "Releasing undelivered claims failed; they return when their lease runs out")
	if ok {
		sub.releasedAtStop.Add(int64(n))
		sub.logger.Debug("Released undelivered claims", watermill.LogFields{"count": n})
	}
}

// outcome waits for the handler's ack ("ack") or nack ("nack") of d, or for stop ("").
func outcome[T any](d *delivery, stop <-chan T) string {
	select {
	case <-d.msg.Acked():
		return "ack"
	case <-d.msg.Nacked():
		return "nack"
	case <-stop:
		return ""
	}
}

// await waits for the handler's ack or nack and queues it for the settle loop.
func (sub *subscription) await(d *delivery) {
	if sub.adv != nil {
		sub.adv.await(d)
		return
	}
	defer sub.awaits.Done()
	op := outcome(d, sub.stopExt)
	if op == "" {
		// Shutdown stopped watching (S4, S11): a settlement made by then is still applied;
		// one made later is not, and the message returns when its lease runs out.
		select {
		case <-d.msg.Acked():
			op = "ack"
		case <-d.msg.Nacked():
			op = "nack"
		default:
			return
		}
	}
	d.mu.Lock()
	d.settling = true
	d.mu.Unlock()
	sub.settleCh <- settlement{d: d, op: op}
	// The handler is done: its slot goes back now. An ack's held token goes back too, not when
	// the settle statement has run, so the next claim does not wait for that round trip. A
	// nack keeps its token until it is applied, so that the message it makes due again is
	// claimed before newer ones (with MaxInFlight 1, order holds across nacks). Acks waiting
	// for their statement are bounded by settleCh's capacity plus one statement's batch.
	sub.freeSlot(d)
	if op == "ack" {
		sub.freeHeld(d)
	}
}

// settlement is an ack or nack waiting to be applied.
type settlement struct {
	d  *delivery
	op string
}

// nackWaits returns how long the message of each settlement waits after its nack: until the
// time its handler delayed it to (middleware.DelayOnError sets it in the metadata), or else the
// backoff of its attempt (SubscriberConfig.nackBackoff), drawn once per attempt and call, so
// that the nacks of one attempt share a statement.
func (sub *subscription) nackWaits(sts []settlement) []time.Duration {
	waits := make([]time.Duration, len(sts))
	byAttempt := map[int]time.Duration{}
	now := time.Now()
	for i, st := range sts {
		if sub.overAttempts(st.d) {
			waits[i] = deadLetterWait
			continue
		}
		if until, later, err := delayedUntil(st.d.msg.Metadata, now); err == nil && later {
			waits[i] = until.Sub(now).Round(time.Millisecond)
			continue
		}
		w, ok := byAttempt[st.d.attempts]
		if !ok {
			w = sub.cfg.nackBackoff(st.d.attempts)
			byAttempt[st.d.attempts] = w
		}
		waits[i] = w
	}
	return waits
}

// maxSettleBatch bounds the settlements applied in one statement.
const maxSettleBatch = 1000

// settleLoop applies acks and nacks, fenced by each delivery's token. Whatever queued up while
// the previous statement ran goes into the next one, so under load one round trip settles
// many messages and at rest a settlement waits for nothing. A database error (a statement
// blocked longer than CleanupTimeout is cancelled on the server) is retried while the
// delivery's lease still holds (it keeps being extended meanwhile), until Shutdown stops the
// tracker: what is left is then given up (giveUp).
func (sub *subscription) settleLoop() {
	var pending []settlement
	lite := sub.store.T.IsSQLite()
	for {
		if len(pending) == 0 {
			select {
			case st, ok := <-sub.settleCh:
				if !ok {
					return
				}
				pending = append(pending, st)
			case <-sub.settleQuit:
				// Nothing is queued any more: apply what is there, then end.
				for len(pending) < maxSettleBatch {
					select {
					case st, ok := <-sub.settleCh:
						if ok {
							pending = append(pending, st)
							continue
						}
					default:
					}
					break
				}
				if len(pending) == 0 {
					return
				}
			}
		}
		if lite {
			// SQLite runs its statements on the process's CPU, and every settlement statement is
			// a write transaction of its own: under load the handlers that finish meanwhile are
			// waiting for the CPU this loop holds. Letting them run first puts their acks in this
			// statement rather than one each. With nothing else to run the yield returns at
			// once, so a settlement at rest still waits for nothing.
			runtime.Gosched()
		}
	drain:
		for len(pending) < maxSettleBatch {
			select {
			case st, ok := <-sub.settleCh:
				if !ok {
					break drain
				}
				pending = append(pending, st)
			default:
				break drain
			}
		}
		var failed []settlement
		for _, op := range [...]string{"ack", "nack"} {
			failed = append(failed, sub.apply(op, pending)...)
		}
		pending = failed
		if len(pending) > 0 && sub.stopping() {
			sub.giveUp(pending)
			pending = nil
		}
		if len(pending) > 0 {
			select {
			case <-time.After(sub.cfg.RetryInterval):
			case <-sub.s.tracker.Stopping():
			}
		}
	}
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

// giveUp drops settlements that Shutdown left no time to apply, and counts them. In lease
// mode their messages return when their leases run out; in advisory mode Shutdown has
// released their locks, and they are refused as such.
func (sub *subscription) giveUp(sts []settlement) {
	sub.notApplied.Add(int64(len(sts)))
	if sub.adv != nil {
		for _, op := range [...]string{"ack", "nack"} {
			sub.adv.apply(op, sts)
		}
		return
	}
	sub.logger.Info("Settlements not applied before the shutdown ended; their messages return when their leases run out", watermill.LogFields{"count": len(sts)})
	for _, st := range sts {
		sub.forget(st.d)
	}
}

// settleStatement applies acks or nacks (op) of the fenced claims in one statement, through
// the tracker (cancelled on the server after CleanupTimeout, or when Shutdown stops it), and
// returns the offsets it settled. waits holds, for nacks, how long each claim of fs waits
// before it comes due again (nackWaits).
func (sub *subscription) settleStatement(op string, fs []offsets.Fenced, waits []time.Duration) (map[int64]bool, error) {
	if op != "ack" {
		return sub.nackStatements(fs, waits)
	}
	var done map[int64]bool
	err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtAck, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
		var err error
		done, err = sub.store.Ack(ctx, q, sub.groupID, fs)
		return err
	})
	return done, err
}

// nackStatements applies nacks of the fenced claims fs, each to come due after its wait in
// waits (see nackWaits), one statement per distinct wait, and tells the claim loop when each
// comes due again (markDue).
func (sub *subscription) nackStatements(fs []offsets.Fenced, waits []time.Duration) (map[int64]bool, error) {
	byWait := map[time.Duration][]offsets.Fenced{}
	var order []time.Duration
	for i, f := range fs {
		if _, ok := byWait[waits[i]]; !ok {
			order = append(order, waits[i])
		}
		byWait[waits[i]] = append(byWait[waits[i]], f)
	}
	done := make(map[int64]bool, len(fs))
	for _, w := range order {
		var these map[int64]bool
		if w == deadLetterWait {
			these, err := sub.deadLetter(byWait[w])
			if err != nil {
				return done, err
			}
			for o := range these {
				done[o] = true
			}
			continue
		}
		err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtNack, dbx.CleanupTimeout, func(ctx context.Context, q dbx.Querier) error {
			var err error
			these, err = sub.store.Nack(ctx, q, sub.groupID, byWait[w], w)
			return err
		})
		for o := range these {
			done[o] = true // applied, even when a later statement of the call failed
		}
		if err != nil {
			return done, err
		}
		if len(these) > 0 {
			sub.markDue(time.Now().Add(w))
		}
	}
	return done, nil
}

// apply runs the settlements of kind op among sts in one statement and returns those that
// failed with a database error and may be retried. Those that its statements applied before
// the error are settled: counted as applied and not run again (a second run would find their
// claims gone and count them stale).
func (sub *subscription) apply(op string, sts []settlement) []settlement {
	if sub.adv != nil {
		return sub.adv.apply(op, sts)
	}
	sts, inTx := sub.ackedInTx(op, sts)
	sub.settledInTx(inTx)
	var these []settlement
	var fs []offsets.Fenced
	for _, st := range sts {
		if st.op == op {
			these = append(these, st)
			fs = append(fs, offsets.Fenced{Offset: st.d.offset, Token: st.d.token})
		}
	}
	if len(fs) == 0 {
		return nil
	}
	done, err := sub.settleStatement(op, fs, sub.nackWaits(these))
	if err != nil {
		var rest []settlement
		for _, st := range these {
			if done[st.d.offset] {
				sub.countApplied(op)
				sub.forget(st.d)
			} else {
				rest = append(rest, st)
			}
		}
		these = rest
		if len(these) == 0 {
			return nil
		}
		if sub.stopping() {
			return these // settleLoop gives them up
		}
		sub.s.stats.errors.Add(1)
		var retry []settlement
		for _, st := range these {
			st.d.mu.Lock()
			left := time.Until(st.d.deadline)
			st.d.mu.Unlock()
			if left > 0 {
				retry = append(retry, st)
				continue
			}
			sub.logger.Error("Settlement failed and the lease ran out; the message will be redelivered", err, sub.fields(st.d.offset))
			sub.forget(st.d)
		}
		sub.logger.Error("Settlement failed", err, watermill.LogFields{"op": op, "count": len(these), "retrying": len(retry)})
		return retry
	}
	for _, st := range these {
		if done[st.d.offset] {
			sub.countApplied(op)
		} else if st.d.wasAckedInTx() {
			sub.s.stats.acked.Add(1) // the caller's transaction acked it and committed
		} else {
			sub.s.stats.stale.Add(1)
			st.d.mu.Lock()
			lost := st.d.lost
			st.d.mu.Unlock()
			serr := &StaleSettlementError{Topic: sub.store.T.Topic, ConsumerGroup: sub.cfg.ConsumerGroup, Offset: st.d.offset, Op: op}
			sub.logStale("Settlement refused", serr, watermill.LogFields{"lease_lost_before": lost})
		}
		sub.forget(st.d)
	}
	return nil
}

// countApplied counts an applied settlement of kind op.
func (sub *subscription) countApplied(op string) {
	if op == "ack" {
		sub.s.stats.acked.Add(1)
	} else {
		sub.s.stats.nacked.Add(1)
	}
}

// logStale logs a settlement refused because its claim was no longer the delivery's (err
// wraps a StaleSettlementError), at Info: it means only that the claim was lost (its lease
// ran out, its lock went, or Shutdown released it), and the message is or will be delivered
// again; Stats().StaleSettlements counts them. The error is in the field "err".
func (sub *subscription) logStale(msg string, err error, fields watermill.LogFields) {
	f := watermill.LogFields{"err": err}
	for k, v := range fields {
		f[k] = v
	}
	sub.logger.Info(msg, f)
}

// forget drops a delivery from the work set, frees its slot and ends its context.
func (sub *subscription) forget(d *delivery) {
	sub.mu.Lock()
	if sub.inWork[d.offset] == d {
		delete(sub.inWork, d.offset)
	}
	sub.mu.Unlock()
	d.cancel(context.Canceled)
	sub.freeSlot(d)
	sub.freeHeld(d)
}

// freeSlot gives back d's handler slot, if it holds one.
func (sub *subscription) freeSlot(d *delivery) {
	d.mu.Lock()
	had := d.slot
	d.slot = false
	d.mu.Unlock()
	if had {
		<-sub.slots
	}
}

// freeHeld gives back d's held token, once.
func (sub *subscription) freeHeld(d *delivery) {
	d.mu.Lock()
	done := d.unheld
	d.unheld = true
	d.mu.Unlock()
	if !done {
		<-sub.held
	}
}

// pruneLoop deletes settled messages older than Retention while the subscription claims; a
// delete running when the subscription stops is cancelled on the server.
func (sub *subscription) pruneLoop() {
	every := min(max(sub.cfg.Retention/10, time.Second), time.Minute)
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-sub.claimDone:
			return
		}
		for {
			var n int64
			err := sub.s.tracker.Run(sub.ctx, stmtPrune, every, func(ctx context.Context, q dbx.Querier) error {
				var err error
				n, err = sub.store.Prune(ctx, q, sub.cfg.Retention, 10000)
				return err
			})
			if err != nil {
				if sub.ctx.Err() != nil {
					return // stopped: cancelled on the server, and it is tried again by the next run
				}
				sub.s.stats.errors.Add(1)
				sub.logger.Error("Deleting settled messages failed", err, nil)
				break
			}
			if n > 0 {
				sub.logger.Debug("Deleted settled messages", watermill.LogFields{"count": n})
			}
			if n < 10000 || sub.ctx.Err() != nil {
				break
			}
		}
	}
}

// extendLoop extends the leases of every delivery in work, well before they run out (L2). A
// lease the database refuses to extend, or whose deadline passed locally, is lost: the
// message's context is cancelled so the handler can stop (L4). An extension that cannot run
// (blocked on a table lock, a slow server) is cancelled on the server once LeaseRenewInterval
// has passed and tried again at the next tick; when the lease's deadline passes meanwhile,
// the lease is lost.
func (sub *subscription) extendLoop() {
	t := time.NewTicker(sub.cfg.LeaseRenewInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-sub.stopExt:
			return
		case <-sub.claimDone:
			// The subscription stopped; keep extending while handlers still work.
			if sub.inFlight() == 0 {
				return
			}
			select {
			case <-t.C:
			case <-sub.stopExt:
				return
			}
		}
		sub.extendOnce()
	}
}

func (sub *subscription) extendOnce() {
	sub.mu.Lock()
	ds := make([]*delivery, 0, len(sub.inWork))
	for _, d := range sub.inWork {
		ds = append(ds, d)
	}
	sub.mu.Unlock()
	if len(ds) == 0 {
		return
	}
	fs := make([]offsets.Fenced, 0, len(ds))
	live := ds[:0]
	now := time.Now()
	for _, d := range ds {
		d.mu.Lock()
		ok := !d.lost && !d.inTx // a claim acked in a transaction is locked by it until it ends
		d.mu.Unlock()
		if ok {
			fs = append(fs, offsets.Fenced{Offset: d.offset, Token: d.token})
			live = append(live, d)
		}
	}
	var done map[int64]bool
	err := sub.s.tracker.Run(context.WithoutCancel(sub.ctx), stmtExtend, sub.cfg.LeaseRenewInterval, func(ctx context.Context, q dbx.Querier) error {
		var err error
		done, err = sub.store.Extend(ctx, q, sub.groupID, fs, sub.cfg.LeaseTTL)
		return err
	})
	if err != nil && sub.stopping() {
		return // Shutdown stopped it: the leases are left to run out
	}
	if err != nil {
		sub.s.stats.errors.Add(1)
		sub.logger.Error("Extending leases failed", err, watermill.LogFields{"count": len(fs)})
	}
	for _, d := range live {
		d.mu.Lock()
		switch {
		case err == nil && done[d.offset]:
			d.deadline = now.Add(sub.cfg.LeaseTTL)
			d.mu.Unlock()
		case err == nil && !d.settling, err != nil && time.Now().After(d.deadline):
			d.lost = true
			d.mu.Unlock()
			sub.markDue(time.Now()) // its lease ran out: the row is due, and this may take it
			sub.s.stats.leasesLost.Add(1)
			sub.logger.Info("Lease lost; the message may be redelivered", sub.fields(d.offset))
			d.cancel(ErrLeaseLost)
		default:
			d.mu.Unlock()
		}
	}
}
