package sqlbroker_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/url"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// txProxy is a TCP proxy in front of the test database that counts the transactions the
// server runs for the connections through it, as pg_stat_database counts them: every
// ReadyForQuery that leaves the session idle (status 'I') ends one, whether it follows a
// connection's start-up, one statement outside a transaction block, each half of a statement
// sent in two round trips (a prepare, then its execution), or a COMMIT or ROLLBACK. Counted
// at the protocol, so exactly, for every driver, and for this test's connections only.
type txProxy struct {
	ln     net.Listener
	target string
	start  time.Time

	mu    sync.Mutex
	at    []time.Duration // when each transaction ended, from start
	what  []string        // and the statements it ran (their first words)
	conns int
	open  []net.Conn
	wg    sync.WaitGroup
}

// txConn is what the proxy knows of one connection: the statements sent since the last
// transaction ended.
type txConn struct {
	mu    sync.Mutex
	stmts []string
}

// newTxProxy starts a proxy to the test database and returns it with the test database's
// URL pointed at it (plain TCP: no TLS negotiation, whose one-byte answer is not framed).
func newTxProxy(t *testing.T) (*txProxy, string) {
	t.Helper()
	u, err := url.Parse(testdb.URL())
	require.NoError(t, err)
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &txProxy{ln: ln, target: net.JoinHostPort(cfg.ConnConfig.Host, fmt.Sprint(cfg.ConnConfig.Port)), start: time.Now()}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	u.Host = ln.Addr().String()
	q := u.Query()
	q.Set("sslmode", "disable")
	u.RawQuery = q.Encode()
	return p, u.String()
}

func (p *txProxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.mu.Lock()
		p.conns++
		p.open = append(p.open, c, s)
		p.mu.Unlock()
		tc := &txConn{}
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			p.sent(tc, c, s)
			_ = s.Close()
		}()
		go func() {
			defer p.wg.Done()
			p.forward(tc, c, s)
			_ = c.Close()
			_ = s.Close()
		}()
	}
}

// sent copies the client's messages to the server: the start-up message (a length and its
// body), then messages of a type byte and a length, noting the SQL of every simple query
// ('Q') and of every statement prepared ('P').
func (p *txProxy) sent(tc *txConn, client, server net.Conn) {
	head := make([]byte, 5)
	if _, err := io.ReadFull(client, head[:4]); err != nil {
		return
	}
	startup := make([]byte, int(binary.BigEndian.Uint32(head[:4])))
	copy(startup, head[:4])
	if _, err := io.ReadFull(client, startup[4:]); err != nil {
		return
	}
	if _, err := server.Write(startup); err != nil {
		return
	}
	tc.mu.Lock()
	tc.stmts = append(tc.stmts, "(connection start-up)")
	tc.mu.Unlock()
	for {
		if _, err := io.ReadFull(client, head); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(head[1:])) - 4
		if n < 0 {
			return
		}
		msg := make([]byte, 5+n)
		copy(msg, head)
		if _, err := io.ReadFull(client, msg[5:]); err != nil {
			return
		}
		body := msg[5:]
		switch head[0] {
		case 'Q':
			tc.note(body)
		case 'P':
			if i := bytes.IndexByte(body, 0); i >= 0 {
				tc.note(body[i+1:])
			}
		case 'B':
			tc.mu.Lock()
			if len(tc.stmts) == 0 {
				tc.stmts = append(tc.stmts, "(a statement prepared before)")
			}
			tc.mu.Unlock()
		}
		if _, err := server.Write(msg); err != nil {
			return
		}
	}
}

var quotedName = regexp.MustCompile(`"[^"]*"`)

// note keeps the first words of a statement's SQL (a NUL-terminated string), table names
// folded, so that statements of every topic read alike.
func (tc *txConn) note(sql []byte) {
	if i := bytes.IndexByte(sql, 0); i >= 0 {
		sql = sql[:i]
	}
	s := quotedName.ReplaceAllString(strings.Join(strings.Fields(string(sql)), " "), `"t"`)
	if len(s) > 70 {
		s = s[:70]
	}
	tc.mu.Lock()
	tc.stmts = append(tc.stmts, s)
	tc.mu.Unlock()
}

// forward copies the server's messages to the client one by one (every message is a type
// byte and a length) and notes every ReadyForQuery with status idle.
func (p *txProxy) forward(tc *txConn, client, server net.Conn) {
	head := make([]byte, 5)
	for {
		if _, err := io.ReadFull(server, head); err != nil {
			return
		}
		n := int(binary.BigEndian.Uint32(head[1:])) - 4
		if n < 0 {
			return
		}
		msg := make([]byte, 5+n)
		copy(msg, head)
		if _, err := io.ReadFull(server, msg[5:]); err != nil {
			return
		}
		if head[0] == 'Z' && n == 1 && msg[5] == 'I' {
			tc.mu.Lock()
			what := strings.Join(tc.stmts, " + ")
			tc.stmts = tc.stmts[:0]
			tc.mu.Unlock()
			if what == "" {
				what = "(nothing)"
			}
			p.mu.Lock()
			p.at = append(p.at, time.Since(p.start))
			p.what = append(p.what, what)
			p.mu.Unlock()
		}
		if _, err := client.Write(msg); err != nil {
			return
		}
	}
}

// reset starts the count again from now.
func (p *txProxy) reset() {
	p.mu.Lock()
	p.start, p.at, p.what, p.conns = time.Now(), nil, nil, 0
	p.mu.Unlock()
}

// count returns the transactions ended within d of the last reset, by second, and the
// connections opened since.
func (p *txProxy) count(d time.Duration) (total int, perSecond []int, conns int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	perSecond = make([]int, int((d+time.Second-1)/time.Second))
	for _, at := range p.at {
		if at < d {
			total++
			perSecond[int(at/time.Second)]++
		}
	}
	return total, perSecond, p.conns
}

// kinds lists the transactions ended within d of the last reset by what they ran, the most
// frequent first.
func (p *txProxy) kinds(d time.Duration) string {
	p.mu.Lock()
	byWhat := map[string]int{}
	for i, at := range p.at {
		if at < d {
			byWhat[p.what[i]]++
		}
	}
	p.mu.Unlock()
	keys := make([]string, 0, len(byWhat))
	for k := range byWhat {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		return byWhat[keys[i]] > byWhat[keys[j]] || byWhat[keys[i]] == byWhat[keys[j]] && keys[i] < keys[j]
	})
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "\n%5d  %s", byWhat[k], k)
	}
	return b.String()
}

func (p *txProxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	for _, c := range p.open {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// What subscribing costs the database: 20 idle subscriptions, each to a topic of its own,
// in both claim modes and through both drivers, run at most 3 transactions each in their
// first 15 s: the claim that found nothing, a statement prepared then run (two; in the
// advisory mode the look on the pool that stands for it), and one transaction that checks
// the tables and writes the consumer group's row. Besides, a few once per pool (below). The
// interval of the shared poll is set beyond the window (its one statement per 64 idle
// subscriptions is the steady state, not the start-up); no publisher or NOTIFY wakes
// anything here.
func TestIdle_subscribeCostsFewTransactions(t *testing.T) {
	t.Parallel()
	const n, window, poolConns = 20, 15 * time.Second, 4
	for _, mode := range claimModes {
		for _, driver := range []string{"pgx", "libpq"} {
			t.Run(mode.String()+"/"+driver, func(t *testing.T) {
				t.Parallel()
				topics := make([]string, n)
				init := newSubscriberOn(t, pgxDB(t), sqlbroker.SubscriberConfig{})
				for i := range topics {
					topics[i] = testdb.Topic(t, "")
					require.NoError(t, init.SubscribeInitialize(topics[i]))
				}
				proxy, proxied := newTxProxy(t)
				cfg := sqlbroker.SubscriberConfig{ConsumerGroup: "g", ClaimMode: mode, IdlePollInterval: time.Minute}
				var db sqlbroker.DB
				if driver == "pgx" {
					pc, err := pgxpool.ParseConfig(proxied)
					require.NoError(t, err)
					pc.MaxConns = poolConns
					pool, err := pgxpool.NewWithConfig(context.Background(), pc)
					require.NoError(t, err)
					t.Cleanup(pool.Close)
					db = sqlbroker.Pgx(pool)
				} else {
					std, err := sql.Open("postgres", proxied)
					require.NoError(t, err)
					if mode == sqlbroker.ClaimAdvisoryLock {
						std.SetMaxOpenConns(poolConns + n) // its lock connections come out of it
					} else {
						std.SetMaxOpenConns(poolConns)
					}
					std.SetMaxIdleConns(poolConns)
					t.Cleanup(func() { _ = std.Close() })
					db = sqlbroker.StdSQL(std)
					cfg.PollInterval = time.Minute // database/sql cannot listen: its shared poll runs every PollInterval
				}
				sub, err := sqlbroker.NewSubscriber(db, cfg, nil)
				require.NoError(t, err)
				t.Cleanup(func() { _ = sub.Close() })

				proxy.reset()
				for _, topic := range topics {
					_, err := sub.Subscribe(context.Background(), topic)
					require.NoError(t, err)
				}
				time.Sleep(window) // counting: nothing to wait for
				total, perSecond, conns := proxy.count(window)
				t.Logf("%d transactions in %s (by second: %v), %d connections opened", total, window, perSecond, conns)

				// Besides: each connection opened, its start-up (and, through database/sql, its
				// backend pid, asked once); the LISTEN, and the shared poll's look once it is in
				// place; in the advisory mode, once per pool, the first subscription opens its
				// lock connection and checks its session (settings, four probes prepared then
				// run, the pin by another connection: 12 or so), and its first claim round runs
				// on it (an orphan search and a claim, 4, instead of the look on the pool, 2).
				// The other subscriptions open theirs only once they have work.
				besides := 2*conns + 3
				if mode == sqlbroker.ClaimAdvisoryLock {
					besides += 16
				}
				assert.LessOrEqual(t, total, n*3+besides, "transactions of %d idle subscriptions in their first %s, by what they ran:%s", n, window, proxy.kinds(window))
				assert.Zero(t, sub.Stats().Errors)
			})
		}
	}
}

// A LISTEN connection that comes back after a loss wakes no subscription by itself: the
// pool's shared poll looks once for the parked ones and pokes those with work (the
// notifications sent meanwhile were missed). A message nobody announced, written before the
// cut, is found by that look, although here the shared poll runs only every minute and the
// subscriptions claim by themselves only every 30; the other 19 idle subscriptions run
// nothing. (Waking all of them made each claim, then claim again at doubling intervals in
// case the xmin horizon held an announced message back: about six claims each.)
func TestIdle_listenBackLooksOnceForAll(t *testing.T) {
	t.Parallel()
	const n = 20
	ctx := context.Background()
	topics := make([]string, n)
	init := newSubscriberOn(t, pgxDB(t), sqlbroker.SubscriberConfig{})
	for i := range topics {
		topics[i] = testdb.Topic(t, "")
		require.NoError(t, init.SubscribeInitialize(topics[i]))
	}
	proxy, proxied := newTxProxy(t)
	pc, err := pgxpool.ParseConfig(proxied)
	require.NoError(t, err)
	app := "sqlbroker_relisten_" + strings.ToLower(topics[0][len(topics[0])-8:])
	pc.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	sub, err := sqlbroker.NewSubscriber(sqlbroker.Pgx(pool), sqlbroker.SubscriberConfig{ConsumerGroup: "g", IdlePollInterval: time.Minute}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	chans := make([]<-chan *message.Message, n)
	for i, topic := range topics {
		chans[i], err = sub.Subscribe(ctx, topic)
		require.NoError(t, err)
	}
	listener := func() int {
		return queryInt(t, `SELECT coalesce(max(pid), 0) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'`, app)
	}
	testdb.Eventually(t, 10*time.Second, "the LISTEN connection listening", func() bool { return listener() != 0 })
	testdb.Eventually(t, 10*time.Second, "the subscriptions quiet", func() bool {
		proxy.reset()
		time.Sleep(300 * time.Millisecond)
		total, _, _ := proxy.count(time.Minute)
		return total == 0
	})

	store := offsets.NewStore(tables(topics[n-1]), false)
	require.NoError(t, store.Insert(ctx, dbx.NewPgxPool(testdb.Pgx(t)), []offsets.Row{{UUID: "unannounced", Payload: []byte("x"), Metadata: "{}"}}, ""))
	old := listener()
	proxy.reset()
	queryInt(t, `SELECT count(*) FROM (SELECT pg_terminate_backend($1)) x`, old)
	m := receive(t, chans[n-1], 10*time.Second)
	assert.Equal(t, "unannounced", m.UUID)
	m.Ack()
	testdb.Eventually(t, 10*time.Second, "the ack applied", func() bool { return sub.Stats().Acked == 1 })
	assert.NotEqual(t, old, listener(), "the LISTEN connection came back")
	time.Sleep(2 * time.Second) // counting: nothing to wait for
	total, perSecond, conns := proxy.count(10 * time.Second)
	t.Logf("%d transactions after the LISTEN connection was cut (by second: %v), %d connections opened", total, perSecond, conns)
	// The new LISTEN connection (start-up, LISTEN), the shared poll's look (prepared, then run,
	// on a connection that had not run it), and the one delivery (its claims, prepared on a
	// connection that had not run them, and the ack), and connections the pool opened.
	assert.LessOrEqual(t, total, 2+2+6+2*conns, "transactions after the LISTEN connection came back, by what they ran:%s", proxy.kinds(10*time.Second))
}
