package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// Scenario 11, hold: messages offered at a steady rate to one topic, consumed by one or more
// consumer groups of two subscribers each with Retention set, while a reading transaction
// opened on a connection of its own holds the xmin horizon back for a while, so that vacuum
// removes no dead row of any table. Each second it prints the rates, the lag and, for the
// topic's three tables, the index entries read per index scan in that second and the dead
// rows; at the end a summary of the hold.
//
// On MySQL the reader is a REPEATABLE READ transaction begun WITH CONSISTENT SNAPSHOT, whose
// read view keeps InnoDB's purge from removing any row version written after it (the history
// list grows). InnoDB keeps no count per table of the records a scan steps over, so each
// second shows instead the rows InnoDB read, the whole server's, per message handled (the
// library does not count its claim statements), and the history list length.

const (
	holdPublishers = 8   // goroutines publishing the paced batches
	holdMaxBatch   = 100 // messages per Publish call at most
	holdSubs       = 2   // Subscriber objects per consumer group
	holdWindow     = 5   // samples (seconds) in a window of the summary
)

// The topic's tables, in the order of a sample's stats.
const (
	holdClaims = iota
	holdMessages
	holdGroups
	holdTables
)

var holdTableNames = [holdTables]string{"claims", "messages", "groups"}

// tableStat is what pg_stat_user_indexes and pg_stat_user_tables say of one table: index
// entries read and index scans, summed over its indexes since the table was created, and its
// dead rows now.
type tableStat struct {
	read, scans, dead int64
}

// innodbStat is what a sample reads of InnoDB on MySQL: the rows read so far, the whole
// server's, and the history list length now.
type innodbStat struct {
	rowsRead, history int64
}

type holdSample struct {
	at        time.Duration // since the start
	published int64
	due       int64 // what the pacer should have published by now
	handled   []int64
	stats     [holdTables]tableStat // PostgreSQL
	innodb    innodbStat            // MySQL
	inHold    bool                  // the span since the previous sample lay wholly inside the hold
}

// entriesPerScan is the index entries read per index scan of table k between two samples,
// or -1 when no scan ran (or a partition dropped in between took its counts with it).
func entriesPerScan(from, to holdSample, k int) float64 {
	scans := to.stats[k].scans - from.stats[k].scans
	if scans <= 0 || to.stats[k].read < from.stats[k].read {
		return -1
	}
	return float64(to.stats[k].read-from.stats[k].read) / float64(scans)
}

// rowsPerHandled is the rows InnoDB read between two samples per message handled by the
// groups in that time, or -1 when none was handled.
func rowsPerHandled(from, to holdSample) float64 {
	var n int64
	for g := range to.handled {
		n += to.handled[g] - from.handled[g]
	}
	if n <= 0 {
		return -1
	}
	return float64(to.innodb.rowsRead-from.innodb.rowsRead) / float64(n)
}

func formatPerScan(v float64) string {
	if v < 0 {
		return "-"
	}
	return formatValue(v)
}

// lag is the most any group is behind what was published, and that group.
func (s holdSample) lag() (int64, int) {
	var most int64
	group := 0
	for g, h := range s.handled {
		if l := s.published - h; g == 0 || l > most {
			most, group = l, g
		}
	}
	return most, group
}

// holdStats reads the index and dead-row counts of the topic's tables.
func (b *bench) holdStats(ctx context.Context, t offsets.Tables) ([holdTables]tableStat, error) {
	var out [holdTables]tableStat
	// The messages table's figures are its partitions', summed: a partitioned table has no
	// storage of its own.
	rows, err := b.admin.Query(ctx, `SELECT r.k,
		coalesce((SELECT sum(s.n_dead_tup) FROM `+fmt.Sprintf(treeSQL, "r.id")+` JOIN pg_stat_user_tables s ON s.relid = p.relid), 0)::bigint,
		coalesce((SELECT sum(i.idx_tup_read) FROM `+fmt.Sprintf(treeSQL, "r.id")+` JOIN pg_stat_user_indexes i ON i.relid = p.relid), 0)::bigint,
		coalesce((SELECT sum(i.idx_scan) FROM `+fmt.Sprintf(treeSQL, "r.id")+` JOIN pg_stat_user_indexes i ON i.relid = p.relid), 0)::bigint
		FROM (VALUES (0, to_regclass($1)), (1, to_regclass($2)), (2, to_regclass($3))) AS r(k, id)`, t.Claims, t.Messages, t.Groups)
	if err != nil {
		return out, fmt.Errorf("read pg_stat_user_indexes: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var k int
		var st tableStat
		if err := rows.Scan(&k, &st.dead, &st.read, &st.scans); err != nil {
			return out, fmt.Errorf("read pg_stat_user_indexes: %w", err)
		}
		out[k] = st
	}
	return out, rows.Err()
}

// holdSizes is pg_total_relation_size (table, indexes and TOAST) of each of the topic's
// tables, the messages table's summed over its partitions.
func (b *bench) holdSizes(ctx context.Context, t offsets.Tables) ([holdTables]int64, error) {
	var out [holdTables]int64
	err := b.admin.QueryRow(ctx, `SELECT `+totalSizeSQL(1)+`, `+totalSizeSQL(2)+`, `+totalSizeSQL(3),
		t.Claims, t.Messages, t.Groups).Scan(&out[0], &out[1], &out[2])
	if err != nil {
		return out, fmt.Errorf("read pg_total_relation_size: %w", err)
	}
	return out, nil
}

// treeSQL lists as p(relid) the table %s (a regclass) and its partitions, if any.
const treeSQL = `(SELECT %[1]s::oid UNION SELECT t.relid::oid FROM pg_partition_tree(%[1]s) t) p(relid)`

// totalSizeSQL is the size of the table named by parameter $n with its partitions, if any.
func totalSizeSQL(n int) string {
	return fmt.Sprintf(`(SELECT coalesce(sum(pg_total_relation_size(p.relid)), 0)::bigint FROM `+treeSQL+`)`, fmt.Sprintf("to_regclass($%d)", n))
}

func formatSizes(s [holdTables]int64) string {
	var parts []string
	var total int64
	for k, v := range s {
		parts = append(parts, fmt.Sprintf("%s %.1f MiB", holdTableNames[k], mib(uint64(v))))
		total += v
	}
	return fmt.Sprintf("%s; total %.1f MiB", strings.Join(parts, ", "), mib(uint64(total)))
}

// snapshotHolder is the reader's open transaction: a holdReader on PostgreSQL, a
// mysqlHoldReader on MySQL.
type snapshotHolder interface {
	end() error     // commits the transaction and closes its connection
	String() string // its connection and snapshot, for the line that announces it
}

func (b *bench) openSnapshotHolder(ctx context.Context, c contender, messages string) (snapshotHolder, error) {
	if c.onMySQL() {
		r, err := openMySQLHoldReader(ctx, b.cfg.mysqlDSN, messages)
		if err != nil {
			return nil, err
		}
		return r, nil
	}
	r, err := b.openHoldReader(ctx, messages)
	if err != nil {
		return nil, err
	}
	return r, nil
}

// holdReader is a REPEATABLE READ transaction on a connection of its own that has taken its
// snapshot: while it is open, vacuum removes no row version that died after that snapshot.
type holdReader struct {
	conn *pgx.Conn
	pid  uint32
	xmin string
}

// openHoldReader begins the transaction, reads one row of the messages table to take the
// snapshot, and checks in pg_stat_activity that the backend now holds an xmin.
func (b *bench) openHoldReader(ctx context.Context, messages string) (*holdReader, error) {
	cc, err := pgx.ParseConfig(b.cfg.url)
	if err != nil {
		return nil, fmt.Errorf("-url: %w", err)
	}
	cc.RuntimeParams["application_name"] = "sqlbroker-bench-hold"
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, fmt.Errorf("reader: connect: %w", err)
	}
	r := &holdReader{conn: conn, pid: conn.PgConn().PID()}
	for _, q := range []string{"BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT 1 FROM " + messages + " LIMIT 1"} {
		if _, err := conn.Exec(ctx, q); err != nil {
			_ = conn.Close(context.Background())
			return nil, fmt.Errorf("reader: %s: %w", q, err)
		}
	}
	var xmin *string
	if err := b.admin.QueryRow(ctx, `SELECT backend_xmin::text FROM pg_stat_activity WHERE pid = $1`, int64(r.pid)).Scan(&xmin); err != nil {
		_ = conn.Close(context.Background())
		return nil, fmt.Errorf("reader: read its backend_xmin: %w", err)
	}
	if xmin == nil {
		_ = conn.Close(context.Background())
		return nil, fmt.Errorf("reader (pid %d): backend_xmin is null in pg_stat_activity: its transaction holds no snapshot", r.pid)
	}
	r.xmin = *xmin
	return r, nil
}

// end commits the reader's transaction and closes its connection.
func (r *holdReader) end() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := r.conn.Exec(ctx, "COMMIT")
	return errors.Join(err, r.conn.Close(ctx))
}

func (r *holdReader) String() string { return fmt.Sprintf("pid %d, backend_xmin %s", r.pid, r.xmin) }

// mysqlHoldReader is the reader on MySQL: a REPEATABLE READ transaction begun WITH
// CONSISTENT SNAPSHOT on a connection of its own, whose read view keeps InnoDB's purge from
// removing any row version written after it was opened.
type mysqlHoldReader struct {
	db      *sql.DB
	conn    *sql.Conn
	id      int64  // CONNECTION_ID()
	started string // trx_started in INNODB_TRX (its trx_id is 0 on MariaDB while it writes nothing)
}

// openMySQLHoldReader begins the transaction, reads one row of the messages table so that the
// read view is surely open, and checks in INNODB_TRX that InnoDB holds the transaction at
// REPEATABLE READ.
func openMySQLHoldReader(ctx context.Context, dsn, messages string) (*mysqlHoldReader, error) {
	db, err := sql.Open("mysql", dsn)
	if err != nil {
		return nil, fmt.Errorf("-mysql-dsn: %w", err)
	}
	db.SetMaxOpenConns(1)
	conn, err := db.Conn(ctx)
	if err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("reader: connect: %w", err)
	}
	r := &mysqlHoldReader{db: db, conn: conn}
	fail := func(err error) (*mysqlHoldReader, error) {
		_ = conn.Close()
		_ = db.Close()
		return nil, err
	}
	// The session's level is set, whatever the server's default: at READ COMMITTED the
	// snapshot would last one statement (and WITH CONSISTENT SNAPSHOT is ignored).
	for _, q := range []string{"SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ",
		"START TRANSACTION WITH CONSISTENT SNAPSHOT", "SELECT 1 FROM " + messages + " LIMIT 1"} {
		if _, err := conn.ExecContext(ctx, q); err != nil {
			return fail(fmt.Errorf("reader: %s: %w", q, err))
		}
	}
	var level string
	err = conn.QueryRowContext(ctx, "SELECT CONNECTION_ID(), trx_started, trx_isolation_level FROM information_schema.INNODB_TRX "+
		"WHERE trx_mysql_thread_id = CONNECTION_ID()").Scan(&r.id, &r.started, &level)
	if errors.Is(err, sql.ErrNoRows) {
		return fail(errors.New("reader: its transaction is not in information_schema.INNODB_TRX: it holds no read view"))
	}
	if err != nil {
		return fail(fmt.Errorf("reader: read its transaction in INNODB_TRX: %w", err))
	}
	if level != "REPEATABLE READ" {
		return fail(fmt.Errorf("reader (connection %d): its transaction runs at %s, not REPEATABLE READ", r.id, level))
	}
	return r, nil
}

func (r *mysqlHoldReader) end() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := r.conn.ExecContext(ctx, "COMMIT")
	return errors.Join(err, r.conn.Close(), r.db.Close())
}

func (r *mysqlHoldReader) String() string {
	return fmt.Sprintf("connection %d, in INNODB_TRX since %s", r.id, r.started)
}

// rowsReadCounter names the global status counter of the rows InnoDB has read:
// Innodb_rows_read, or on a MariaDB that dropped it (MDEV-28539) Rows_read, the server's count
// of rows read from its tables, which are all InnoDB's here.
func rowsReadCounter(ctx context.Context, db *sql.DB) (string, error) {
	rows, err := db.QueryContext(ctx, "SHOW GLOBAL STATUS WHERE Variable_name IN ('Innodb_rows_read', 'Rows_read')")
	if err != nil {
		return "", fmt.Errorf("read the rows read counter: %w", err)
	}
	defer rows.Close()
	found := map[string]bool{}
	for rows.Next() {
		var name, value string
		if err := rows.Scan(&name, &value); err != nil {
			return "", fmt.Errorf("read the rows read counter: %w", err)
		}
		found[name] = true
	}
	if err := rows.Err(); err != nil {
		return "", fmt.Errorf("read the rows read counter: %w", err)
	}
	for _, name := range []string{"Innodb_rows_read", "Rows_read"} {
		if found[name] {
			return name, nil
		}
	}
	return "", errors.New("the server has neither Innodb_rows_read nor Rows_read in SHOW GLOBAL STATUS")
}

// readInnoDB reads the rows read so far (counter, from rowsReadCounter) and the history list
// length.
func readInnoDB(ctx context.Context, db *sql.DB, counter string) (innodbStat, error) {
	var st innodbStat
	var name string
	if err := db.QueryRowContext(ctx, "SHOW GLOBAL STATUS LIKE '"+counter+"'").Scan(&name, &st.rowsRead); err != nil {
		return st, fmt.Errorf("read %s: %w", counter, err)
	}
	if err := db.QueryRowContext(ctx, "SELECT count FROM information_schema.INNODB_METRICS WHERE name = 'trx_rseg_history_len'").Scan(&st.history); err != nil {
		return st, fmt.Errorf("read trx_rseg_history_len: %w", err)
	}
	return st, nil
}

// holdSpan is when the reader held the horizon, since the start of the run.
type holdSpan struct {
	mu             sync.Mutex
	opened, closed bool
	from, to       time.Duration
	reader         string // its connection and snapshot
	err            error
}

func (h *holdSpan) get() (opened, closed bool, from, to time.Duration, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.opened, h.closed, h.from, h.to, h.err
}

// covers reports whether the span (a, b] lay wholly inside the hold.
func (h *holdSpan) covers(a, b time.Duration) bool {
	opened, closed, from, to, _ := h.get()
	return opened && from <= a && (!closed || b <= to)
}

// pacer publishes at a fixed rate: every 10 ms it queues what is due by then for
// holdPublishers goroutines, in batches of rate/100 messages (at most holdMaxBatch). When they
// cannot keep up, what is due waits and goes in larger batches (up to holdMaxBatch) as soon as
// a publisher is free, and the pacer records how far behind it fell.
type pacer struct {
	published atomic.Int64
	due       atomic.Int64
	keyed     atomic.Int64 // messages given a key
	maxBehind atomic.Int64
	batch     int
	mu        sync.Mutex
	err       error
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

// startPacer publishes rate messages a second to topic; with keys > 0, message n has the
// order key n mod keys.
func startPacer(ctx context.Context, pub message.Publisher, topic string, rate int, payload []byte, keys int) *pacer {
	ctx, cancel := context.WithCancel(ctx)
	p := &pacer{batch: min(max(rate/100, 1), holdMaxBatch), cancel: cancel}
	jobs := make(chan int, holdPublishers)
	for range holdPublishers {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			for n := range jobs {
				msgs := make([]*message.Message, n)
				for i := range msgs {
					msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
					if keys > 0 {
						msgs[i].Metadata.Set(sqlbroker.MetadataOrderKey, strconv.Itoa(int(p.keyed.Add(1))%keys))
					}
				}
				if err := pub.Publish(topic, msgs...); err != nil {
					p.mu.Lock()
					if p.err == nil {
						p.err = fmt.Errorf("publish: %w", err)
					}
					p.mu.Unlock()
					continue
				}
				p.published.Add(int64(n))
			}
		}()
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer close(jobs)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		start := time.Now()
		var queued int64
		for {
			select {
			case <-tick.C:
			case <-ctx.Done():
				return
			}
			due := int64(time.Since(start).Seconds() * float64(rate))
			p.due.Store(due)
		fill:
			for due-queued >= int64(p.batch) {
				n := int(min(due-queued, holdMaxBatch))
				select {
				case jobs <- n:
					queued += int64(n)
				default:
					break fill // every publisher is busy: the rest waits for the next tick
				}
			}
			if behind := due - p.published.Load(); behind > p.maxBehind.Load() {
				p.maxBehind.Store(behind)
			}
		}
	}()
	return p
}

func (p *pacer) failed() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// stop ends the pacing and waits for the publishes in flight.
func (p *pacer) stop() {
	p.cancel()
	p.wg.Wait()
}

// Scenario 11: the hold.
func scenarioHold(ctx context.Context, b *bench, c contender) error {
	if c.isWatermillSQL() {
		return fmt.Errorf("%w: watermill-sql hands out one message of a group at a time, far below the offered rate", errNA)
	}
	if c.onSQLite() {
		return fmt.Errorf("%w: SQLite has no snapshot that holds vacuum back", errNA)
	}
	cfg := b.cfg
	e, topic, err := b.prepare(ctx, c, "hold", 0)
	if err != nil {
		return err
	}
	defer e.close()
	defer b.dropTopic(c, topic)
	tables := e.tables(topic)
	// readServer fills a sample's figures of the server: PostgreSQL's statistics of the topic's
	// tables, or InnoDB's counters on MySQL.
	readServer := func(s *holdSample) (err error) {
		s.stats, err = b.holdStats(ctx, tables)
		return err
	}
	var rowsCounter string
	if c.onMySQL() {
		// MySQL counts the history list length by default; a MariaDB may not.
		if _, err := e.std.ExecContext(ctx, "SET GLOBAL innodb_monitor_enable = 'trx_rseg_history_len'"); err != nil {
			return fmt.Errorf("enable InnoDB's counter trx_rseg_history_len (SET GLOBAL needs SUPER or SYSTEM_VARIABLES_ADMIN): %w", err)
		}
		if rowsCounter, err = rowsReadCounter(ctx, e.std); err != nil {
			return err
		}
		readServer = func(s *holdSample) (err error) {
			s.innodb, err = readInnoDB(ctx, e.std, rowsCounter)
			return err
		}
	}
	pub, err := e.publisher()
	if err != nil {
		return err
	}
	defer pub.Close()

	groups := cfg.holdGroups
	handled := make([]atomic.Int64, groups)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 15 * time.Second}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	var subs []message.Subscriber
	defer func() {
		for _, s := range subs {
			_ = s.Close()
		}
	}()
	for g := range groups {
		for i := range holdSubs {
			s, err := e.poolSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: fmt.Sprintf("hold%d", g), Retention: cfg.holdRetention, OrderByKey: cfg.holdKeys > 0})
			if err != nil {
				return err
			}
			subs = append(subs, s)
			router.AddConsumerHandler(fmt.Sprintf("g%d-s%d", g, i), topic, s, func(*message.Message) error {
				handled[g].Add(1)
				return nil
			})
		}
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(runCtx) }()
	defer func() {
		_ = router.Close()
		select {
		case <-runErr:
		case <-time.After(30 * time.Second):
			b.logf("hold, %s: router did not stop within 30s of Close", c)
		}
	}()
	select {
	case <-router.Running():
	case err := <-runErr:
		runErr <- err
		return fmt.Errorf("router stopped before running: %v", err)
	case <-time.After(30 * time.Second):
		return errors.New("router did not start within 30s")
	}

	if c.onMySQL() {
		fmt.Printf("## Scenario 11, hold: %s, %d consumer group(s) of %d subscribers, %d msg/s offered for %s, Retention %s; "+
			"a REPEATABLE READ reader (WITH CONSISTENT SNAPSHOT) holds InnoDB's purge back from %s for %s\n\n",
			c, groups, holdSubs, cfg.holdRate, cfg.holdDuration, cfg.holdRetention, cfg.holdAt, cfg.holdFor)
		fmt.Printf("Rates per second; handled: one column per group; lag = published - handled, of the group furthest behind. "+
			"rows/msg: the rows InnoDB read in that second (%s, the whole server's) per message handled (- = none handled); "+
			"history: InnoDB's history list length (trx_rseg_history_len), the committed transactions whose undo logs purge has not yet removed.\n\n", rowsCounter)
		fmt.Printf("%5s %-6s %8s %-*s %8s | %8s %9s\n", "t", "phase", "offered", 8*groups+groups-1, "handled", "lag", "rows/msg", "history")
	} else {
		fmt.Printf("## Scenario 11, hold: %s, %d consumer group(s) of %d subscribers, %d msg/s offered for %s, Retention %s; "+
			"a REPEATABLE READ reader holds the xmin horizon from %s for %s\n\n",
			c, groups, holdSubs, cfg.holdRate, cfg.holdDuration, cfg.holdRetention, cfg.holdAt, cfg.holdFor)
		fmt.Printf("Rates per second; handled: one column per group; lag = published - handled, of the group furthest behind. " +
			"Per table: index entries read per index scan in that second (pg_stat_user_indexes, summed over the table's indexes; - = no scan) " +
			"and dead rows (n_dead_tup). Backends report these counts about once a second, so a second's figures may include the one before.\n\n")
		fmt.Printf("%5s %-6s %8s %-*s %8s | %8s %9s | %8s %9s | %8s %9s\n", "t", "phase", "offered", 8*groups+groups-1, "handled", "lag",
			"claims", "dead", "messages", "dead", "groups", "dead")
	}

	s0 := holdSample{handled: make([]int64, groups)}
	if err := readServer(&s0); err != nil {
		return err
	}
	start := time.Now()
	p := startPacer(runCtx, pub, topic, cfg.holdRate, b.payload, cfg.holdKeys)
	stopped := false
	stopPacer := func() {
		if !stopped {
			stopped = true
			p.stop()
		}
	}
	defer stopPacer()

	// The reader: opened at -hold-at, committed -hold-for later.
	span := &holdSpan{}
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		select {
		case <-time.After(cfg.holdAt - time.Since(start)):
		case <-runCtx.Done():
			return
		}
		r, err := b.openSnapshotHolder(runCtx, c, tables.Messages)
		span.mu.Lock()
		if err != nil {
			span.err = err
			span.mu.Unlock()
			return
		}
		span.opened, span.from, span.reader = true, time.Since(start), r.String()
		span.mu.Unlock()
		select {
		case <-time.After(cfg.holdFor):
		case <-runCtx.Done():
		}
		err = r.end()
		span.mu.Lock()
		span.closed, span.to = true, time.Since(start)
		if err != nil {
			span.err = fmt.Errorf("reader: commit: %w", err)
		}
		span.mu.Unlock()
	}()
	defer func() {
		cancel()
		<-readerDone
	}()

	samples := []holdSample{s0}
	var sizesAtStart, sizesAtEnd [holdTables]int64
	var haveStartSizes, haveEndSizes, announced bool
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case err := <-runErr:
			runErr <- err
			return fmt.Errorf("router stopped early: %v", err)
		case <-ctx.Done():
			return context.Cause(ctx)
		}
		s := holdSample{at: time.Since(start), published: p.published.Load(), due: p.due.Load(), handled: make([]int64, groups)}
		for g := range handled {
			s.handled[g] = handled[g].Load()
		}
		if err := readServer(&s); err != nil {
			return err
		}
		prev := samples[len(samples)-1]
		s.inHold = span.covers(prev.at, s.at)
		samples = append(samples, s)
		opened, closed, _, _, rerr := span.get()
		if rerr != nil {
			return rerr
		}
		if perr := p.failed(); perr != nil {
			return perr
		}
		if opened && !announced {
			announced = true
			span.mu.Lock()
			fmt.Printf("      reader opened at %s: %s\n", span.from.Round(time.Millisecond), span.reader)
			span.mu.Unlock()
		}
		// MySQL's sizes of the tables are estimates, refreshed when InnoDB recomputes its
		// statistics: not read.
		if c.onPostgres() && opened && !haveStartSizes {
			if sizesAtStart, err = b.holdSizes(ctx, tables); err != nil {
				return err
			}
			haveStartSizes = true
		}
		if c.onPostgres() && closed && !haveEndSizes {
			if sizesAtEnd, err = b.holdSizes(ctx, tables); err != nil {
				return err
			}
			haveEndSizes = true
		}
		printHoldLine(c, prev, s, span, cfg.holdRate)
		if s.at >= cfg.holdDuration-100*time.Millisecond {
			break
		}
	}
	stopPacer()
	var sizesFinal [holdTables]int64
	if c.onPostgres() {
		if sizesFinal, err = b.holdSizes(ctx, tables); err != nil {
			return err
		}
	}
	_, _, from, to, _ := span.get()
	sum := summarizeHold(samples, p, cfg.holdRate)
	sum.print(c, from, to, sizesAtStart, sizesAtEnd, sizesFinal, haveStartSizes, haveEndSizes)

	if sum.minWindow >= 0 {
		b.results.set("11a", c, 100*sum.minWindow)
	}
	b.results.set("11b", c, float64(sum.maxLag))
	if c.onMySQL() {
		for _, id := range []string{"11c", "11d", "11e"} {
			b.results.setText(id, c, "n/a")
		}
		if v := sum.rowsPerMsg[2]; v >= 0 {
			b.results.set("11f", c, v)
		}
		if sum.holdSeconds > 0 {
			b.results.set("11g", c, float64(sum.history[1]))
		}
	} else {
		if v := sum.perScan[holdClaims][2]; v >= 0 {
			b.results.set("11c", c, v)
		}
		if v := sum.perScan[holdMessages][2]; v >= 0 {
			b.results.set("11d", c, v)
		}
		if haveEndSizes {
			var total int64
			for _, v := range sizesAtEnd {
				total += v
			}
			b.results.set("11e", c, mib(uint64(total)))
		}
	}
	if sum.behind() {
		b.results.note(fmt.Sprintf("%s, scenario 11: the publishers could not keep up with %d msg/s: %d of %d due published, at most %d behind",
			c, cfg.holdRate, sum.published, sum.due, sum.maxBehind))
	}
	if sum.minWindow < 0 {
		b.results.note(fmt.Sprintf("%s, scenario 11: the hold covered fewer than %d whole seconds; row 11a has no window", c, holdWindow))
	}
	return nil
}

func printHoldLine(c contender, prev, s holdSample, span *holdSpan, rate int) {
	dt := (s.at - prev.at).Seconds()
	opened, closed, _, to, _ := span.get()
	phase := "before"
	switch {
	case s.inHold:
		phase = "hold"
	case opened && !closed:
		phase = "start" // the reader opened during this second
	case closed && prev.at < to:
		phase = "end" // the reader committed during this second
	case closed:
		phase = "after"
	}
	var hs []string
	for g := range s.handled {
		hs = append(hs, fmt.Sprintf("%8.0f", float64(s.handled[g]-prev.handled[g])/dt))
	}
	lag, _ := s.lag()
	var cols []string
	if c.onMySQL() {
		cols = append(cols, fmt.Sprintf("%8s %9d", formatPerScan(rowsPerHandled(prev, s)), s.innodb.history))
	} else {
		for k := range holdTables {
			cols = append(cols, fmt.Sprintf("%8s %9d", formatPerScan(entriesPerScan(prev, s, k)), s.stats[k].dead))
		}
	}
	line := fmt.Sprintf("%4.0fs %-6s %8.0f %s %8d | %s", s.at.Seconds(), phase, float64(s.published-prev.published)/dt,
		strings.Join(hs, " "), lag, strings.Join(cols, " | "))
	if behind := s.due - s.published; behind > int64(rate/2) {
		line += fmt.Sprintf("  (publishers %d behind)", behind)
	}
	fmt.Println(line)
}

// holdSummary is what the summary block prints.
type holdSummary struct {
	holdSeconds                int
	minSecond                  float64 // lowest handled/offered of a group over one second of the hold; -1 if none
	minSecondRate              float64 // that second's handled rate
	minSecondAt                time.Duration
	minSecondGroup             int
	minWindow                  float64 // lowest handled/offered of a group over holdWindow seconds of the hold; -1 if none
	minWindowAt                time.Duration
	minWindowGroup             int
	maxLag                     int64
	maxLagAt                   time.Duration
	maxLagGroup                int
	perScan                    [holdTables][3]float64 // before the hold, its first and its last holdWindow seconds
	deadAtEnd                  [holdTables]int64
	rowsPerMsg                 [3]float64 // MySQL: InnoDB's rows read per message handled, over the windows of perScan
	history                    [3]int64   // MySQL: the history list length at the hold's start, at its end and at the run's end
	afterRate                  float64    // lowest group's mean handled rate after the hold; -1 if none
	afterSeconds               int
	finalLag                   int64
	published, due, maxBehind  int64
	rate                       int
	offeredDuring, handledMean float64 // during the hold: mean offered, lowest group's mean handled
}

func (s *holdSummary) behind() bool {
	return s.maxBehind > int64(s.rate) || s.published < s.due*99/100
}

func summarizeHold(samples []holdSample, p *pacer, rate int) *holdSummary {
	s := &holdSummary{minSecond: -1, minWindow: -1, afterRate: -1, rate: rate,
		published: p.published.Load(), due: p.due.Load(), maxBehind: p.maxBehind.Load(),
		rowsPerMsg: [3]float64{-1, -1, -1}}
	for k := range holdTables {
		s.perScan[k] = [3]float64{-1, -1, -1}
	}
	first, last := -1, -1 // samples that end the first and the last second of the hold
	for i := 1; i < len(samples); i++ {
		cur, prev := samples[i], samples[i-1]
		if lag, g := cur.lag(); lag > s.maxLag || i == 1 {
			s.maxLag, s.maxLagAt, s.maxLagGroup = lag, cur.at, g
		}
		if !cur.inHold {
			continue
		}
		if first < 0 {
			first = i
		}
		last = i
		s.holdSeconds++
		offered := cur.published - prev.published
		for g := range cur.handled {
			if offered <= 0 {
				break
			}
			r := float64(cur.handled[g]-prev.handled[g]) / float64(offered)
			if s.minSecond < 0 || r < s.minSecond {
				s.minSecond, s.minSecondAt, s.minSecondGroup = r, cur.at, g
				s.minSecondRate = float64(cur.handled[g]-prev.handled[g]) / (cur.at - prev.at).Seconds()
			}
		}
		if i >= holdWindow {
			w := samples[i-holdWindow]
			whole := true
			for j := i - holdWindow + 1; j <= i; j++ {
				whole = whole && samples[j].inHold
			}
			if offered := cur.published - w.published; whole && offered > 0 {
				for g := range cur.handled {
					r := float64(cur.handled[g]-w.handled[g]) / float64(offered)
					if s.minWindow < 0 || r < s.minWindow {
						s.minWindow, s.minWindowAt, s.minWindowGroup = r, cur.at, g
					}
				}
			}
		}
	}
	if first < 0 {
		return s
	}
	span := func(a, b int) (holdSample, holdSample) {
		return samples[max(a, 0)], samples[min(b, len(samples)-1)]
	}
	for k := range holdTables {
		if first-1 > 0 {
			a, b := span(first-1-holdWindow, first-1)
			s.perScan[k][0] = entriesPerScan(a, b, k)
		}
		a, b := span(first-1, first-1+holdWindow)
		s.perScan[k][1] = entriesPerScan(a, b, k)
		a, b = span(last-holdWindow, last)
		s.perScan[k][2] = entriesPerScan(a, b, k)
		s.deadAtEnd[k] = samples[last].stats[k].dead
	}
	if first-1 > 0 {
		s.rowsPerMsg[0] = rowsPerHandled(span(first-1-holdWindow, first-1))
	}
	s.rowsPerMsg[1] = rowsPerHandled(span(first-1, first-1+holdWindow))
	s.rowsPerMsg[2] = rowsPerHandled(span(last-holdWindow, last))
	s.history = [3]int64{samples[first-1].innodb.history, samples[last].innodb.history, samples[len(samples)-1].innodb.history}
	a, b := samples[first-1], samples[last]
	secs := (b.at - a.at).Seconds()
	s.offeredDuring = float64(b.published-a.published) / secs
	s.handledMean = -1
	for g := range b.handled {
		if r := float64(b.handled[g]-a.handled[g]) / secs; s.handledMean < 0 || r < s.handledMean {
			s.handledMean = r
		}
	}
	end := samples[len(samples)-1]
	s.finalLag, _ = end.lag()
	// After the hold: from the first sample after it, to the end.
	for i := last + 1; i < len(samples); i++ {
		if samples[i].inHold {
			continue
		}
		a := samples[i]
		if a.at >= end.at {
			break
		}
		s.afterSeconds = int((end.at - a.at).Seconds() + 0.5)
		for g := range end.handled {
			if r := float64(end.handled[g]-a.handled[g]) / (end.at - a.at).Seconds(); s.afterRate < 0 || r < s.afterRate {
				s.afterRate = r
			}
		}
		break
	}
	return s
}

func pct(v float64) string {
	if v < 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*v)
}

func (s *holdSummary) print(c contender, from, to time.Duration, atStart, atEnd, final [holdTables]int64, haveStart, haveEnd bool) {
	fmt.Printf("\nSummary, hold, %s:\n", c)
	fmt.Printf("- publishers: %d of %d due published (%.1f%%), at most %d behind", s.published, s.due, 100*float64(s.published)/float64(max(s.due, 1)), s.maxBehind)
	if s.behind() {
		fmt.Printf(": COULD NOT KEEP UP with %d msg/s", s.rate)
	}
	fmt.Println()
	if s.holdSeconds == 0 {
		fmt.Printf("- the hold covered no whole second\n")
	} else {
		fmt.Printf("- the hold: %s to %s, %d whole seconds; offered %.0f msg/s, handled %.0f msg/s (the slowest group's mean)\n",
			from.Round(time.Millisecond), to.Round(time.Millisecond), s.holdSeconds, s.offeredDuring, s.handledMean)
		fmt.Printf("- min handled during the hold, as %% of offered: %s over %d s windows (group %d, window ending at %.0fs); %s over one second (group %d at %.0fs: %.0f msg/s)\n",
			pct(s.minWindow), holdWindow, s.minWindowGroup, s.minWindowAt.Seconds(), pct(s.minSecond), s.minSecondGroup, s.minSecondAt.Seconds(), s.minSecondRate)
	}
	fmt.Printf("- max lag: %d (group %d at %.0fs); at the end: %d\n", s.maxLag, s.maxLagGroup, s.maxLagAt.Seconds(), s.finalLag)
	switch {
	case s.holdSeconds == 0:
	case c.onMySQL():
		fmt.Printf("- InnoDB's rows read per message handled, %d s before the hold / its first %d s / its last %d s: %s / %s / %s\n",
			holdWindow, holdWindow, holdWindow, formatPerScan(s.rowsPerMsg[0]), formatPerScan(s.rowsPerMsg[1]), formatPerScan(s.rowsPerMsg[2]))
		fmt.Printf("- InnoDB's history list length: %d at the hold's start, %d at its end, %d at the run's end\n", s.history[0], s.history[1], s.history[2])
	default:
		fmt.Printf("- index entries read per index scan, %d s before the hold / its first %d s / its last %d s; dead rows at its end:\n", holdWindow, holdWindow, holdWindow)
		for k := range holdTables {
			fmt.Printf("  - %-8s %8s / %8s / %8s; %d dead\n", holdTableNames[k], formatPerScan(s.perScan[k][0]),
				formatPerScan(s.perScan[k][1]), formatPerScan(s.perScan[k][2]), s.deadAtEnd[k])
		}
	}
	if s.afterRate >= 0 {
		fmt.Printf("- after the hold: handled %.0f msg/s over %d s (the slowest group's mean)\n", s.afterRate, s.afterSeconds)
	}
	if c.onMySQL() {
		fmt.Println()
		return
	}
	fmt.Printf("- sizes (pg_total_relation_size: table, indexes, TOAST):\n")
	if haveStart {
		fmt.Printf("  - hold start: %s\n", formatSizes(atStart))
	}
	if haveEnd {
		fmt.Printf("  - hold end:   %s\n", formatSizes(atEnd))
	}
	fmt.Printf("  - run end:    %s\n\n", formatSizes(final))
}
