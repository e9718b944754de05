package dbx

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// pgxQuerier is what pgxpool.Pool, pgxpool.Conn, pgx.Conn and pgx.Tx have in common.
type pgxQuerier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

type pgxQ struct{ q pgxQuerier }

// pgxCopier is what pgxpool.Pool, pgxpool.Conn, pgx.Conn and pgx.Tx offer for COPY.
type pgxCopier interface {
	CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, rows pgx.CopyFromSource) (int64, error)
}

var _ Copier = pgxQ{}

func (p pgxQ) CopyFrom(ctx context.Context, table []string, columns []string, rows [][]any) (int64, error) {
	c, ok := p.q.(pgxCopier)
	if !ok {
		return 0, errors.New("dbx: this pgx querier cannot COPY")
	}
	return c.CopyFrom(ctx, pgx.Identifier(table), columns, pgx.CopyFromRows(rows))
}

func (p pgxQ) Exec(ctx context.Context, sql string, args ...any) (int64, error) {
	tag, err := p.q.Exec(ctx, sql, args...)
	if err != nil {
		return 0, err
	}
	return tag.RowsAffected(), nil
}

func (p pgxQ) Query(ctx context.Context, sql string, args ...any) (Rows, error) {
	rows, err := p.q.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return rows, nil
}

type pgxTx struct {
	pgxQ
	tx pgx.Tx
}

func (t pgxTx) Commit(ctx context.Context) error   { return t.tx.Commit(ctx) }
func (t pgxTx) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

// PgxTx wraps a caller's pgx transaction.
func PgxTx(tx pgx.Tx) Querier { return pgxQ{tx} }

// PgxConn wraps a single pgx connection.
func PgxConn(c *pgx.Conn) Querier { return pgxQ{c} }

// PgxPool wraps a pgx pool.
type PgxPool struct {
	pgxQ
	Pool *pgxpool.Pool
}

// NewPgxPool wraps p.
func NewPgxPool(p *pgxpool.Pool) *PgxPool { return &PgxPool{pgxQ: pgxQ{p}, Pool: p} }

func (p *PgxPool) Driver() string   { return "pgx" }
func (p *PgxPool) Dialect() Dialect { return Postgres }

func (p *PgxPool) Begin(ctx context.Context) (Tx, error) {
	tx, err := p.Pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return pgxTx{pgxQ{tx}, tx}, nil
}

func (p *PgxPool) Acquire(ctx context.Context) (Conn, error) {
	c, err := p.Pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	return &pgxPoolConn{pgxQ: pgxQ{c}, c: c}, nil
}

// Dedicated dials a connection of its own, set up as the pool sets up its connections: the
// pool's BeforeConnect and AfterConnect hooks run on it (a search_path, a role, a password
// fetched per connection), so its statements see what the pool's statements see.
func (p *PgxPool) Dedicated(ctx context.Context) (Conn, error) {
	c, err := p.dial(ctx)
	if err != nil {
		return nil, err
	}
	return &pgxConn{pgxQ: pgxQ{c}, c: c}, nil
}

// dial opens a connection outside the pool, set up as the pool's are, with TCP keepalives.
func (p *PgxPool) dial(ctx context.Context) (*pgx.Conn, error) {
	pcfg := p.Pool.Config()
	cfg := pcfg.ConnConfig.Copy()
	cfg.DialFunc = withKeepAlive(cfg.DialFunc)
	if pcfg.BeforeConnect != nil {
		if err := pcfg.BeforeConnect(ctx, cfg); err != nil {
			return nil, err
		}
	}
	c, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if pcfg.AfterConnect != nil {
		if err := pcfg.AfterConnect(ctx, c); err != nil {
			cctx, cancel := CleanupContext(ctx)
			defer cancel()
			_ = c.Close(cctx)
			return nil, err
		}
	}
	return c, nil
}

func (p *PgxPool) Close() { p.Pool.Close() }

// DedicatedKeepAlive is the TCP keepalive of dedicated connections: a long-lived connection
// that sits idle (a lock holder, a listener) must find out that its peer is gone.
var DedicatedKeepAlive = net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 5 * time.Second, Count: 3}

// withKeepAlive wraps the configured dialer (the caller's, if they set one) and turns TCP
// keepalives on for the connections it dials.
func withKeepAlive(dial pgconn.DialFunc) pgconn.DialFunc {
	if dial == nil {
		dial = (&net.Dialer{}).DialContext
	}
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if tcp, ok := conn.(*net.TCPConn); ok {
			_ = tcp.SetKeepAliveConfig(DedicatedKeepAlive)
		}
		return conn, nil
	}
}

type pgxPoolConn struct {
	pgxQ
	c *pgxpool.Conn
}

func (c *pgxPoolConn) Begin(ctx context.Context) (Tx, error) {
	tx, err := c.c.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return pgxTx{pgxQ{tx}, tx}, nil
}

func (c *pgxPoolConn) PID(context.Context) (uint32, error) { return c.c.Conn().PgConn().PID(), nil }

func (c *pgxPoolConn) LockedQuery(ctx context.Context, lockSQL string, lockArgs []any, sql string, args []any, scan func(Rows) error) error {
	return lockedQuery(ctx, c.c.Conn(), lockSQL, lockArgs, sql, args, scan)
}

func (p *PgxPool) LockedQuery(ctx context.Context, lockSQL string, lockArgs []any, sql string, args []any, scan func(Rows) error) error {
	c, err := p.Pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer c.Release()
	return lockedQuery(ctx, c.Conn(), lockSQL, lockArgs, sql, args, scan)
}

func (c *pgxConn) LockedQuery(ctx context.Context, lockSQL string, lockArgs []any, sql string, args []any, scan func(Rows) error) error {
	return lockedQuery(ctx, c.c, lockSQL, lockArgs, sql, args, scan)
}

// lockedQuery sends both statements as one batch: outside a transaction block, pgx sends a
// batch as one pipeline with a single Sync, which the server runs as one implicit
// transaction, committed at the Sync (after the last row) or rolled back on an error. The
// server holds its replies back until the Sync, or until its send buffer fills: the lock's
// result reaches the client after the query has run, and tells nothing of when the lock was
// had.
func lockedQuery(ctx context.Context, c *pgx.Conn, lockSQL string, lockArgs []any, sql string, args []any, scan func(Rows) error) (err error) {
	if c.PgConn().TxStatus() != 'I' {
		return errors.New("dbx: LockedQuery on a connection inside a transaction")
	}
	b := &pgx.Batch{}
	b.Queue(lockSQL, lockArgs...)
	b.Queue(sql, args...)
	br := c.SendBatch(ctx, b)
	defer func() {
		if cerr := br.Close(); err == nil {
			err = cerr
		}
	}()
	if _, err := br.Exec(); err != nil {
		return err
	}
	rows, err := br.Query()
	if err != nil {
		return err
	}
	return scan(rows)
}

// Cancel sends a cancel request on a connection of its own (not a backend session): the
// running statement returns the server's error and the connection stays usable.
func (c *pgxPoolConn) Cancel(ctx context.Context) (bool, error) {
	return false, c.c.Conn().PgConn().CancelRequest(ctx)
}
func (c *pgxPoolConn) Release() { c.c.Release() }

func (c *pgxPoolConn) Destroy() {
	// Hijack takes the connection out of the pool's accounting; closing it then really closes it.
	conn := c.c.Hijack()
	ctx, cancel := CleanupContext(context.Background())
	defer cancel()
	_ = conn.Close(ctx)
}

type pgxConn struct {
	pgxQ
	c *pgx.Conn
}

func (c *pgxConn) Begin(ctx context.Context) (Tx, error) {
	tx, err := c.c.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return pgxTx{pgxQ{tx}, tx}, nil
}

func (c *pgxConn) PID(context.Context) (uint32, error) { return c.c.PgConn().PID(), nil }

func (c *pgxConn) Cancel(ctx context.Context) (bool, error) {
	return false, c.c.PgConn().CancelRequest(ctx)
}
func (c *pgxConn) Release() { c.Destroy() }

func (c *pgxConn) Destroy() {
	ctx, cancel := CleanupContext(context.Background())
	defer cancel()
	_ = c.c.Close(ctx)
}

func (p *PgxPool) OpenConns() int { return int(p.Pool.Stat().TotalConns()) }

func (p *PgxPool) ListenKey() any { return p.Pool }

// Listen runs LISTEN channel on a connection of its own and calls onNotify with the payload
// of every notification until ctx ends or the connection fails. onOpen runs once the
// connection is open (its backend exists from then on, until Listen returns); onConnect once
// the LISTEN is in place. The connection is dialled as Dedicated's: the pool's connect hooks
// run on it, and its TCP keepalives find out, while it sits idle waiting for notifications,
// that its peer is gone.
func (p *PgxPool) Listen(ctx context.Context, channel string, onOpen, onConnect func(), onNotify func(string)) error {
	conn, err := p.dial(ctx)
	if err != nil {
		return err
	}
	onOpen()
	defer func() {
		cctx, cancel := CleanupContext(context.Background())
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		return err
	}
	onConnect()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		onNotify(n.Payload)
	}
}
