package sqlbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

var _ middleware.ExpiringKeyRepository = (*sqlbroker.KeyRepository)(nil)
var _ middleware.ExpiringKeyRepository = (*sqlbroker.KeyRepositoryTx)(nil)

// keyTable returns a table name of the test's own, dropped (on PostgreSQL) when it ends.
func keyTable(t *testing.T, pg bool) string {
	name := "dedup_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:16]
	if pg {
		t.Cleanup(func() {
			_, err := testdb.Pgx(t).Exec(context.Background(), `DROP TABLE IF EXISTS "`+name+`"`)
			assert.NoError(t, err)
		})
	}
	return name
}

// keyDatabases are the databases a KeyRepository runs on, each with a second handle on the
// same data (a second process would have its own).
var keyDatabases = []struct {
	name string
	open func(t *testing.T) (a, b sqlbroker.DB)
}{
	{"pgx", func(t *testing.T) (sqlbroker.DB, sqlbroker.DB) { return pgxDB(t), pgxDB(t) }},
	{"database/sql", func(t *testing.T) (sqlbroker.DB, sqlbroker.DB) { return stdDB(t), stdDB(t) }},
	{"sqlite", func(t *testing.T) (sqlbroker.DB, sqlbroker.DB) {
		path := testdb.SQLitePath(t)
		open := func() sqlbroker.DB {
			h, err := sql.Open("sqlite", "file:"+path)
			require.NoError(t, err)
			t.Cleanup(func() { _ = h.Close() })
			return sqlbroker.SQLite(h)
		}
		return open(), open()
	}},
}

// A key is new once, a duplicate within the window, new again after it; keys are bytes
// (hashers return raw checksums); expired keys are pruned; a missing table is named.
func TestKeyRepository_window(t *testing.T) {
	t.Parallel()
	for _, d := range keyDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, other := d.open(t)
			table := keyTable(t, d.name != "sqlite")

			missing, err := sqlbroker.NewKeyRepository(db, sqlbroker.KeyRepositoryConfig{Table: table, PruneInterval: -1})
			require.NoError(t, err)
			_, err = missing.IsDuplicate(ctx, "k")
			require.Error(t, err)
			assert.Contains(t, err.Error(), table)
			assert.Contains(t, err.Error(), "InitializeSchema")
			require.NoError(t, missing.Close())

			repo, err := sqlbroker.NewKeyRepository(db, sqlbroker.KeyRepositoryConfig{Table: table, Window: 2 * time.Second, InitializeSchema: true, PruneInterval: -1})
			require.NoError(t, err)
			defer repo.Close()
			peer, err := sqlbroker.NewKeyRepository(other, sqlbroker.KeyRepositoryConfig{Table: table, Window: 2 * time.Second, InitializeSchema: true, PruneInterval: -1})
			require.NoError(t, err)
			defer peer.Close()

			binary := "\x00\xff\xfe" + "k"
			for _, key := range []string{"a", binary} {
				dup, err := repo.IsDuplicate(ctx, key)
				require.NoError(t, err)
				assert.False(t, dup, "first sighting of %q", key)
				dup, err = peer.IsDuplicate(ctx, key)
				require.NoError(t, err)
				assert.True(t, dup, "second sighting of %q, by another handle", key)
			}
			dup, err := repo.IsDuplicate(ctx, "\x00\xff\xfe")
			require.NoError(t, err)
			assert.False(t, dup, "a prefix of a key is another key")

			testdb.Eventually(t, 10*time.Second, "the key to expire", func() bool {
				dup, err := peer.IsDuplicate(ctx, "a")
				require.NoError(t, err)
				return !dup
			})
			dup, err = repo.IsDuplicate(ctx, "a")
			require.NoError(t, err)
			assert.True(t, dup, "written again when it had expired")

			testdb.Eventually(t, 10*time.Second, "the expired keys to be pruned", func() bool {
				_, err := repo.Prune(ctx)
				require.NoError(t, err)
				return repo.Pruned() >= 3
			})
		})
	}
}

// The background pruning deletes expired keys and stops with Close.
func TestKeyRepository_backgroundPrune(t *testing.T) {
	t.Parallel()
	for _, d := range keyDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, _ := d.open(t)
			repo, err := sqlbroker.NewKeyRepository(db, sqlbroker.KeyRepositoryConfig{Table: keyTable(t, d.name != "sqlite"),
				Window: 50 * time.Millisecond, PruneInterval: 100 * time.Millisecond, InitializeSchema: true})
			require.NoError(t, err)
			for i := range 20 {
				_, err := repo.IsDuplicate(ctx, fmt.Sprint(i))
				require.NoError(t, err)
			}
			testdb.Eventually(t, 20*time.Second, "the background pruning", func() bool { return repo.Pruned() == 20 })
			require.NoError(t, repo.Close())
			require.NoError(t, repo.Close(), "idempotent")
		})
	}
}

func TestKeyRepository_badConfig(t *testing.T) {
	_, err := sqlbroker.NewKeyRepository(sqlbroker.DB{}, sqlbroker.KeyRepositoryConfig{})
	var ce *sqlbroker.ConfigError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "db", ce.Field)
	_, err = sqlbroker.NewKeyRepository(pgxDB(t), sqlbroker.KeyRepositoryConfig{Table: `x"; DROP TABLE y; --`})
	var ne *sqlbroker.NameError
	require.ErrorAs(t, err, &ne)
	assert.Equal(t, "Table", ne.Field)
	_, err = sqlbroker.NewKeyRepository(pgxDB(t), sqlbroker.KeyRepositoryConfig{Window: time.Microsecond})
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "Window", ce.Field)
	ddl, err := sqlbroker.KeyRepositorySchemaSQL("", "")
	require.NoError(t, err)
	assert.Contains(t, ddl, `"sqlbroker_dedup_keys"`)
	_, err = sqlbroker.KeyRepositorySchemaSQL("", strings.Repeat("k", 60))
	require.ErrorAs(t, err, &ne)
}

// Watermill's Deduplicator with a KeyRepository under two Routers (two subscribers of one
// consumer group, each with its own handle on the database and its own repository, as two
// consumer processes would have): 1,000 messages each published twice are handled exactly
// once each.
func TestKeyRepository_deduplicatorAcrossTwoConsumers(t *testing.T) {
	t.Parallel()
	for _, d := range keyDatabases {
		if d.name == "database/sql" {
			continue // the same statements as pgx; the window test covers the driver
		}
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			const n = 1000
			ctx := context.Background()
			a, b := d.open(t)
			topic := testdb.Topic(t, "")
			table := keyTable(t, d.name != "sqlite")

			msgs := make([]*message.Message, n)
			for i := range msgs {
				msgs[i] = message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("payload %d", i)))
			}
			pub := newPublisher(t, a)
			require.NoError(t, pub.Publish(topic, msgs...))
			require.NoError(t, pub.Publish(topic, msgs...), "the same messages again")

			var mu sync.Mutex
			handled := map[string]int{}
			var passed atomic.Int64
			run := func(db sqlbroker.DB) {
				sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 50 * time.Millisecond})
				repo, err := sqlbroker.NewKeyRepository(db, sqlbroker.KeyRepositoryConfig{Table: table, Window: time.Hour, InitializeSchema: true})
				require.NoError(t, err)
				t.Cleanup(func() { _ = repo.Close() })
				router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
				require.NoError(t, err)
				router.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
					return func(m *message.Message) ([]*message.Message, error) {
						passed.Add(1)
						return h(m)
					}
				})
				router.AddMiddleware((&middleware.Deduplicator{Repository: repo, KeyFactory: middleware.NewMessageHasherSHA256(1 << 20),
					Timeout: 30 * time.Second /* zero means 5ms */}).Middleware)
				router.AddNoPublisherHandler("h", topic, sub, func(m *message.Message) error {
					mu.Lock()
					handled[string(m.Payload)]++
					mu.Unlock()
					return nil
				})
				rctx, cancel := context.WithCancel(ctx)
				done := make(chan struct{})
				go func() { defer close(done); _ = router.Run(rctx) }()
				<-router.Running()
				t.Cleanup(func() { cancel(); _ = router.Close(); <-done })
			}
			run(a)
			run(b)
			testdb.Eventually(t, 120*time.Second, "every copy through the Routers", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return passed.Load() >= 2*n && len(handled) == n
			})
			mu.Lock()
			defer mu.Unlock()
			for _, m := range msgs {
				assert.Equal(t, 1, handled[string(m.Payload)], "message %s", m.UUID)
			}
		})
	}
}

// Inside the handler's transaction (WithTx) with AckInTx, the key commits with the handler's
// writes and the ack: a handler that fails after checking the key rolls the key back with its
// work, so the redelivery is handled, not dropped; a copy published again is dropped.
func TestKeyRepository_inTheHandlersTransaction(t *testing.T) {
	t.Parallel()
	const n = 100
	ctx := context.Background()
	pool := testdb.Pgx(t)
	db := sqlbroker.Pgx(pool)
	topic := testdb.Topic(t, "")
	effects := keyTable(t, true)
	_, err := pool.Exec(ctx, `CREATE TABLE "`+effects+`" (payload text NOT NULL)`)
	require.NoError(t, err)
	repo, err := sqlbroker.NewKeyRepository(db, sqlbroker.KeyRepositoryConfig{Table: keyTable(t, true), Window: time.Hour, InitializeSchema: true})
	require.NoError(t, err)
	defer repo.Close()

	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(uuid.NewString(), []byte(fmt.Sprint(i)))
	}
	pub := newPublisher(t, db)
	require.NoError(t, pub.Publish(topic, msgs...))
	require.NoError(t, pub.Publish(topic, msgs...))

	var mu sync.Mutex
	failed := map[string]bool{}
	var calls atomic.Int64
	sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", NackBackoff: 10 * time.Millisecond, MaxNackBackoff: 20 * time.Millisecond, PollInterval: 50 * time.Millisecond})
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, nil)
	require.NoError(t, err)
	router.AddNoPublisherHandler("h", topic, sub, sqlbroker.PgxTxHandler(pool, func(ctx context.Context, tx pgx.Tx, m *message.Message) error {
		calls.Add(1)
		dup, err := repo.WithTx(sqlbroker.PgxTx(tx)).IsDuplicate(ctx, m.UUID)
		if err != nil || dup {
			return err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO "`+effects+`" VALUES ($1)`, string(m.Payload)); err != nil {
			return err
		}
		mu.Lock()
		first := !failed[m.UUID]
		failed[m.UUID] = true
		mu.Unlock()
		if first {
			return errors.New("fails once, after writing")
		}
		return nil
	}))
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = router.Run(rctx) }()
	<-router.Running()
	defer func() { cancel(); _ = router.Close(); <-done }()

	count := func(q string) int {
		var c int
		require.NoError(t, pool.QueryRow(ctx, q).Scan(&c))
		return c
	}
	testdb.Eventually(t, 60*time.Second, "every message settled", func() bool {
		return count(`SELECT count(*) FROM "`+effects+`"`) == n && count(`SELECT count(*) FROM `+tables(topic).Claims) == 0 && calls.Load() >= 3*n
	})
	assert.Equal(t, n, count(`SELECT count(DISTINCT payload) FROM "`+effects+`"`), "each message's work committed once")
}
