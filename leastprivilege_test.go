package sqlbroker_test

import (
	"context"
	"database/sql"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// grantsFor returns the grants docs/least-privilege.md gives for a role that runs the library on
// tables a migration role created: the minimal rights per table, USAGE on the messages
// table's sequence (its offsets' default draws from it) and EXECUTE on the function that adds
// partitions. No right on the groups table's identity sequence is needed: PostgreSQL does not
// check it for a GENERATED ... AS IDENTITY column.
func grantsFor(topic, role string) []string {
	t := tables(topic)
	stem := pgx.Identifier{strings.TrimSuffix(strings.Trim(t.Messages, `"`), "_messages")}.Sanitize()
	stem = strings.TrimSuffix(stem, `"`)
	r := " TO " + pgx.Identifier{role}.Sanitize()
	return []string{
		"GRANT SELECT, INSERT ON " + t.Messages + r,
		"GRANT SELECT, INSERT, UPDATE ON " + t.Groups + r,
		"GRANT SELECT, INSERT, UPDATE, DELETE ON " + t.Claims + r,
		"GRANT USAGE ON SEQUENCE " + stem + `_m_seq"` + r,
		"GRANT EXECUTE ON FUNCTION " + stem + `_m_extend"(bigint, bigint)` + r,
	}
}

func newMsg(payload string) *message.Message {
	return message.NewMessage(watermill.NewUUID(), []byte(payload))
}

// roleURL is the test database's URL with another user (trust authentication lets any role in).
func roleURL(t *testing.T, role string) string {
	u, err := url.Parse(testdb.URL())
	require.NoError(t, err)
	u.User = url.User(role)
	return u.String()
}

// The library runs under a role that has only data rights on a topic's tables (SELECT and
// INSERT on messages, SELECT, INSERT and UPDATE on groups, all four on claims, USAGE on the
// messages' sequence, EXECUTE on the function that adds partitions), the tables having been
// created by another role: it publishes (past the partitions made ahead), subscribes (with and
// without InitializeSchema, which then only checks the tables), acks and nacks, on both
// drivers and in every claim mode that is built.
func TestLeastPrivilege_publishAndConsume(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := testdb.Pgx(t)
	topic := testdb.Topic(t, "")
	// The migration role (here the superuser) creates the tables.
	ddl, err := sqlbroker.SchemaSQL(topic, "", "")
	require.NoError(t, err)
	_, err = admin.Exec(ctx, ddl)
	require.NoError(t, err)
	// Room for 4 messages: the publishes below run past it, and add partitions through the
	// function that runs with the owner's rights.
	testdb.SmallPartitions(t, tables(topic), 2, 2)

	role := "sqlbroker_lp_" + strings.ToLower(watermill.NewShortUUID())
	_, err = admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN")
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = admin.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)
		_, err := admin.Exec(ctx, "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		assert.NoError(t, err)
		_, err = admin.Exec(ctx, "DROP ROLE "+pgx.Identifier{role}.Sanitize())
		assert.NoError(t, err)
	})

	// Without the grants, the role is refused by the database, and the error says so.
	pool, err := pgxpool.New(ctx, roleURL(t, role))
	require.NoError(t, err)
	defer pool.Close()
	std, err := sql.Open("postgres", roleURL(t, role))
	require.NoError(t, err)
	defer std.Close()
	pub, err := sqlbroker.NewPublisher(sqlbroker.Pgx(pool), sqlbroker.PublisherConfig{}, nil)
	require.NoError(t, err)
	err = pub.Publish(topic, newMsg("refused"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "permission denied")
	require.NoError(t, pub.Close())

	for _, g := range grantsFor(topic, role) {
		_, err = admin.Exec(ctx, g)
		require.NoError(t, err, g)
	}

	for _, mode := range []sqlbroker.ClaimMode{sqlbroker.ClaimLease, sqlbroker.ClaimAdvisoryLock} {
		for name, db := range map[string]sqlbroker.DB{"pgx": sqlbroker.Pgx(pool), "libpq": sqlbroker.StdSQL(std)} {
			for _, initialize := range []bool{false, true} {
				group := mode.String() + "_" + name
				if initialize {
					group += "_init"
				}
				sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{
					ConsumerGroup: group, ClaimMode: mode, InitializeSchema: initialize, PollInterval: 20 * time.Millisecond,
				}, nil)
				var cerr *sqlbroker.ConfigError
				if errors.As(err, &cerr) && strings.Contains(cerr.Reason, "not available") {
					t.Logf("claim mode %s skipped: %v", mode, err)
					continue
				}
				require.NoError(t, err)
				pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: initialize}, nil)
				require.NoError(t, err)
				sent := newMsg(group)
				require.NoError(t, pub.Publish(topic, sent), group)

				subCtx, cancel := context.WithCancel(ctx)
				msgs, err := sub.Subscribe(subCtx, topic)
				require.NoError(t, err, group)
				// The group starts at the oldest message: find ours, nack it once, then ack
				// everything.
				nacked := false
				for done := false; !done; {
					m := receive(t, msgs, 10*time.Second)
					switch {
					case m.UUID == sent.UUID && !nacked:
						nacked = true
						m.Nack()
					case m.UUID == sent.UUID:
						assert.Equal(t, "2", m.Metadata.Get(sqlbroker.MetadataAttempt), group)
						m.Ack()
						done = true
					default:
						m.Ack()
					}
				}
				testdb.Eventually(t, 10*time.Second, "the ack of "+group, func() bool { return sub.Stats().Acked > 0 && sub.Stats().InFlight == 0 })
				assert.Positive(t, sub.Stats().Nacked, group)
				assert.Zero(t, sub.Stats().Errors, group)
				cancel()
				rep, err := sub.Shutdown(ctx)
				require.NoError(t, err, group)
				assert.Zero(t, rep.DeliveriesInWork, group)
				require.NoError(t, pub.Close())
			}
		}
	}
	// The role created nothing of its own.
	assert.Equal(t, 0, queryInt(t, "SELECT count(*) FROM pg_class WHERE relowner = (SELECT oid FROM pg_roles WHERE rolname = $1)", role))
}
