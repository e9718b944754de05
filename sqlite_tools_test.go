package sqlbroker_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// StdSQL given a SQLite handle is refused by every constructor, with a ConfigError that says
// to use SQLite, instead of failing later on PostgreSQL's catalog; a PostgreSQL handle is not.
func TestStdSQL_refusesSQLiteHandle(t *testing.T) {
	t.Parallel()
	db := sqlbroker.StdSQL(testdb.SQLite(t))
	_, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	requireConfigError(t, err, "db", "use sqlbroker.SQLite", "modernc.org/sqlite")
	_, err = sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{}, nil)
	requireConfigError(t, err, "db", "use sqlbroker.SQLite")
	_, err = sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{})
	requireConfigError(t, err, "db", "use sqlbroker.SQLite")
	_, err = sqlbroker.NewKeyRepository(db, sqlbroker.KeyRepositoryConfig{})
	requireConfigError(t, err, "db", "use sqlbroker.SQLite")

	_, err = sqlbroker.NewAdmin(sqlbroker.StdSQL(testdb.Std(t)), sqlbroker.AdminConfig{})
	require.NoError(t, err, "lib/pq")
}

// The DDL of SQLiteSchemaSQL, run on a fresh SQLite file, makes the tables the library then
// publishes to and consumes from without InitializeSchema; SQLiteDropSQL drops them, and the
// error that follows points at SQLite's DDL.
func TestSQLiteSchemaSQL_createsWhatTheLibraryNeeds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw := testdb.SQLite(t)
	const topic = "Orders.created" // upper case: SQLite's table names differ from PostgreSQL's
	ddl, err := sqlbroker.SQLiteSchemaSQL(topic, "")
	require.NoError(t, err)
	_, err = raw.ExecContext(ctx, ddl)
	require.NoError(t, err)
	_, err = raw.ExecContext(ctx, ddl)
	require.NoError(t, err, "idempotent")

	db := sqlbroker.SQLite(raw)
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	defer pub.Close()
	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond}, nil)
	require.NoError(t, err)
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	require.NoError(t, pub.Publish(topic, message.NewMessage("a", []byte("1")), message.NewMessage("b", []byte("2"))))
	for _, want := range []string{"a", "b"} {
		m := testdb.Receive(t, msgs, 10*time.Second)
		assert.Equal(t, want, m.UUID)
		m.Ack()
	}
	require.NoError(t, sub.Close())

	_, err = sqlbroker.SchemaSQL(topic, "", "")
	require.NoError(t, err)
	drop, err := sqlbroker.SQLiteDropSQL(topic, "")
	require.NoError(t, err)
	_, err = raw.ExecContext(ctx, drop)
	require.NoError(t, err)
	err = pub.Publish(topic, message.NewMessage("c", nil))
	var missing *sqlbroker.MissingTableError
	require.ErrorAs(t, err, &missing)
	assert.Equal(t, "SQLite", missing.Database)
}

// MissingTableError's advice fits the database it came from: SQLite's DDL on SQLite,
// PostgreSQL's on PostgreSQL.
func TestMissingTableError_advicePerDatabase(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	subscribe := func(db sqlbroker.DB, topic string) *sqlbroker.MissingTableError {
		t.Helper()
		sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{}, nil)
		require.NoError(t, err)
		defer sub.Close()
		_, err = sub.Subscribe(ctx, topic)
		var missing *sqlbroker.MissingTableError
		require.ErrorAs(t, err, &missing)
		return missing
	}
	lite := subscribe(sqlbroker.SQLite(testdb.SQLite(t)), "orders")
	assert.Equal(t, "SQLite", lite.Database)
	assert.Contains(t, lite.Error(), "sqlbroker.SQLiteSchemaSQL(\"orders\"")
	assert.Contains(t, lite.Error(), "InitializeSchema")
	assert.NotContains(t, lite.Error(), "sqlbroker.SchemaSQL(")

	topic := testdb.Topic(t, "")
	pg := subscribe(pgxDB(t), topic)
	assert.Equal(t, "PostgreSQL", pg.Database)
	assert.Contains(t, pg.Error(), "sqlbroker.SchemaSQL(\""+topic+"\"")
	assert.NotContains(t, pg.Error(), "SQLite")
}

// Open's errors that list the URL schemes name sqlite: and mysql:// among them.
func TestOpen_schemeErrorsNameSQLite(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"not a url", "redis://u:secret@h/db"} {
		_, err := sqlbroker.Open(u, sqlbroker.BrokerConfig{}, nil)
		requireConfigError(t, err, "url", "postgres://", "sqlite:", "mysql://")
		assert.NotContains(t, err.Error(), "secret")
	}
}

// One pool, the broker's, serves the broker's publishers and subscribers, an Admin, and the
// caller's own transactions (an outbox publish and an ack in the handler's transaction), on
// SQLite and on PostgreSQL; Shutdown closes it, after which the Admin on it fails.
func TestBroker_DBServesEverything(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"sqlite", "postgres"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, topic := testdb.SQLiteURL(t), "orders"
			if name == "postgres" {
				url, topic = testdb.URL(), testdb.Topic(t, "")
			}
			b, err := sqlbroker.Open(url, sqlbroker.BrokerConfig{MaxConns: 4}, nil)
			require.NoError(t, err)
			defer b.Close()
			require.NoError(t, b.InitializeSchema(ctx, sqlbroker.PublisherConfig{}, topic))

			// The caller's transaction, on the broker's pool.
			var txDB sqlbroker.DB
			var commit func() error
			begin := func() {
				if name == "sqlite" {
					assert.Nil(t, b.PgxPool())
					require.NotNil(t, b.SQLDB())
					assert.Equal(t, 4, b.SQLDB().Stats().MaxOpenConnections, "the broker's own pool")
					tx, err := b.SQLDB().BeginTx(ctx, nil)
					require.NoError(t, err)
					txDB, commit = sqlbroker.SQLiteTx(tx), tx.Commit
					return
				}
				assert.Nil(t, b.SQLDB())
				require.NotNil(t, b.PgxPool())
				assert.Equal(t, int32(4), b.PgxPool().Stat().MaxConns(), "the broker's own pool")
				tx, err := b.PgxPool().Begin(ctx)
				require.NoError(t, err)
				txDB, commit = sqlbroker.PgxTx(tx), func() error { return tx.Commit(ctx) }
			}
			begin()
			pub, err := b.NewTxPublisher(txDB, sqlbroker.PublisherConfig{})
			require.NoError(t, err)
			require.NoError(t, pub.Publish(topic, message.NewMessage("outbox", []byte("x"))))
			require.NoError(t, commit())

			sub, err := b.NewSubscriber(sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond})
			require.NoError(t, err)
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			m := testdb.Receive(t, msgs, 30*time.Second)
			assert.Equal(t, "outbox", m.UUID)
			begin()
			require.NoError(t, sqlbroker.AckInTx(ctx, txDB, m))
			require.NoError(t, commit())
			m.Ack()

			admin, err := sqlbroker.NewAdmin(b.DB(), sqlbroker.AdminConfig{})
			require.NoError(t, err)
			testdb.Eventually(t, 10*time.Second, "the ack in the caller's transaction", func() bool {
				ins, err := admin.Inspect(ctx, sqlbroker.InspectOptions{Topics: []string{topic}, Claims: 10})
				require.NoError(t, err)
				g := ins.Topics[0].Groups
				return len(g) == 1 && g[0].Offset == 1 && g[0].Lag == 0 && g[0].InWork == 0 && len(ins.Topics[0].Claims) == 0
			})
			assert.Zero(t, sub.Stats().StaleSettlements)

			_, err = b.NewTxPublisher(b.DB(), sqlbroker.PublisherConfig{})
			requireConfigError(t, err, "tx", "SQLiteTx", "PgxTx")
			requireConfigError(t, sqlbroker.AckInTx(ctx, b.DB(), m), "tx", "SQLiteTx", "PgxTx")

			_, err = b.Shutdown(ctx)
			require.NoError(t, err)
			ins, err := admin.Inspect(ctx, sqlbroker.InspectOptions{Topics: []string{topic}})
			if err == nil {
				require.Len(t, ins.Topics, 1)
				assert.NotEmpty(t, ins.Topics[0].Error, "the pool is closed")
			}
		})
	}
}

// On SQLite, the Admin finds every topic of the file by its name (also one whose table
// names carry a hash: SQLite compares them without regard to case), and a lag past the
// count cap is estimated from offsets, as on PostgreSQL.
func TestAdmin_sqliteTopicsAndLagPastTheCap(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	raw := testdb.SQLite(t)
	testdb.NewState(t, dbx.NewSQLitePool(raw), "orders", "orders.dead")
	db := sqlbroker.SQLite(raw)
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish("Orders", message.NewMessage("x", nil)))

	admin, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{CountCap: 3})
	require.NoError(t, err)
	topics, more, err := admin.Topics(ctx)
	require.NoError(t, err)
	assert.False(t, more)
	assert.Equal(t, []string{"Orders", "orders", "orders.dead"}, topics)

	ins, err := admin.Inspect(ctx, sqlbroker.InspectOptions{})
	require.NoError(t, err)
	require.Len(t, ins.Topics, 3)
	assert.Equal(t, "Orders", ins.Topics[0].Topic)
	assert.Contains(t, ins.Topics[0].Table, "#", "the upper-case topic's tables")
	assert.Empty(t, ins.Topics[0].Groups)
	g := ins.Topics[1].Groups
	require.Len(t, g, 2)
	assert.Equal(t, []any{"ahead", int64(2), false}, []any{g[0].Group, g[0].Lag, g[0].LagEstimated})
	assert.Equal(t, []any{"behind", int64(10), true}, []any{g[1].Group, g[1].Lag, g[1].LagEstimated})
	assert.Equal(t, int64(3), g[0].InWork, "claims are counted up to the cap")
}
