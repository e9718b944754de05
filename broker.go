package sqlbroker

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/lib/pq" // the database/sql driver behind libpq+postgres:// URLs

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// Defaults of BrokerConfig.
const (
	DefaultMaxConns       = 20
	DefaultConnectTimeout = 5 * time.Second
)

// BrokerConfig configures a Broker built from a URL.
type BrokerConfig struct {
	// MaxConns bounds the connections of the pool the broker builds. Defaults to
	// DefaultMaxConns. On sqlite::memory:, the pool holds one connection more, which keeps
	// the database alive: MaxConns connections stay for the statements, so 1 works there too.
	MaxConns int

	// ConnectTimeout bounds the opening of one connection, unless the URL sets
	// connect_timeout. A URL that points at no server fails within it, naming the host.
	// Defaults to DefaultConnectTimeout.
	ConnectTimeout time.Duration

	// CloseTimeout bounds Close, which runs Shutdown with it. Defaults to DefaultCloseTimeout.
	CloseTimeout time.Duration

	// PrepareStatements has the pool of a libpq+postgres:// URL prepare the library's
	// statements once per connection, as StdSQLPrepared does: much faster through lib/pq, and
	// not behind a transaction-mode pooler that does not track prepared statements. Only for
	// lib/pq: pgx prepares statements by default (unless the URL sets
	// default_query_exec_mode), and SQLite always does.
	PrepareStatements bool
}

func (c *BrokerConfig) setDefaults() {
	if c.MaxConns == 0 {
		c.MaxConns = DefaultMaxConns
	}
	if c.ConnectTimeout == 0 {
		c.ConnectTimeout = DefaultConnectTimeout
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = DefaultCloseTimeout
	}
}

// errPrepareLibPQOnly refuses PrepareStatements on a URL that is not lib/pq's.
func errPrepareLibPQOnly(why string) error {
	return &ConfigError{Field: "PrepareStatements", Value: true, Reason: "applies to libpq+postgres:// URLs only: " + why}
}

func (c *BrokerConfig) validate() error {
	if c.MaxConns < 0 {
		return &ConfigError{Field: "MaxConns", Value: c.MaxConns, Reason: "must not be negative"}
	}
	if c.ConnectTimeout < 0 {
		return &ConfigError{Field: "ConnectTimeout", Value: c.ConnectTimeout, Reason: "must not be negative"}
	}
	if c.CloseTimeout < 0 {
		return &ConfigError{Field: "CloseTimeout", Value: c.CloseTimeout, Reason: "must not be negative"}
	}
	return nil
}

// Broker owns a pool it built from a URL, and the publishers and subscribers it hands out.
// Nothing connects until the first statement. Shutdown stops the subscribers, closes the
// publishers (every later Publish returns ErrClosed) and closes the pool last.
type Broker struct {
	config  BrokerConfig
	logger  watermill.LoggerAdapter
	pool    dbx.Pool
	driver  string
	display string // the URL without its password, for logs and errors

	mu          sync.Mutex
	closed      bool
	publishers  []*Publisher
	subscribers []*Subscriber
	hook        *RouterHook
	done        chan struct{}
	report      CloseReport
	err         error
}

// Open builds a Broker on the database rawURL names. The scheme picks the driver:
// postgres:// or postgresql:// (pgx/v5), pgx+postgres:// (the same), libpq+postgres://
// (database/sql with lib/pq), sqlite: (SQLite through database/sql, see below), mysql://
// (MySQL 8 or MariaDB 10.6 and newer: mysql://user:password@host:3306/database, through
// database/sql and github.com/go-sql-driver/mysql, which the program imports; the URL's
// parameters are the driver's). Open checks the URL and connects to nothing; errors never
// contain the password.
//
// A sqlite: URL names a file, relative ("sqlite:exports.db?mode=rwc") or absolute
// ("sqlite:/var/lib/app/queue.db"), with SQLite's URI parameters after "?" (mode=rwc creates
// the file; mode=rw needs it to exist), or "sqlite::memory:", an in-memory database that
// lives as long as the broker (for tests). The program must import the driver,
// _ "modernc.org/sqlite" (pure Go, no cgo); without it Open returns a ConfigError that says
// so. Every connection of the broker's pool is set to journal_mode=WAL (readers and the
// writer do not block each other), busy_timeout=5000 (a writer waits up to 5 s for the write
// lock instead of failing) and synchronous=NORMAL: in WAL mode a commit then waits for no
// disk flush, which survives a crash of the program and loses at most the last commits
// before a power cut or an operating-system crash; append _pragma=synchronous(FULL) to the
// URL to flush every commit. Every transaction of the library begins with BEGIN IMMEDIATE,
// and so does every transaction the caller begins on SQLDB (_txlock=immediate, unless the URL
// sets _txlock). SQLite runs the lease claim mode only.
func Open(rawURL string, config BrokerConfig, logger watermill.LoggerAdapter) (*Broker, error) {
	config.setDefaults()
	if err := config.validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if rest, ok := strings.CutPrefix(rawURL, "sqlite:"); ok {
		if config.PrepareStatements {
			return nil, errPrepareLibPQOnly("SQLite always prepares them")
		}
		return openSQLite(rest, config, logger)
	}
	if strings.HasPrefix(rawURL, "mysql://") {
		if config.PrepareStatements {
			return nil, errPrepareLibPQOnly("on MySQL the driver sends each statement with its arguments in one round trip (interpolateParams)")
		}
		return openMySQL(rawURL, config, logger)
	}
	driver, connURL, display, err := parseBrokerURL(rawURL)
	if err != nil {
		return nil, err
	}
	if config.PrepareStatements && driver != "lib/pq" {
		return nil, errPrepareLibPQOnly("pgx prepares them by default, unless the URL sets default_query_exec_mode")
	}
	b := &Broker{config: config, logger: logger, driver: driver, display: display, done: make(chan struct{})}
	switch driver {
	case "pgx":
		cfg, err := pgxpool.ParseConfig(connURL)
		if err != nil {
			return nil, fmt.Errorf("sqlbroker: Open %s: %s", display, redact(err.Error(), rawURL))
		}
		cfg.MaxConns = int32(config.MaxConns)
		if cfg.ConnConfig.ConnectTimeout == 0 {
			cfg.ConnConfig.ConnectTimeout = config.ConnectTimeout
		}
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg) // lazy: no connection yet
		if err != nil {
			return nil, fmt.Errorf("sqlbroker: Open %s: %s", display, redact(err.Error(), rawURL))
		}
		b.pool = dbx.NewPgxPool(pool)
	case "lib/pq":
		db, err := sql.Open("postgres", connURL) // lazy: no connection yet
		if err != nil {
			return nil, fmt.Errorf("sqlbroker: Open %s: %s", display, redact(err.Error(), rawURL))
		}
		db.SetMaxOpenConns(config.MaxConns)
		db.SetMaxIdleConns(config.MaxConns)
		if config.PrepareStatements {
			b.pool = dbx.NewStdPoolPrepared(db)
		} else {
			b.pool = dbx.NewStdPool(db)
		}
	}
	return b, nil
}

// openSQLite builds a Broker on the SQLite database of a sqlite: URL (rest is what follows
// "sqlite:").
func openSQLite(rest string, config BrokerConfig, logger watermill.LoggerAdapter) (*Broker, error) {
	display := "sqlite:" + rest
	path, query, _ := strings.Cut(rest, "?")
	if path == "" {
		return nil, &ConfigError{Field: "url", Value: display, Reason: "names no file: want sqlite:path/to/file.db[?mode=rwc], sqlite:/absolute/path.db or sqlite::memory:"}
	}
	if strings.HasPrefix(path, "//") {
		return nil, &ConfigError{Field: "url", Value: display, Reason: "has a host part (sqlite://...): want sqlite:relative/path.db or sqlite:/absolute/path.db"}
	}
	params, err := url.ParseQuery(query)
	if err != nil {
		return nil, &ConfigError{Field: "url", Value: display, Reason: "has malformed parameters after '?': " + err.Error()}
	}
	memory := path == ":memory:"
	if memory {
		// One database shared by every connection of the pool, named for this broker alone.
		path = "/sqlbroker-" + watermill.NewUUID()
		params.Set("vfs", "memdb")
	} else {
		params.Add("_pragma", "journal_mode(WAL)")
		params.Add("_pragma", "synchronous(NORMAL)")
	}
	if params.Get("_busy_timeout") == "" && params.Get("_timeout") == "" {
		params.Add("_pragma", fmt.Sprintf("busy_timeout(%d)", dbx.SQLiteBusyTimeoutMS))
	}
	if params.Get("_txlock") == "" {
		// For the caller's transactions on SQLDB (the library begins its own explicitly):
		// one that reads first and writes later cannot then fail on the lock upgrade.
		params.Set("_txlock", "immediate")
	}
	dsn := "file:" + path + "?" + params.Encode()
	pool, err := dbx.OpenSQLitePool(dsn, path, config.MaxConns, memory)
	if errors.Is(err, dbx.ErrNoSQLiteDriver) {
		return nil, &ConfigError{Field: "url", Value: display, Reason: `needs the SQLite driver: import _ "modernc.org/sqlite" in the program (the library does not import it, so that programs on PostgreSQL do not build it)`}
	}
	if err != nil {
		return nil, fmt.Errorf("sqlbroker: Open %s: %w", display, err)
	}
	return &Broker{config: config, logger: logger, driver: "sqlite", display: display, pool: pool, done: make(chan struct{})}, nil
}

// openMySQL builds a Broker on the MySQL or MariaDB database of a mysql:// URL, through the
// driver github.com/go-sql-driver/mysql, which the program imports. The URL's parameters are
// the driver's (tls, charset, timeouts, ...); interpolateParams is on unless the URL says
// otherwise: each statement then costs one round trip instead of three. Every session of the
// broker's pool runs at READ COMMITTED, so that the library's transactions begin in one round
// trip.
func openMySQL(rawURL string, config BrokerConfig, logger watermill.LoggerAdapter) (*Broker, error) {
	u, err := url.Parse(rawURL)
	if err != nil || u.Host == "" || strings.Trim(u.Path, "/") == "" || strings.Contains(strings.Trim(u.Path, "/"), "/") {
		return nil, &ConfigError{Field: "url", Value: "mysql://...", Reason: "is malformed: want mysql://user[:password]@host[:port]/database[?options]"}
	}
	display := redactedURL(u)
	if !slices.Contains(sql.Drivers(), "mysql") {
		return nil, &ConfigError{Field: "url", Value: display, Reason: `needs the MySQL driver: import _ "github.com/go-sql-driver/mysql" in the program (the library does not import it, so that programs on other databases do not build it)`}
	}
	params := u.Query()
	if params.Get("interpolateParams") == "" {
		params.Set("interpolateParams", "true")
	}
	if config.ConnectTimeout > 0 && params.Get("timeout") == "" {
		params.Set("timeout", config.ConnectTimeout.String())
	}
	host := u.Host
	if u.Port() == "" {
		host += ":3306"
	}
	var user string
	if u.User != nil {
		user = u.User.Username()
		if p, ok := u.User.Password(); ok {
			user += ":" + p
		}
		user += "@"
	}
	dsn := user + "tcp(" + host + ")/" + strings.Trim(u.Path, "/") + "?" + params.Encode()
	pool, err := dbx.OpenMySQLPool(dsn, config.MaxConns) // lazy: no connection yet
	if err != nil {
		return nil, fmt.Errorf("sqlbroker: Open %s: %s", display, redact(err.Error(), rawURL))
	}
	return &Broker{config: config, logger: logger, driver: "mysql", display: display, pool: pool, done: make(chan struct{})}, nil
}

// parseBrokerURL picks the driver and returns the URL to hand it, and the URL to show.
func parseBrokerURL(rawURL string) (driver, connURL, display string, err error) {
	scheme, rest, ok := strings.Cut(rawURL, "://")
	if !ok {
		return "", "", "", &ConfigError{Field: "url", Value: "(not shown)", Reason: "is not a URL: want postgres://user@host:port/database, mysql://user@host:port/database or sqlite:path/to/file.db"}
	}
	switch scheme {
	case "postgres", "postgresql", "pgx+postgres", "pgx+postgresql":
		driver = "pgx"
	case "libpq+postgres", "libpq+postgresql":
		driver = "lib/pq"
	default:
		return "", "", "", &ConfigError{Field: "url", Value: scheme + "://...", Reason: "has an unknown scheme: want postgres://, pgx+postgres://, libpq+postgres://, mysql:// or sqlite:"}
	}
	connURL = "postgres://" + rest
	u, perr := url.Parse(connURL)
	if perr != nil || u.Host == "" {
		return "", "", "", &ConfigError{Field: "url", Value: scheme + "://...", Reason: "is malformed: want " + scheme + "://user[:password]@host[:port]/database[?options]"}
	}
	u.Scheme = scheme
	return driver, connURL, redactedURL(u), nil
}

// String names the broker's database. Like every string the broker produces (its errors and
// logs), it never shows a password: the URL's userinfo password and the values of its
// password, sslpassword and sslkey parameters are replaced by xxxxx.
func (b *Broker) String() string { return "sqlbroker.Broker(" + b.driver + " " + b.display + ")" }

func (b *Broker) db() DB { return DB{pool: b.pool} }

// DB returns the broker's pool as a DB, so that one pool serves the broker and whatever else
// the program builds on the same database: NewAdmin, sqlbrokerprom.NewCollector,
// NewKeyRepository, NewPublisher and NewSubscriber outside the broker. Sharing it is fine: the
// pool is bounded by MaxConns and every part of the library takes a connection only for a
// statement or a short transaction (the advisory claim mode keeps one per subscription: see
// SubscriberConfig.ClaimMode). Publishers and subscribers built on it outside the broker are
// not the broker's: shut them down first. Shutdown closes the pool last; after it, every
// statement on the DB fails, and whatever was built on it must not be used.
func (b *Broker) DB() DB { return b.db() }

// PgxPool returns the broker's pgx pool (postgres://, pgx+postgres:// URLs), or nil for
// another driver, for the caller's own statements and transactions: begin one on it and
// publish inside it with NewTxPublisher(PgxTx(tx), ...). Never close it: Shutdown does, last.
func (b *Broker) PgxPool() *pgxpool.Pool {
	if p, ok := b.pool.(*dbx.PgxPool); ok {
		return p.Pool
	}
	return nil
}

// SQLDB returns the broker's database/sql pool (libpq+postgres://, sqlite: and mysql:// URLs),
// or nil for pgx, for the caller's own statements and transactions: begin one on it and
// publish inside it with NewTxPublisher(StdTx(tx), ...), or SQLiteTx on SQLite, where the
// broker's pool begins every transaction with BEGIN IMMEDIATE (unless the URL sets _txlock),
// or MySQLTx on MySQL, where the broker's sessions run at READ COMMITTED. Never close it:
// Shutdown does, last.
func (b *Broker) SQLDB() *sql.DB {
	switch p := b.pool.(type) {
	case *dbx.StdPool:
		return p.DB
	case *dbx.SQLitePool:
		return p.DB
	case *dbx.MySQLPool:
		return p.DB
	}
	return nil
}

func (b *Broker) register(fn func()) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return ErrClosed
	}
	fn()
	return nil
}

// NewPublisher builds a Publisher on the broker's pool; Shutdown closes it.
func (b *Broker) NewPublisher(config PublisherConfig) (*Publisher, error) {
	return b.publisher(b.db(), config)
}

// NewTxPublisher builds a Publisher inside the caller's transaction (PgxTx, StdTx or
// SQLiteTx; begin it on PgxPool or SQLDB to use the broker's pool), for the outbox pattern:
// one per transaction is cheap, and the broker keeps no reference to it, so a service that
// builds one per transaction does not grow. Once Shutdown has begun, it refuses
// every publish with ErrClosed, as the broker's other publishers do. Its rows are the
// caller's transaction's: a Publish that returned nil before Shutdown is committed or rolled
// back with that transaction, whenever the caller ends it.
func (b *Broker) NewTxPublisher(tx DB, config PublisherConfig) (*Publisher, error) {
	if tx.tx == nil {
		return nil, &ConfigError{Field: "tx", Value: "not a transaction", Reason: "must wrap a transaction: use sqlbroker.PgxTx, sqlbroker.StdTx, sqlbroker.SQLiteTx or sqlbroker.MySQLTx"}
	}
	if b.isClosed() {
		return nil, ErrClosed
	}
	pub, err := NewPublisher(tx, config, b.logger)
	if err != nil {
		return nil, err
	}
	// Not registered: the publisher asks the broker instead.
	pub.ownerClosed = b.isClosed
	return pub, nil
}

// isClosed reports whether Shutdown has begun.
func (b *Broker) isClosed() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.closed
}

func (b *Broker) publisher(db DB, config PublisherConfig) (*Publisher, error) {
	pub, err := NewPublisher(db, config, b.logger)
	if err != nil {
		return nil, err
	}
	if err := b.register(func() { b.publishers = append(b.publishers, pub) }); err != nil {
		return nil, err
	}
	return pub, nil
}

// NewSubscriber builds a Subscriber on the broker's pool; Shutdown shuts it down.
func (b *Broker) NewSubscriber(config SubscriberConfig) (*Subscriber, error) {
	sub, err := NewSubscriber(b.db(), config, b.logger)
	if err != nil {
		return nil, err
	}
	if err := b.register(func() {
		b.subscribers = append(b.subscribers, sub)
		if b.hook != nil {
			sub.attach(b.hook)
		}
	}); err != nil {
		return nil, err
	}
	return sub, nil
}

// InitializeSchema creates the tables of topics (see SchemaSQL), for a service that creates
// them at start-up, before its subscriptions check them.
func (b *Broker) InitializeSchema(ctx context.Context, config PublisherConfig, topics ...string) error {
	config.setDefaults()
	if err := config.validate(); err != nil {
		return err
	}
	for _, topic := range topics {
		if err := validateTopic(topic); err != nil {
			return err
		}
		if err := schemaOn(b.pool.Dialect(), config.Schema); err != nil {
			return err
		}
		if err := tablesOn(b.pool.Dialect(), config.Schema, config.TablePrefix, topic).Create(ctx, b.pool); err != nil {
			return publicErr(fmt.Errorf("sqlbroker: creating the tables of %q: %w", topic, err))
		}
	}
	return nil
}

// Shutdown shuts down everything the broker handed out, then closes its pool, bounded by ctx
// like http.Server.Shutdown. The order:
//  1. No new publisher or subscriber.
//  2. Every subscriber shuts down (see Subscriber.Shutdown).
//  3. Every publisher closes (see Publisher.Close): later publishes return ErrClosed, and
//     those already running have committed or failed when this step ends. When ctx ends
//     first, the publishers' statements still running are cancelled on the server, and this
//     step waits for the server to end them (a short bounded wait, about a second): so once
//     Shutdown returns, no row and no NOTIFY of a publisher is committed any more.
//  4. The pool closes last: it lends no new connection, and a connection still lent out is
//     closed when it comes back.
//
// The report adds up the subscribers' reports, the publishers' statements cancelled, and the
// pool's connections closed. Later and concurrent calls wait for the first and return its
// result.
func (b *Broker) Shutdown(ctx context.Context) (CloseReport, error) {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		select {
		case <-b.done:
			return b.report, b.err
		case <-ctx.Done():
			return CloseReport{}, ctx.Err()
		}
	}
	// 1. No new publisher or subscriber.
	b.closed = true
	pubs, subs := b.publishers, b.subscribers
	b.mu.Unlock()
	start := time.Now()
	var rep CloseReport
	var errs []error

	// 2. Subscribers.
	for _, s := range subs {
		r, err := s.Shutdown(ctx)
		rep.add(r)
		if err != nil {
			errs = append(errs, err)
		}
	}
	// 3. Publishers, all at once, so that none accepts publishes while another waits.
	stops := make([]publisherStop, len(pubs))
	perrs := make([]error, len(pubs))
	var wg sync.WaitGroup
	for i, p := range pubs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			stops[i], perrs[i] = p.shutdown(ctx)
		}()
	}
	wg.Wait()
	for i := range pubs {
		rep.PublishesCancelled += stops[i].cancelled
		rep.PublishesAbandoned += stops[i].abandoned
		if perrs[i] != nil {
			errs = append(errs, perrs[i])
		}
	}
	// 4. The pool, last.
	n, err := closePool(ctx, b.pool)
	rep.ConnectionsClosed += n
	if err != nil {
		errs = append(errs, err)
	}
	rep.Duration = time.Since(start)

	b.mu.Lock()
	b.report, b.err = rep, joinErrors(errs)
	b.mu.Unlock()
	close(b.done)
	b.logger.Info("Broker shut down", watermill.LogFields{
		"database": b.display, "connections_closed": rep.ConnectionsClosed, "locks_released": rep.LocksReleased, "duration": rep.Duration,
	})
	return rep, b.err
}

// Close runs Shutdown bounded by CloseTimeout.
func (b *Broker) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), b.config.CloseTimeout)
	defer cancel()
	_, err := b.Shutdown(ctx)
	return err
}

// closePool closes a pool the library built and returns how many connections it had open.
func closePool(ctx context.Context, pool dbx.Pool) (int, error) {
	open := pool.OpenConns()
	done := make(chan struct{})
	go func() {
		pool.Close()
		close(done)
	}()
	select {
	case <-done:
		return open, nil
	case <-ctx.Done():
		return 0, fmt.Errorf("sqlbroker: closing the pool: connections still lent out: %w", ctx.Err())
	}
}
