package advisory_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/sqlbroker/watermill-sqlbroker/internal/advisory"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testdb.Close()
	if code == 0 {
		if err := testdb.LeakCheck(); err != nil {
			os.Stderr.WriteString("goroutines leaked: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}

// A4: key1 stays in the library's range and off the schema lock; key2 is the offset's low
// 32 bits, in Go and in SQL alike.
func TestKeys_A4_namespace(t *testing.T) {
	t.Parallel()
	for _, table := range []string{`"sqlbroker_a_messages"`, `"s"."sqlbroker_b_messages"`, ""} {
		for _, group := range []string{"default", "g", ""} {
			k := advisory.Key1(table, group)
			assert.GreaterOrEqual(t, uint32(k), advisory.NamespaceFirst)
			assert.Less(t, uint32(k), advisory.NamespaceLast, "ProbeKey1 is reserved")
			assert.NotEqual(t, offsets.SchemaLockKey1, k)
		}
	}
	assert.NotEqual(t, advisory.Key1(`"t"`, "a"), advisory.Key1(`"t"`, "b"))
	assert.NotEqual(t, advisory.Key1(`"t1"`, "a"), advisory.Key1(`"t2"`, "a"))

	pool := testdb.Pgx(t)
	for _, o := range []int64{0, 1, 1<<31 - 1, 1 << 31, 1<<32 - 1, 1 << 32, 1<<32 + 5, 1<<62 + 12345} {
		var k int32
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT ($1::bigint::bit(32))::int4`, o).Scan(&k))
		assert.Equal(t, advisory.Key2(o), k, "offset %d", o)
	}
	// In flight together (less than 2^32 apart), two offsets never share key2.
	assert.NotEqual(t, advisory.Key2(1<<32-1), advisory.Key2(1<<32))
}

func open(t *testing.T, key1 int32, onLost func([]int64)) *advisory.Conn {
	t.Helper()
	c, err := advisory.Open(context.Background(), dbx.NewPgxPool(testdb.Pgx(t)), advisory.Options{
		Key1: key1, CheckInterval: 100 * time.Millisecond, OnLost: onLost,
	})
	require.NoError(t, err)
	return c
}

// The drops DeferUnlock leaves to the next Claim: the Claim's statement is given them (and
// no longer sees them as held), nothing else drops them meanwhile, and Close drops them
// without counting them; a Claim that did not run gives them back; with no Claim, a statement
// of their own drops them after DeferFlush.
func TestConn_deferredUnlocks(t *testing.T) {
	t.Parallel()
	pool := testdb.Pgx(t)
	unlockAll := func(ctx context.Context, q dbx.Querier, key1 int32, offs []int64) ([]int64, error) {
		var refused []int64
		for _, o := range offs {
			var ok bool
			if err := dbx.QueryRow(ctx, q, `SELECT pg_advisory_unlock($1::int4, ($2::bigint::bit(32))::int4)`, []any{key1, o}, &ok); err != nil {
				return nil, err
			}
			if !ok {
				refused = append(refused, o)
			}
		}
		return refused, nil
	}

	t.Run("carried by the next claim", func(t *testing.T) {
		key1 := advisory.Key1(`"conn_test_deferred"`, t.Name())
		c, err := advisory.Open(context.Background(), dbx.NewPgxPool(pool), advisory.Options{Key1: key1, DeferFlush: time.Hour})
		require.NoError(t, err)
		_, gen, err := c.TryLock(context.Background(), []int64{1, 2, 3})
		require.NoError(t, err)
		c.DeferUnlock([]int64{1, 2, 7}, gen) // 7 is not held: skipped
		c.DeferUnlock([]int64{2}, gen+1)     // another generation: skipped
		assert.Equal(t, 3, c.Held(), "held until a statement drops them")
		time.Sleep(50 * time.Millisecond)
		assert.Equal(t, 3, locksOf(t, pool, key1), "no statement of their own before DeferFlush")

		var gotHeld, gotUnlock []int64
		_, err = c.Claim(context.Background(), func(ctx context.Context, q dbx.Querier, held, unlock []int64) ([]int64, []int64, error) {
			gotHeld, gotUnlock = held, unlock
			refused, err := unlockAll(ctx, q, key1, unlock)
			return nil, refused, err
		})
		require.NoError(t, err)
		assert.ElementsMatch(t, []int64{3}, gotHeld, "a lock being dropped is not given as held")
		assert.ElementsMatch(t, []int64{1, 2}, gotUnlock)
		assert.Equal(t, 1, c.Held())
		assert.Equal(t, 1, locksOf(t, pool, key1))

		// Given to a claim that does not run, they wait for the next one; Close drops them
		// without counting them as released.
		c.DeferUnlock([]int64{3}, gen)
		stopped, cancel := context.WithCancel(context.Background())
		cancel()
		_, err = c.Claim(stopped, func(context.Context, dbx.Querier, []int64, []int64) ([]int64, []int64, error) {
			t.Error("a stopped claim ran")
			return nil, nil, nil
		})
		require.ErrorIs(t, err, advisory.ErrStopped)
		assert.Equal(t, 1, c.Held())
		assert.Equal(t, 1, locksOf(t, pool, key1))
		released, closed := c.Close()
		assert.True(t, closed)
		assert.Zero(t, released, "a settled message's lock counted as released by Close")
		assert.Zero(t, locksOf(t, pool, key1))
	})

	t.Run("a claim that fails after dropping them", func(t *testing.T) {
		key1 := advisory.Key1(`"conn_test_deferred"`, t.Name())
		c, err := advisory.Open(context.Background(), dbx.NewPgxPool(pool), advisory.Options{Key1: key1, DeferFlush: time.Hour})
		require.NoError(t, err)
		_, gen, err := c.TryLock(context.Background(), []int64{1, 2, 3})
		require.NoError(t, err)
		c.DeferUnlock([]int64{1, 2}, gen)
		// The statement drops one of them, takes a lock of its own, then fails: the session
		// stays, and the bookkeeping and the server agree again.
		_, err = c.Claim(context.Background(), func(ctx context.Context, q dbx.Querier, _, unlock []int64) ([]int64, []int64, error) {
			if _, err := unlockAll(ctx, q, key1, unlock[:1]); err != nil {
				return nil, nil, err
			}
			var ok bool
			if err := dbx.QueryRow(ctx, q, `SELECT pg_try_advisory_lock($1::int4, 9)`, []any{key1}, &ok); err != nil || !ok {
				return nil, nil, fmt.Errorf("lock 9: %v %w", ok, err)
			}
			_, err := q.Exec(ctx, `SELECT 1/0`)
			return nil, nil, err
		})
		require.Error(t, err)
		assert.Equal(t, uint64(gen), c.Gen(), "the connection was kept")
		assert.Equal(t, 1, c.Held())
		assert.Equal(t, 1, locksOf(t, pool, key1), "a lock left that the bookkeeping does not hold")
		released, _ := c.Close()
		assert.Equal(t, 1, released)
		assert.Zero(t, locksOf(t, pool, key1))
	})

	t.Run("dropped on their own with no claim", func(t *testing.T) {
		key1 := advisory.Key1(`"conn_test_deferred"`, t.Name())
		c, err := advisory.Open(context.Background(), dbx.NewPgxPool(pool), advisory.Options{Key1: key1})
		require.NoError(t, err)
		_, gen, err := c.TryLock(context.Background(), []int64{1, 2})
		require.NoError(t, err)
		c.DeferUnlock([]int64{1}, gen)
		testdb.Eventually(t, 5*time.Second, "the deferred lock dropped", func() bool {
			return c.Held() == 1 && locksOf(t, pool, key1) == 1
		})
		released, _ := c.Close()
		assert.Equal(t, 1, released)
		assert.Zero(t, locksOf(t, pool, key1))
	})
}

func locksOf(t *testing.T, pool *pgxpool.Pool, key1 int32) int {
	t.Helper()
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND classid = $1::int4::oid`, key1).Scan(&n))
	return n
}

// A1/A4: a lock is taken once: a second TryLock of a held offset neither takes it again (session
// locks are re-entrant) nor returns it; another session cannot take it; Close releases all.
func TestConn_A4_tryLockExactKeysOnce(t *testing.T) {
	t.Parallel()
	key1 := advisory.Key1(`"conn_test_once"`, t.Name())
	pool := testdb.Pgx(t)
	a := open(t, key1, nil)
	b := open(t, key1, nil)

	got, gen, err := a.TryLock(context.Background(), []int64{1, 2, 1 << 33})
	require.NoError(t, err)
	assert.ElementsMatch(t, []int64{1, 2, 1 << 33}, got)
	again, _, err := a.TryLock(context.Background(), []int64{2, 3})
	require.NoError(t, err)
	assert.Equal(t, []int64{3}, again)
	assert.Equal(t, 4, locksOf(t, pool, key1))

	other, _, err := b.TryLock(context.Background(), []int64{1, 2, 3, 4})
	require.NoError(t, err)
	assert.Equal(t, []int64{4}, other)

	n, err := a.Unlock([]int64{2}, gen)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	n, err = a.Unlock([]int64{2}, gen) // not held any more: skipped
	require.NoError(t, err)
	assert.Equal(t, 0, n)

	released, closed := a.Close()
	assert.Equal(t, 3, released)
	assert.True(t, closed)
	released, closed = b.Close()
	assert.Equal(t, 1, released)
	assert.True(t, closed)
	assert.Equal(t, 0, locksOf(t, pool, key1))
	released, closed = a.Close()
	assert.Equal(t, 0, released)
	assert.False(t, closed)
}

// A3: a terminated lock connection reports every lock it held as lost, and is opened again.
func TestConn_A3_terminatedReportsLostAndReconnects(t *testing.T) {
	t.Parallel()
	key1 := advisory.Key1(`"conn_test_lost"`, t.Name())
	pool := testdb.Pgx(t)
	lost := make(chan []int64, 1)
	c := open(t, key1, func(offs []int64) { lost <- offs })
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { c.Run(stop); close(done) }()
	defer func() { close(stop); <-done; c.Close() }()

	_, gen, err := c.TryLock(context.Background(), []int64{7, 8})
	require.NoError(t, err)
	var pid int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT DISTINCT pid FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 2 AND classid = $1::int4::oid`, key1).Scan(&pid))
	_, err = pool.Exec(context.Background(), `SELECT pg_terminate_backend($1)`, pid)
	require.NoError(t, err)

	select {
	case offs := <-lost:
		assert.ElementsMatch(t, []int64{7, 8}, offs)
	case <-time.After(5 * time.Second):
		t.Fatal("the loss was not reported")
	}
	assert.Equal(t, 0, c.Held())
	testdb.Eventually(t, 5*time.Second, "reconnected", func() bool { return c.Reconnects() == 1 })
	assert.NotEqual(t, gen, c.Gen())
	n, err := c.Unlock([]int64{7}, gen) // a lock of the lost generation: nothing to do
	require.NoError(t, err)
	assert.Equal(t, 0, n)
	got, _, err := c.TryLock(context.Background(), []int64{7})
	require.NoError(t, err)
	assert.Equal(t, []int64{7}, got)
}

// A statement asked for after its stop ended does not run, and costs nothing: the connection
// stays open with its locks, not closed as failed, so that the owner's Close drops the locks
// and counts the connection it closes (a subscription's Shutdown cancels its context while its
// claim loop may be about to claim).
func TestConn_statementNotRunWhenStoppedKeepsTheConnection(t *testing.T) {
	t.Parallel()
	key1 := advisory.Key1(`"conn_test_stopped"`, t.Name())
	lost := make(chan []int64, 1)
	c := open(t, key1, func(offs []int64) { lost <- offs })
	_, _, err := c.TryLock(context.Background(), []int64{5})
	require.NoError(t, err)
	stopped, cancel := context.WithCancel(context.Background())
	cancel()
	ran := false
	err = c.Query(stopped, func(context.Context, dbx.Querier) error { ran = true; return nil })
	require.ErrorIs(t, err, advisory.ErrStopped)
	_, err = c.Claim(stopped, func(context.Context, dbx.Querier, []int64, []int64) ([]int64, []int64, error) {
		ran = true
		return nil, nil, nil
	})
	require.ErrorIs(t, err, advisory.ErrStopped)
	assert.False(t, ran)
	select {
	case offs := <-lost:
		t.Fatalf("locks reported lost: %v", offs)
	default:
	}
	assert.Equal(t, 1, c.Held())
	assert.Equal(t, 1, locksOf(t, testdb.Pgx(t), key1))
	released, closed := c.Close()
	assert.Equal(t, 1, released)
	assert.True(t, closed, "Close closed the open connection")
	assert.Equal(t, 0, locksOf(t, testdb.Pgx(t), key1))
}

// A5: a connection whose statements land on different server sessions, as behind a
// transaction-mode pooler, is refused with ErrNotSessionConnection.
func TestOpen_A5_refusesTransactionPooledConnection(t *testing.T) {
	t.Parallel()
	_, err := advisory.Open(context.Background(), pooledLike{dbx.NewPgxPool(testdb.Pgx(t))}, advisory.Options{Key1: advisory.Namespace})
	require.Error(t, err)
	assert.True(t, errors.Is(err, advisory.ErrNotSessionConnection), "got %v", err)
	assert.Contains(t, err.Error(), "PgBouncer")
}

// pooledLike hands out "connections" whose statements alternate between two server sessions.
type pooledLike struct{ *dbx.PgxPool }

func (p pooledLike) Dedicated(ctx context.Context) (dbx.Conn, error) {
	a, err := p.PgxPool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	b, err := p.PgxPool.Acquire(ctx)
	if err != nil {
		a.Release()
		return nil, err
	}
	return &alternating{conns: [2]dbx.Conn{a, b}}, nil
}

type alternating struct {
	conns [2]dbx.Conn
	n     int
}

func (c *alternating) next() dbx.Conn { c.n++; return c.conns[c.n%2] }

func (c *alternating) Exec(ctx context.Context, sql string, args ...any) (int64, error) {
	return c.next().Exec(ctx, sql, args...)
}

func (c *alternating) Query(ctx context.Context, sql string, args ...any) (dbx.Rows, error) {
	return c.next().Query(ctx, sql, args...)
}
func (c *alternating) Begin(ctx context.Context) (dbx.Tx, error) { return c.next().Begin(ctx) }
func (c *alternating) PID(ctx context.Context) (uint32, error)   { return c.conns[0].PID(ctx) }
func (c *alternating) Cancel(ctx context.Context) (bool, error)  { return c.conns[c.n%2].Cancel(ctx) }
func (c *alternating) Release()                                  { c.Destroy() }
func (c *alternating) Destroy()                                  { c.conns[0].Destroy(); c.conns[1].Destroy() }

// A lazy Conn of a pool whose sessions were checked opens no connection until a statement
// needs one: Run does not ping it, nothing of it shows on the server, and its first lock
// opens it (not counted as a reconnect). On a bounded *sql.DB it holds its room from Open
// on, so that a pool without room refuses at Open, lazy or not (C4).
func TestConn_lazyOpensOnFirstStatement(t *testing.T) {
	t.Parallel()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	app := "advisory_lazy_test"
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	own, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(own.Close)
	pool := dbx.NewPgxPool(own)
	key1 := advisory.Key1(`"conn_test_lazy"`, t.Name())
	opts := advisory.Options{Key1: key1, CheckInterval: 20 * time.Millisecond, Lazy: true}
	backends := func() int {
		var n int
		require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(),
			`SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n))
		return n
	}

	first, err := advisory.Open(context.Background(), pool, opts)
	require.NoError(t, err)
	assert.True(t, first.Opened(), "the first lock connection of a pool is opened and checked at once")
	first.Close()
	own.Reset() // the pool's own connections too (the check borrowed one): only a lock connection could show now
	testdb.Eventually(t, 5*time.Second, "the first lock connection gone", func() bool { return backends() == 0 })

	c, err := advisory.Open(context.Background(), pool, opts)
	require.NoError(t, err)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() { c.Run(stop); close(done) }()
	defer func() { close(stop); <-done; c.Close() }()
	time.Sleep(200 * time.Millisecond) // ten CheckIntervals in which Run must not open it
	assert.False(t, c.Opened())
	assert.Zero(t, backends())

	got, _, err := c.TryLock(context.Background(), []int64{3})
	require.NoError(t, err)
	assert.Equal(t, []int64{3}, got)
	assert.True(t, c.Opened())
	assert.Zero(t, c.Reconnects())
	assert.Equal(t, 1, locksOf(t, testdb.Pgx(t), key1))
	assert.Equal(t, 1, backends())

	// A bounded *sql.DB: one lock connection takes its room, a second lazy one is refused at
	// Open (1 + 1 + the spare connections would pass the bound of 3).
	bounded, err := sql.Open("postgres", testdb.URL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = bounded.Close() })
	bounded.SetMaxOpenConns(1 + dbx.StdSpareConns)
	sp := dbx.NewStdPool(bounded)
	one, err := advisory.Open(context.Background(), sp, opts)
	require.NoError(t, err)
	defer one.Close()
	_, err = advisory.Open(context.Background(), sp, opts)
	require.ErrorIs(t, err, dbx.ErrPoolTooSmall)
	one.Close()
	two, err := advisory.Open(context.Background(), sp, opts)
	require.NoError(t, err, "Close gave the room back")
	assert.False(t, two.Opened(), "the pool's sessions were checked by the first")
	two.Close()
}
