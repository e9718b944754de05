package sqlbroker_test

import (
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// cutProxy is a TCP proxy in front of the test database that can cut a connection in the
// middle of a result, the way a restart of the server or a network failure does: once armed,
// the first connection that carries a row (a DataRow message) from the server to the client
// is closed right after that row, before the rest of the result. The client has then seen
// part of a result and no outcome, which a restart of the server produces and which no
// statement timeout or cancellation can.
type cutProxy struct {
	ln     net.Listener
	target string
	armed  atomic.Bool
	cuts   atomic.Int32

	mu    sync.Mutex
	conns []net.Conn
	wg    sync.WaitGroup
}

// newCutProxy starts a proxy to the test database and returns it with a pool whose
// connections go through it. Both are closed when the test ends.
func newCutProxy(t *testing.T) (*cutProxy, *pgxpool.Pool) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, target: net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)

	// Plain TCP through the proxy: no TLS negotiation, whose one-byte answer is not framed.
	addr := ln.Addr().(*net.TCPAddr)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = addr.IP.String(), uint16(addr.Port)
	cfg.ConnConfig.TLSConfig, cfg.ConnConfig.Fallbacks = nil, nil
	pool, err := pgxpool.NewWithConfig(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return p, pool
}

func (p *cutProxy) accept() {
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
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			_, _ = io.Copy(s, c)
			_ = s.Close()
		}()
		go func() {
			defer p.wg.Done()
			p.forward(c, s)
			_ = c.Close()
			_ = s.Close()
		}()
	}
}

// forward copies the server's messages to the client one by one (after the startup, every
// message is a type byte and a length), and stops after a DataRow if the proxy is armed.
func (p *cutProxy) forward(client, server net.Conn) {
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
		if _, err := client.Write(msg); err != nil {
			return
		}
		if head[0] == 'D' && p.armed.CompareAndSwap(true, false) {
			p.cuts.Add(1)
			return
		}
	}
}

func (p *cutProxy) close() {
	_ = p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
