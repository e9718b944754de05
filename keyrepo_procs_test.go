package sqlbroker_test

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The environment of TestKeyRepositoryChild: the database ("pgx:" and a name, or "sqlite:" and
// a path), the topic, the key table, the table that records handlings, and the process's name.
const (
	dedupChildDB      = "SQLBROKER_DEDUP_CHILD_DB"
	dedupChildTopic   = "SQLBROKER_DEDUP_CHILD_TOPIC"
	dedupChildKeys    = "SQLBROKER_DEDUP_CHILD_KEYS"
	dedupChildResults = "SQLBROKER_DEDUP_CHILD_RESULTS"
	dedupChildName    = "SQLBROKER_DEDUP_CHILD_NAME"
)

// TestKeyRepositoryChild is a consumer process of
// TestKeyRepository_deduplicatorAcrossTwoProcesses: a Router of consumer group "g" with a
// Deduplicator over a KeyRepository. It records every message that reaches its Router
// (stage "seen") and every one its handler runs for (stage "handled"), prints "ready" once
// the Router runs, and shuts down when its stdin closes.
func TestKeyRepositoryChild(t *testing.T) {
	where := os.Getenv(dedupChildDB)
	if where == "" {
		t.Skip("run by TestKeyRepository_deduplicatorAcrossTwoProcesses")
	}
	topic, keys, results, name := os.Getenv(dedupChildTopic), os.Getenv(dedupChildKeys), os.Getenv(dedupChildResults), os.Getenv(dedupChildName)
	ctx := context.Background()

	var db sqlbroker.DB
	var record func(stage string, m *message.Message) error
	insert := `INSERT INTO "` + results + `" (proc, stage, key) VALUES ($1, $2, $3)`
	if pool, ok := childPool(t, where, 30); ok {
		db = sqlbroker.Pgx(pool)
		record = func(stage string, m *message.Message) error {
			_, err := pool.Exec(ctx, insert, name, stage, m.UUID)
			return err
		}
	} else {
		h, err := sql.Open("sqlite", "file:"+where[len("sqlite:"):]+"?_pragma=busy_timeout(10000)")
		require.NoError(t, err)
		defer h.Close()
		db = sqlbroker.SQLite(h)
		record = func(stage string, m *message.Message) error {
			_, err := h.Exec(insert, name, stage, m.UUID)
			return err
		}
	}

	// The test's own bookkeeping tries again, for a minute at most, when a write fails for
	// a reason of the moment (on SQLite these writes do not queue with the library's writes
	// of the process, and the busy handler can let those pass first until its timeout ends;
	// the shared PostgreSQL server can be out of connections): a handling that was not
	// recorded would read as a message lost.
	once := record
	record = func(stage string, m *message.Message) error {
		deadline := time.Now().Add(time.Minute)
		for {
			err := once(stage, m)
			if err == nil || time.Now().After(deadline) {
				return err
			}
			time.Sleep(20 * time.Millisecond) // a backoff between tries
		}
	}

	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 50 * time.Millisecond, InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer func() { assert.NoError(t, sub.Close()) }()
	repo, err := sqlbroker.NewKeyRepository(db, sqlbroker.KeyRepositoryConfig{Table: keys, Window: time.Hour, InitializeSchema: true})
	require.NoError(t, err)
	defer func() { assert.NoError(t, repo.Close()) }()

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	require.NoError(t, err)
	router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			if err := record("seen", m); err != nil {
				t.Errorf("recording a message seen: %v", err)
				return nil, err
			}
			return h(m)
		}
	})
	router.AddMiddleware((&middleware.Deduplicator{Repository: repo, KeyFactory: middleware.NewMessageHasherSHA256(1 << 20),
		Timeout: 30 * time.Second /* zero means 5ms */}).Middleware)
	router.AddNoPublisherHandler("h", topic, sub, func(m *message.Message) error {
		if err := record("handled", m); err != nil {
			t.Errorf("recording a handling: %v", err)
			return err
		}
		return nil
	})

	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- router.Run(rctx) }()
	<-router.Running()
	fmt.Println("ready")

	_, _ = io.Copy(io.Discard, os.Stdin) // until the parent closes it
	require.NoError(t, router.Close())
	require.NoError(t, <-done)
}

// Watermill's Deduplicator with a KeyRepository in two consumer processes of one consumer
// group, on one database: 1,000 messages, each published twice, are handled exactly once
// each, both processes handle some, and some messages have their two copies delivered to
// different processes. The children run the goroutine-leak check of TestMain when they end.
func TestKeyRepository_deduplicatorAcrossTwoProcesses(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts child processes")
	}
	for _, d := range redriveDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			const n = 1000
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			db, raw, where := d.open(t)
			topic := testdb.Topic(t, "")
			keys := keyTable(t, d.name != "sqlite")
			results := keyTable(t, d.name != "sqlite")
			raw.exec(t, `CREATE TABLE "`+results+`" (proc text NOT NULL, stage text NOT NULL, key text NOT NULL)`)

			// Both consumers run before anything is published, so that neither takes the
			// whole log before the other starts.
			procs := []string{"a", "b"}
			stdins := make([]io.WriteCloser, len(procs))
			exited := make([]chan struct{}, len(procs))
			exitErrs := make([]error, len(procs))
			for i, name := range procs {
				child := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestKeyRepositoryChild$", "-test.count=1")
				child.Env = append(os.Environ(), dedupChildDB+"="+where, dedupChildTopic+"="+topic,
					dedupChildKeys+"="+keys, dedupChildResults+"="+results, dedupChildName+"="+name)
				child.Stderr = os.Stderr
				child.WaitDelay = 10 * time.Second
				stdin, err := child.StdinPipe()
				require.NoError(t, err)
				stdout, err := child.StdoutPipe()
				require.NoError(t, err)
				require.NoError(t, child.Start())
				stdins[i] = stdin
				ready := make(chan bool, 1)
				exited[i] = make(chan struct{})
				go func() {
					defer close(exited[i])
					lines := bufio.NewScanner(stdout)
					found := false
					for lines.Scan() {
						if !found && lines.Text() == "ready" {
							found = true
							ready <- true
							continue
						}
						fmt.Fprintf(os.Stderr, "consumer %s: %s\n", name, lines.Text())
					}
					if !found {
						ready <- false
					}
					exitErrs[i] = child.Wait()
				}()
				// On a failure, the children stop with their stdin, or with ctx.
				t.Cleanup(func() { _ = stdin.Close(); <-exited[i] })
				select {
				case ok := <-ready:
					require.True(t, ok, "consumer %s stopped before it ran", name)
				case <-ctx.Done():
					t.Fatalf("consumer %s not running: %v", name, ctx.Err())
				}
			}

			msgs := make([]*message.Message, n)
			for i := range msgs {
				msgs[i] = message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("payload %d", i)))
			}
			pub := newPublisher(t, db)
			require.NoError(t, pub.Publish(topic, msgs...))
			require.NoError(t, pub.Publish(topic, msgs...), "the same messages again")

			count := func(query string) int { return raw.count(t, query) }
			testdb.Eventually(t, 180*time.Second, "every copy through the Routers", func() bool {
				return count(`SELECT count(*) FROM "`+results+`" WHERE stage = 'seen'`) >= 2*n
			})

			// Both children shut down cleanly, goroutine-leak check included.
			for i, name := range procs {
				require.NoError(t, stdins[i].Close())
				select {
				case <-exited[i]:
					require.NoError(t, exitErrs[i], "consumer %s exits cleanly", name)
				case <-ctx.Done():
					t.Fatalf("consumer %s did not exit: %v", name, ctx.Err())
				}
			}

			handled := `SELECT key FROM "` + results + `" WHERE stage = 'handled'`
			// A copy can reach a Router more than once (a lease that ran out while a slow
			// handler ran): the Deduplicator drops those too.
			t.Logf("%d deliveries of %d copies", count(`SELECT count(*) FROM "`+results+`" WHERE stage = 'seen'`), 2*n)
			assert.Equal(t, n, count(`SELECT count(*) FROM (`+handled+`) h`), "handlings")
			assert.Equal(t, n, count(`SELECT count(DISTINCT key) FROM (`+handled+`) h`), "distinct keys handled")
			assert.Zero(t, count(`SELECT count(*) FROM (`+handled+` GROUP BY key HAVING count(*) > 1) h`), "keys handled more than once")
			assert.Equal(t, n, count(`SELECT count(DISTINCT key) FROM (`+handled+`) h WHERE key IN (`+quotedUUIDs(msgs)+`)`),
				"the keys handled are the messages published")
			for _, name := range procs {
				by := raw.count(t, `SELECT count(*) FROM "`+results+`" WHERE stage = 'handled' AND proc = $1`, name)
				t.Logf("consumer %s handled %d", name, by)
				assert.Positive(t, by, "consumer %s handled none: the other did everything", name)
			}
			split := count(`SELECT count(*) FROM (SELECT key FROM "` + results + `" WHERE stage = 'seen' GROUP BY key HAVING count(DISTINCT proc) = 2) s`)
			t.Logf("%d messages had their two copies delivered to different processes", split)
			assert.Positive(t, split, "no duplicate crossed processes")
		})
	}
}

// quotedUUIDs lists the UUIDs of msgs as SQL string literals, separated by commas (UUIDs hold
// no quote).
func quotedUUIDs(msgs []*message.Message) string {
	q := make([]string, len(msgs))
	for i, m := range msgs {
		q[i] = "'" + m.UUID + "'"
	}
	return strings.Join(q, ", ")
}
