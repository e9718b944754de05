package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

// envConsumer carries the JSON consumerConfig of a consumer process.
const envConsumer = "SQLBROKER_CHAOS_CONSUMER"

// Payloads of the probes the recovery measurements publish; the handler treats them apart.
const (
	probeHold = "probe-hold" // first attempt: recorded as "seen", then held until the process dies
	probePing = "probe-ping" // recorded at once
)

// consumerConfig is what one consumer process runs.
type consumerConfig struct {
	ID          string // process instance: slot and generation, "c1g3"
	URL         string // the library's URL (scheme picks the driver, application_name marks it)
	RecordURL   string // where handled messages are recorded, outside the library
	Topic       string
	Group       string
	Mode        int
	Results     string // quoted name of the results table
	MaxConns    int
	MaxInFlight int
	LeaseTTL    time.Duration
	Renew       time.Duration
	Poll        time.Duration
	Retry       time.Duration
	Timeout     time.Duration // handler timeout (middleware.Timeout)
	Faults      bool          // handlers panic, nack and time out for some messages
	WorkMax     time.Duration // without Faults: each handler works a random 0..WorkMax before it returns
	NoProbes    bool          // the probes of the recovery measurements are ordinary messages here
	NackPercent int           // without Faults: the handler fails this share of its handlings, at random
	RecordConns int           // the recording pool's connections (0: 8)
	NackBackoff time.Duration // the subscriber's NackBackoff (0: the default)
	// OrderByKey: the subscriber keeps order by key, and the handler also records when each
	// handling starts ("start") and when one fails ("failed"), for the order check. A message
	// with metaAckInTx is acked in the transaction that records it ("done"): that row exists
	// exactly when the ack was applied.
	OrderByKey bool
}

// metaAckInTx marks a message that an ordered consumer acks in the transaction that records
// its handling (sqlbroker.PgxTxHandler).
const metaAckInTx = "chaos_ack_in_tx"

// consumerReport is printed by a consumer process: every second (CHAOS-STATS) and at a clean
// exit (CHAOS-FINAL), so that the figures of a process killed with SIGKILL are known up to its
// last second.
type consumerReport struct {
	ID          string
	Stats       sqlbroker.Stats
	Report      sqlbroker.CloseReport
	ShutdownErr string
	RunErr      string // router.Run's error: the consumer could not subscribe
	ConnsLeft   int    // the library's backends still in pg_stat_activity after the shutdown
	LocksLeft   int    // advisory locks those backends hold
	// Read once, at once after the shutdown returned: the library's backends running or
	// waiting on a statement (any state but idle), and the advisory locks they hold.
	ActiveAtOnce int
	LocksAtOnce  int
}

// event is what a consumer process saw happen to a claim, printed as CHAOS-EVENT at once (a
// process killed later keeps what it printed): the history check explains every refused
// settlement and every duplicate with these and with the faults the test injected.
type event struct {
	Proc       string
	Kind       string // evLeaseLost, evLockLost, evLockConn, evRefused, evNotApplied, evShutdown
	Offset     int64
	At         int64 // time.Now().UnixNano() in the process (one clock: the same machine)
	Began      int64 // when the handler of the offset's latest delivery in this process began
	Op         string
	LostBefore bool   // the refusal's log says the claim was lost before the settlement ran
	Closed     bool   // the refusal says the subscriber had shut down (advisory mode)
	Err        string // evLockConn: why the lock connection failed; evLeaseLost: the lease's deadline
}

const (
	evLeaseLost  = "lease-lost"  // "Lease lost": the lease ran out or its extension was refused
	evLockLost   = "lock-lost"   // "Advisory lock lost with its connection"
	evLockConn   = "lockconn"    // "Lock connection failed": every lock it held is gone
	evRefused    = "refused"     // a settlement refused as stale
	evNotApplied = "not-applied" // "Settlement failed and the lease ran out"
	evShutdown   = "shutdown"    // the process was told to stop (SIGTERM)
)

// eventLog prints events; began keeps when the handler of each offset's latest delivery began.
type eventLog struct {
	proc  string
	mu    sync.Mutex
	began map[int64]int64
}

func (l *eventLog) start(offset int64) {
	l.mu.Lock()
	l.began[offset] = time.Now().UnixNano()
	l.mu.Unlock()
}

func (l *eventLog) emit(e event) {
	e.Proc = l.proc
	e.At = time.Now().UnixNano()
	l.mu.Lock()
	defer l.mu.Unlock()
	e.Began = l.began[e.Offset]
	b, _ := json.Marshal(e)
	fmt.Printf("CHAOS-EVENT %s\n", b)
}

// recordingLogger is the library's logger in a consumer: it logs to stderr and turns the lines
// that say a claim was lost, a lock connection failed or a settlement was refused or not applied
// into events, with their offsets.
type recordingLogger struct {
	inner watermill.LoggerAdapter
	log   *eventLog
}

func (r recordingLogger) Error(msg string, err error, fields watermill.LogFields) {
	r.inner.Error(msg, err, fields)
	r.record(msg, err, fields)
}

// record turns a log line into an event, if it is one of those the chaos checks count.
func (r recordingLogger) record(msg string, err error, fields watermill.LogFields) {
	var stale *sqlbroker.StaleSettlementError
	switch {
	case errors.As(err, &stale):
		lost, _ := fields["lease_lost_before"].(bool)
		lockLost, _ := fields["lock_lost_before"].(bool)
		r.log.emit(event{Kind: evRefused, Offset: stale.Offset, Op: stale.Op,
			LostBefore: lost || lockLost || strings.Contains(msg, "lock was lost"), Closed: errors.Is(err, sqlbroker.ErrClosed)})
	case strings.HasPrefix(msg, "Settlement failed and the lease ran out"):
		r.log.emit(event{Kind: evNotApplied, Offset: offsetField(fields)})
	case strings.HasPrefix(msg, "Lock connection failed"):
		r.log.emit(event{Kind: evLockConn, Err: fmt.Sprint(err)})
	}
}

func (r recordingLogger) Info(msg string, fields watermill.LogFields) {
	r.inner.Info(msg, fields)
	if err, ok := fields["err"].(error); ok {
		r.record(msg, err, fields) // refused settlements are logged at Info, their error in "err"
		return
	}
	switch {
	case strings.HasPrefix(msg, "Lease lost"):
		// The deadline the library counted the lease to (and the extension's error, if it
		// failed) go into the event's story: they say whether the lease ran out while the
		// test held a lock, or was last extended before it.
		why := fmt.Sprintf("lease deadline %v", fields["lease_deadline"])
		if e, ok := fields["extension_error"]; ok {
			why += fmt.Sprintf(", extension failed: %v", e)
		}
		r.log.emit(event{Kind: evLeaseLost, Offset: offsetField(fields), Err: why})
	case strings.HasPrefix(msg, "Advisory lock lost"):
		r.log.emit(event{Kind: evLockLost, Offset: offsetField(fields)})
	}
}

func (r recordingLogger) Debug(msg string, fields watermill.LogFields) { r.inner.Debug(msg, fields) }
func (r recordingLogger) Trace(msg string, fields watermill.LogFields) { r.inner.Trace(msg, fields) }
func (r recordingLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return recordingLogger{inner: r.inner.With(fields), log: r.log}
}

func offsetField(fields watermill.LogFields) int64 {
	switch v := fields["offset"].(type) {
	case int64:
		return v
	case int:
		return int64(v)
	}
	return -1
}

func printReport(kind string, r consumerReport) {
	b, _ := json.Marshal(r)
	fmt.Printf("%s %s\n", kind, b)
}

// faultOf picks what the handler does with a message on a given attempt: deterministic by UUID,
// so every process agrees, and every faulty message succeeds on a later attempt.
func faultOf(uuid string, attempt int) string {
	h := fnv.New32a()
	h.Write([]byte(uuid))
	switch v := h.Sum32() % 100; {
	case v < 3 && attempt == 1:
		return "panic"
	case v >= 3 && v < 7 && attempt <= 2:
		return "nack"
	case v >= 7 && v < 9 && attempt == 1:
		return "timeout"
	}
	return ""
}

// runConsumer is the consumer process: a Router with the library's hook, a handler that records
// what it handled, and its figures on stdout. SIGTERM stops it cleanly.
func runConsumer() int {
	var cfg consumerConfig
	if err := json.Unmarshal([]byte(os.Getenv(envConsumer)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "bad consumer config:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	events := &eventLog{proc: cfg.ID, began: map[int64]int64{}}
	logger := recordingLogger{inner: watermill.NewStdLoggerWithOut(os.Stderr, false, false), log: events}
	go func() {
		<-ctx.Done()
		events.emit(event{Kind: evShutdown, Offset: -1})
	}()

	recCfg, err := pgxpool.ParseConfig(cfg.RecordURL)
	if err != nil {
		fmt.Fprintln(os.Stderr, "record URL:", err)
		return 2
	}
	recCfg.MaxConns = 8
	if cfg.RecordConns > 0 {
		recCfg.MaxConns = int32(cfg.RecordConns)
	}
	rec, err := pgxpool.NewWithConfig(context.Background(), recCfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "record pool:", err)
		return 2
	}
	defer rec.Close()
	pid := os.Getpid()
	insert := func(ctx context.Context, db interface {
		Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	}, msg *message.Message, kind string) error {
		attempt, _ := strconv.Atoi(msg.Metadata.Get(sqlbroker.MetadataAttempt))
		off, _ := strconv.ParseInt(msg.Metadata.Get(sqlbroker.MetadataOffset), 10, 64)
		_, err := db.Exec(ctx, "INSERT INTO "+cfg.Results+` (uuid, consumer, pid, attempt, kind, off) VALUES ($1, $2, $3, $4, $5, $6)`,
			msg.UUID, cfg.ID, pid, attempt, kind, off)
		return err
	}
	record := func(msg *message.Message, kind string) error {
		rctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		return insert(rctx, rec, msg, kind)
	}
	// ackInTx records the handling and acks the message in one transaction, as an application
	// that writes its effects and the ack together does: the row is there exactly when the ack
	// was applied. The record pool is on the subscriber's database.
	ackInTx := sqlbroker.PgxTxHandler(rec, func(ctx context.Context, tx pgx.Tx, msg *message.Message) error {
		return insert(ctx, tx, msg, "done")
	})
	done := func(msg *message.Message) error {
		if cfg.OrderByKey && msg.Metadata.Get(metaAckInTx) != "" {
			return ackInTx(msg)
		}
		return record(msg, "done")
	}

	broker, err := sqlbroker.Open(cfg.URL, sqlbroker.BrokerConfig{MaxConns: cfg.MaxConns}, logger)
	if err != nil {
		fmt.Fprintln(os.Stderr, "open:", err)
		return 2
	}
	sub, err := broker.NewSubscriber(sqlbroker.SubscriberConfig{
		ConsumerGroup:      cfg.Group,
		ClaimMode:          sqlbroker.ClaimMode(cfg.Mode),
		MaxInFlight:        cfg.MaxInFlight,
		LeaseTTL:           cfg.LeaseTTL,
		LeaseRenewInterval: cfg.Renew,
		PollInterval:       cfg.Poll,
		RetryInterval:      cfg.Retry,
		NackBackoff:        cfg.NackBackoff,
		OrderByKey:         cfg.OrderByKey,
		CloseTimeout:       5 * time.Second,
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "subscriber:", err)
		return 2
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		fmt.Fprintln(os.Stderr, "router:", err)
		return 2
	}
	hook := sqlbroker.NewRouterHook(broker, sqlbroker.RouterHookConfig{CloseTimeout: 5 * time.Second})
	router.AddPlugin(hook.Plugin)
	// The Router recovers a handler's panic itself and nacks the message. The timeout is
	// middleware.Timeout's, written out: that package pulls in a backoff module the library
	// does not otherwise need.
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			if off, err := strconv.ParseInt(msg.Metadata.Get(sqlbroker.MetadataOffset), 10, 64); err == nil {
				events.start(off)
			}
			tctx, cancel := context.WithTimeout(msg.Context(), cfg.Timeout)
			defer cancel()
			msg.SetContext(tctx)
			if !cfg.OrderByKey {
				return h(msg)
			}
			// The order check needs every handling's span, failed ones included.
			if err := record(msg, "start"); err != nil {
				return nil, err
			}
			failed := true
			defer func() {
				if failed {
					_ = record(msg, "failed") // a panic too: the Router recovers it further out
				}
			}()
			out, err := h(msg)
			failed = err != nil
			return out, err
		}
	})
	router.AddNoPublisherHandler("chaos", cfg.Topic, sub, func(msg *message.Message) error {
		attempt, _ := strconv.Atoi(msg.Metadata.Get(sqlbroker.MetadataAttempt))
		payload := string(msg.Payload)
		if cfg.NoProbes {
			payload = ""
		}
		switch payload {
		case probeHold:
			if attempt == 1 {
				if err := record(msg, "seen"); err != nil {
					return err
				}
				<-ctx.Done() // held until the process is killed or stopped, whatever the handler timeout
				return ctx.Err()
			}
			return record(msg, "done")
		case probePing:
			return record(msg, "done")
		}
		if cfg.Faults {
			switch faultOf(msg.UUID, attempt) {
			case "panic":
				panic("chaos: the handler panics on attempt 1")
			case "nack":
				return errors.New("chaos: the handler fails on attempts 1 and 2")
			case "timeout":
				<-msg.Context().Done()
				return fmt.Errorf("chaos: the handler timed out: %w", context.Cause(msg.Context()))
			}
			time.Sleep(time.Duration(rand.IntN(5)) * time.Millisecond) // some work, so that handlers overlap
		} else if cfg.WorkMax > 0 {
			time.Sleep(rand.N(cfg.WorkMax)) // acks land anywhere between two lease extensions
		}
		if cfg.NackPercent > 0 && rand.IntN(100) < cfg.NackPercent {
			return errors.New("chaos: the handler fails at random")
		}
		return done(msg)
	})

	var wg sync.WaitGroup
	statsDone := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				printReport("CHAOS-STATS", consumerReport{ID: cfg.ID, Stats: sub.Stats()})
			case <-statsDone:
				return
			}
		}
	}()
	go func() {
		select {
		case <-router.Running():
			fmt.Println("CHAOS-READY " + cfg.ID)
		case <-ctx.Done():
		}
	}()
	runErr := router.Run(ctx)
	close(statsDone)
	wg.Wait()

	out := consumerReport{ID: cfg.ID, Stats: sub.Stats()}
	rep, herr := hook.Report()
	if errors.Is(herr, sqlbroker.ErrNotShutDown) {
		// Run failed before the handler ran (Subscribe failed: a connection terminated while
		// it checked the tables), so the hook had nothing to drain and never shut the broker
		// down: the application does it.
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		rep, herr = broker.Shutdown(sctx)
		cancel()
	}
	out.Report = rep
	if herr != nil {
		out.ShutdownErr = herr.Error()
	}
	if runErr != nil {
		out.RunErr = runErr.Error()
	}
	if strings.HasPrefix(cfg.URL, "sqlite:") {
		// A SQLite database has no server to ask what the shutdown left.
		printReport("CHAOS-FINAL", out)
		if runErr != nil {
			return exitRunFailed
		}
		return 0
	}
	// What the shutdown left: the server ends a closed connection's backend a moment later.
	app := appName(cfg.URL)
	qctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := rec.QueryRow(qctx, `SELECT count(*) FILTER (WHERE state IS DISTINCT FROM 'idle'), (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
			WHERE l.locktype = 'advisory' AND a.application_name = $1)
			FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&out.ActiveAtOnce, &out.LocksAtOnce); err != nil {
		out.ShutdownErr += "; counting what was left: " + err.Error()
	}
	for {
		err := rec.QueryRow(qctx, `SELECT count(*), (SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
			WHERE l.locktype = 'advisory' AND a.application_name = $1)
			FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&out.ConnsLeft, &out.LocksLeft)
		if err != nil {
			out.ShutdownErr += "; counting what was left: " + err.Error()
			break
		}
		if out.ConnsLeft == 0 && out.LocksLeft == 0 || qctx.Err() != nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	printReport("CHAOS-FINAL", out)
	if runErr != nil {
		return exitRunFailed
	}
	return 0
}

// exitRunFailed is the exit code of a consumer whose Router could not run (a supervisor
// restarts it).
const exitRunFailed = 3

// appName is the application_name of a URL.
func appName(u string) string {
	_, q, _ := strings.Cut(u, "?")
	for _, kv := range strings.Split(q, "&") {
		if v, ok := strings.CutPrefix(kv, "application_name="); ok {
			return v
		}
	}
	return ""
}
