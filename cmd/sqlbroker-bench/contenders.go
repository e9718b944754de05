package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// contender is one of the things measured: the library in one claim mode on PostgreSQL, the
// library on SQLite or on MySQL, or watermill-sql on PostgreSQL or on MySQL.
type contender int

const (
	lease contender = iota
	advisory
	watermillSQL
	sqliteLease
	libpqLease        // lease mode through database/sql and lib/pq
	libpqBinaryLease  // the same with lib/pq's binary_parameters=yes: one round trip a statement
	libpqPrepared     // lease mode through database/sql and lib/pq, statements prepared (StdSQLPrepared)
	mysqlLease        // lease mode on the MySQL or MariaDB of -mysql-dsn (sqlbroker.MySQL)
	watermillSQLMySQL // watermill-sql on the same MySQL, with its MySQL adapters
)

var contenderNames = [...]string{
	lease: "lease", advisory: "advisory", watermillSQL: "watermill-sql", sqliteLease: "sqlite",
	libpqLease: "libpq", libpqBinaryLease: "libpq-binary", libpqPrepared: "libpq-prepared",
	mysqlLease: "mysql", watermillSQLMySQL: "watermill-sql-mysql",
}

// viaLibPQ reports whether the library's publishers and subscribers of c run on a database/sql
// pool opened with lib/pq rather than on a pgx pool.
func (c contender) viaLibPQ() bool {
	return c == libpqLease || c == libpqBinaryLease || c == libpqPrepared
}

func (c contender) String() string { return contenderNames[c] }

// contenderNameList is "lease, advisory, ...", for flag help and errors.
func contenderNameList() string { return strings.Join(contenderNames[:], ", ") }

func contenderByName(s string) (contender, bool) {
	for i, n := range contenderNames {
		if n == s {
			return contender(i), true
		}
	}
	return 0, false
}

// isWatermillSQL reports whether c is watermill-sql, on PostgreSQL or on MySQL.
func (c contender) isWatermillSQL() bool { return c == watermillSQL || c == watermillSQLMySQL }

func (c contender) isLibrary() bool { return !c.isWatermillSQL() }

// onSQLite reports whether c runs on SQLite (its lease mode, on a file of its own per scenario)
// rather than on the PostgreSQL of -url.
func (c contender) onSQLite() bool { return c == sqliteLease }

// onMySQL reports whether c runs on the MySQL or MariaDB of -mysql-dsn.
func (c contender) onMySQL() bool { return c == mysqlLease || c == watermillSQLMySQL }

// onPostgres reports whether c runs on the PostgreSQL of -url, whose statistics (backends,
// transactions, table sizes, plans) some scenarios read.
func (c contender) onPostgres() bool { return !c.onSQLite() && !c.onMySQL() }

// appName marks the contender's server backends in pg_stat_activity, so that their CPU time can
// be read from /proc.
func (c contender) appName() string { return "sqlbroker-bench-" + c.String() }

// errNA says that a contender cannot run a scenario (the advisory claim mode while it is not
// available yet); the table shows "n/a".
var errNA = errors.New("not available")

// errNotOnPostgres says that a scenario reads PostgreSQL's statistics, which SQLite and MySQL
// have no counterpart of here.
var errNotOnPostgres = fmt.Errorf("%w: the scenario counts PostgreSQL's transactions and backends", errNA)

const group = "bench"

// env is one contender's pool for one scenario: every scenario starts from a fresh pool of the
// same size for every contender, so no contender inherits another's connections or caches.
//
// On SQLite, an env is a fresh database file (or, with share, the file of another env: a
// second consumer process of the same database), opened the way a program would, with
// sqlbroker.Open on a sqlite: URL; db is a second pool on that file with the same settings,
// for the library's statements run without a Publisher or Subscriber and for reading state.
//
// On MySQL, an env is a database/sql pool of go-sql-driver/mysql on -mysql-dsn (std), which
// both the contender and the bench's reads of state run on.
type env struct {
	c    contender
	cfg  *config
	pool *pgxpool.Pool // PostgreSQL contenders (lib/pq ones: two connections, for reading state)
	std  *sql.DB       // lib/pq and MySQL contenders: the pool the contender runs on
	db   dbx.Pool      // the library's statements run here without Watermill

	broker *sqlbroker.Broker // SQLite: what publishers and subscribers come from
	file   string            // SQLite: the database file
	owner  bool              // SQLite: this env made the file and removes it on close

	orderByKey bool // the library's subscribers keep the order of each key (scenario 13)
}

func openEnv(ctx context.Context, cfg *config, c contender) (*env, error) {
	if c.onSQLite() {
		return openSQLiteEnv(cfg, "")
	}
	if c.onMySQL() {
		return openMySQLEnv(ctx, cfg, c)
	}
	pc, err := pgxpool.ParseConfig(cfg.url)
	if err != nil {
		return nil, fmt.Errorf("-url: %w", err)
	}
	pc.MaxConns = int32(cfg.poolSize)
	pc.ConnConfig.RuntimeParams["application_name"] = c.appName()
	if c.viaLibPQ() {
		// Only the bench's own reads of state run here; their backends are not the contender's.
		pc.MaxConns = 2
		pc.ConnConfig.RuntimeParams["application_name"] = c.appName() + "-state"
	}
	if cfg.traceSQL {
		pc.ConnConfig.Tracer = sqlTracer
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("%s: pool: %w", c, err)
	}
	if err := warm(ctx, pool, int(pc.MaxConns)); err != nil {
		pool.Close()
		return nil, fmt.Errorf("%s: connect to %s: %w", c, redact(cfg.url), err)
	}
	if !c.viaLibPQ() {
		return &env{c: c, cfg: cfg, pool: pool, db: dbx.NewPgxPool(pool)}, nil
	}
	url := stdURL(cfg.url, c.appName())
	if c == libpqBinaryLease {
		url += "&binary_parameters=yes"
	}
	std, err := sql.Open("postgres", url)
	if err == nil {
		std.SetMaxOpenConns(cfg.poolSize)
		std.SetMaxIdleConns(cfg.poolSize)
		err = warmStd(ctx, std, cfg.poolSize)
	}
	if err != nil {
		pool.Close()
		if std != nil {
			_ = std.Close()
		}
		return nil, fmt.Errorf("%s: connect to %s: %w", c, redact(cfg.url), err)
	}
	if c == libpqPrepared {
		return &env{c: c, cfg: cfg, pool: pool, std: std, db: dbx.NewStdPoolPrepared(std)}, nil
	}
	return &env{c: c, cfg: cfg, pool: pool, std: std, db: dbx.NewStdPool(std)}, nil
}

// warmStd opens all n connections of a database/sql pool before anything is timed.
func warmStd(ctx context.Context, db *sql.DB, n int) error {
	conns := make([]*sql.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for len(conns) < n {
		c, err := db.Conn(ctx)
		if err != nil {
			return err
		}
		if err := c.PingContext(ctx); err != nil {
			_ = c.Close()
			return err
		}
		conns = append(conns, c)
	}
	return nil
}

// libDB is the pool the library's publishers and subscribers of e run on.
func (e *env) libDB() sqlbroker.DB {
	if e.c == mysqlLease {
		return sqlbroker.MySQL(e.std)
	}
	if e.c == libpqPrepared {
		return sqlbroker.StdSQLPrepared(e.std)
	}
	if e.std != nil {
		return sqlbroker.StdSQL(e.std)
	}
	return sqlbroker.Pgx(e.pool)
}

// warm opens all n connections of the pool before anything is timed, so that no contender pays
// for connecting inside a measurement, and so that a server short of connection slots (other
// clients on a shared machine) is waited for here, up to two minutes, instead of failing a run.
func warm(ctx context.Context, pool *pgxpool.Pool, n int) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	conns := make([]*pgxpool.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	for len(conns) < n {
		c, err := pool.Acquire(ctx)
		if err == nil {
			conns = append(conns, c)
			continue
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "53300" { // too_many_connections
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d connections after waiting for free slots: %w", len(conns), n, err)
		case <-time.After(250 * time.Millisecond):
		}
	}
	return nil
}

func (e *env) close() {
	if e.c.onSQLite() {
		e.closeSQLite()
		return
	}
	if e.pool != nil {
		e.pool.Close()
	}
	if e.std != nil {
		_ = e.std.Close()
	}
}

// watermill-sql's adapters: its default PostgreSQL schema and offsets adapter, with a BYTEA
// payload column (its default column type is JSON, which a binary payload cannot use).
func wsqlSchema() wsql.DefaultPostgreSQLSchema {
	return wsql.DefaultPostgreSQLSchema{GeneratePayloadType: func(string) string { return "BYTEA" }}
}

func wsqlOffsets() wsql.DefaultPostgreSQLOffsetsAdapter {
	return wsql.DefaultPostgreSQLOffsetsAdapter{}
}

// watermill-sql's adapters on MySQL: its default MySQL schema and offsets adapter, with a
// LONGBLOB payload column, as the library's on MySQL (its default column type is JSON there
// too, which a binary payload cannot use).
func wsqlMySQLSchema() wsql.DefaultMySQLSchema {
	return wsql.DefaultMySQLSchema{GeneratePayloadType: func(string) string { return "LONGBLOB" }}
}

func wsqlMySQLOffsets() wsql.DefaultMySQLOffsetsAdapter {
	return wsql.DefaultMySQLOffsetsAdapter{}
}

// wsqlAdapters are watermill-sql's adapters on c's database.
func (c contender) wsqlAdapters() (wsql.SchemaAdapter, wsql.OffsetsAdapter) {
	if c.onMySQL() {
		return wsqlMySQLSchema(), wsqlMySQLOffsets()
	}
	return wsqlSchema(), wsqlOffsets()
}

// wsqlDB is the pool watermill-sql runs on in e.
func (e *env) wsqlDB() wsql.Beginner {
	if e.c.onMySQL() {
		return wsql.BeginnerFromStdSQL(e.std)
	}
	return wsql.BeginnerFromPgx(e.pool)
}

// wsqlSubscriber builds a watermill-sql subscriber of the bench consumer group.
func (e *env) wsqlSubscriber() (*wsql.Subscriber, error) {
	schema, offs := e.c.wsqlAdapters()
	return wsql.NewSubscriber(e.wsqlDB(), wsql.SubscriberConfig{
		ConsumerGroup: group, SchemaAdapter: schema, OffsetsAdapter: offs,
	}, nil)
}

func libTables(topic string) offsets.Tables {
	return offsets.NewTables("", sqlbroker.DefaultTablePrefix, topic)
}

// tables are the library's tables of topic in c's database.
func (c contender) tables(topic string) offsets.Tables {
	switch {
	case c.onSQLite():
		return libTables(topic).OnSQLite()
	case c.onMySQL():
		return libTables(topic).On(dbx.MySQL)
	}
	return libTables(topic)
}

// tables are the library's tables of topic in e's database.
func (e *env) tables(topic string) offsets.Tables { return e.c.tables(topic) }

// tableNames are the quoted names of the tables a contender creates for topic.
func (c contender) tableNames(topic string) []string {
	switch c {
	case watermillSQL:
		return []string{wsqlSchema().MessagesTable(topic), wsqlOffsets().MessagesOffsetsTable(topic)}
	case watermillSQLMySQL:
		return []string{wsqlMySQLSchema().MessagesTable(topic), wsqlMySQLOffsets().MessagesOffsetsTable(topic)}
	}
	t := c.tables(topic)
	return []string{t.Messages, t.Groups, t.Claims}
}

// createTopic creates the topic's tables before anything is timed.
func (e *env) createTopic(ctx context.Context, topic string) error {
	if e.c.isWatermillSQL() {
		sub, err := e.wsqlSubscriber()
		if err != nil {
			return err
		}
		defer sub.Close()
		return sub.SubscribeInitialize(topic)
	}
	return e.tables(topic).Create(ctx, e.db)
}

func (e *env) publisher() (message.Publisher, error) {
	if e.c.isWatermillSQL() {
		schema, _ := e.c.wsqlAdapters()
		return wsql.NewPublisher(e.wsqlDB(), wsql.PublisherConfig{SchemaAdapter: schema}, nil)
	}
	if e.c.onSQLite() {
		return e.broker.NewPublisher(sqlbroker.PublisherConfig{})
	}
	return sqlbroker.NewPublisher(e.libDB(), sqlbroker.PublisherConfig{}, nil)
}

// subscriber builds a subscriber of the bench consumer group. maxInFlight 0 keeps the library's
// default; watermill-sql has no such setting (one message of a group is in flight at a time).
func (e *env) subscriber(maxInFlight int) (message.Subscriber, error) {
	switch {
	case e.c.isWatermillSQL():
		return e.wsqlSubscriber()
	case e.c.onSQLite():
		return e.broker.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: group, MaxInFlight: maxInFlight, OrderByKey: e.orderByKey})
	default:
		return e.poolSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: group, MaxInFlight: maxInFlight, OrderByKey: e.orderByKey})
	}
}

// poolSubscriber builds a library subscriber on the contender's pool (PostgreSQL's, or
// MySQL's) in its claim mode.
func (e *env) poolSubscriber(cfg sqlbroker.SubscriberConfig) (message.Subscriber, error) {
	cfg.ClaimMode = sqlbroker.ClaimLease
	if e.c == advisory {
		cfg.ClaimMode = sqlbroker.ClaimAdvisoryLock
	}
	s, err := sqlbroker.NewSubscriber(e.libDB(), cfg, nil)
	if err != nil && e.c == advisory {
		return nil, fmt.Errorf("%w: %v", errNA, err)
	}
	return s, err
}

// checkSubscriber tells early whether the contender can subscribe at all, before a backlog is
// published for nothing.
func (e *env) checkSubscriber() error {
	s, err := e.subscriber(0)
	if err != nil {
		return err
	}
	return s.Close()
}

// drained reports whether the group has settled every message of the topic, read from the
// database: the library has no claim left and its position at the last message; watermill-sql
// has acked the last offset.
func (e *env) drained(ctx context.Context, topic string) (bool, error) {
	if e.c.onSQLite() {
		return e.drainedSQLite(ctx, topic)
	}
	if e.c.onMySQL() {
		return e.drainedMySQL(ctx, topic)
	}
	var ok bool
	var q string
	if e.c == watermillSQL {
		q = fmt.Sprintf(`SELECT coalesce((SELECT offset_acked FROM %s WHERE consumer_group = $1), -1)
			= coalesce((SELECT max("offset") FROM %s), 0)`,
			wsqlOffsets().MessagesOffsetsTable(topic), wsqlSchema().MessagesTable(topic))
	} else {
		t := libTables(topic)
		q = fmt.Sprintf(`WITH g AS (SELECT group_id, last_offset FROM %[2]s WHERE consumer_group = $1)
			SELECT NOT EXISTS (SELECT 1 FROM %[1]s c, g WHERE c.group_id = g.group_id)
			AND coalesce((SELECT last_offset FROM g), -1) = coalesce((SELECT max("offset") FROM %[3]s), 0)`,
			t.Claims, t.Groups, t.Messages)
	}
	err := e.pool.QueryRow(ctx, q, group).Scan(&ok)
	return ok, err
}

// waitDrained polls drained until it holds or limit passes.
func (e *env) waitDrained(ctx context.Context, topic string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		ok, err := e.drained(ctx, topic)
		if err != nil {
			return fmt.Errorf("check drained: %w", err)
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("messages handled, but not all settled in the database after %s", limit)
		}
		select {
		case <-ctx.Done():
			return context.Cause(ctx)
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// dropTables drops the tables of topics created by c, each in its contender's database, with
// a fresh bounded context so that it runs also after the run's deadline has passed.
func dropTables(cfg *config, byContender map[contender][]string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var onPostgres, onMySQL []string
	for c, topics := range byContender {
		if c.onSQLite() {
			continue // the database file goes with its env
		}
		for _, topic := range topics {
			if c.onMySQL() {
				onMySQL = append(onMySQL, c.tableNames(topic)...)
			} else {
				onPostgres = append(onPostgres, c.tableNames(topic)...)
			}
		}
	}
	var errs []error
	if len(onPostgres) > 0 {
		errs = append(errs, dropPostgresTables(ctx, cfg.url, onPostgres))
	}
	if len(onMySQL) > 0 {
		errs = append(errs, dropMySQLTables(ctx, cfg.mysqlDSN, onMySQL))
	}
	return errors.Join(errs...)
}

func dropPostgresTables(ctx context.Context, url string, tables []string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return fmt.Errorf("drop tables: %w", err)
	}
	defer conn.Close(ctx)
	var errs []error
	for _, t := range tables {
		if _, err := conn.Exec(ctx, "DROP TABLE IF EXISTS "+t); err != nil {
			errs = append(errs, fmt.Errorf("drop %s: %w", t, err))
		}
	}
	return errors.Join(errs...)
}

func redact(url string) string {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return "(unparseable URL)"
	}
	return fmt.Sprintf("%s@%s:%d/%s", cfg.User, cfg.Host, cfg.Port, cfg.Database)
}
