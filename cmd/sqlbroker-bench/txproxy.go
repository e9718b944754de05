package main

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/url"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// txProxy is a TCP proxy between one contender's connections and the server that counts the
// transactions the server runs for them, exactly and attributed to that contender: every
// ReadyForQuery that leaves a session idle (status 'I') ends one, whether it follows a
// connection's start-up, one statement outside a transaction block, each half of a statement
// sent in two round trips (a prepare, then its execution), or a COMMIT. That is what
// pg_stat_database's xact_commit + xact_rollback count, for the whole database, as each
// backend reports them: once a second at most, and a backend that goes idle less than a
// second after its last report holds its counts back for up to 10 s.
type txProxy struct {
	ln     net.Listener
	target string

	mu    sync.Mutex
	start time.Time
	at    []time.Duration // when each transaction ended, from start
	open  []net.Conn
	wg    sync.WaitGroup
}

// startTxProxy starts a proxy to the server of serverURL and returns it with serverURL
// pointed at it. The connections through it are plain TCP (sslmode=disable): the proxy reads
// the protocol, which TLS would hide.
func startTxProxy(serverURL string) (*txProxy, string, error) {
	cfg, err := pgx.ParseConfig(serverURL)
	if err != nil {
		return nil, "", err
	}
	u, err := url.Parse(serverURL)
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return nil, "", fmt.Errorf("the proxy needs a postgres:// URL")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	p := &txProxy{ln: ln, target: net.JoinHostPort(cfg.Host, fmt.Sprint(cfg.Port)), start: time.Now()}
	p.wg.Add(1)
	go p.accept()
	u.Host = ln.Addr().String()
	q := u.Query()
	q.Set("sslmode", "disable")
	u.RawQuery = q.Encode()
	return p, u.String(), nil
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
		p.open = append(p.open, c, s)
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

// forward copies the server's messages to the client one by one (every message is a type
// byte and a length) and notes every ReadyForQuery with status idle.
func (p *txProxy) forward(client, server net.Conn) {
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
			p.mu.Lock()
			p.at = append(p.at, time.Since(p.start))
			p.mu.Unlock()
		}
		if _, err := client.Write(msg); err != nil {
			return
		}
	}
}

// reset counts from now on.
func (p *txProxy) reset() {
	p.mu.Lock()
	p.start, p.at = time.Now(), nil
	p.mu.Unlock()
}

// between is the number of transactions that ended from a to b after the last reset.
func (p *txProxy) between(a, b time.Duration) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, at := range p.at {
		if at >= a && at < b {
			n++
		}
	}
	return n
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
