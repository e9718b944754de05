package sqlbroker_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func pgxDB(t *testing.T) sqlbroker.DB { return sqlbroker.Pgx(testdb.Pgx(t)) }
func stdDB(t *testing.T) sqlbroker.DB { return sqlbroker.StdSQL(testdb.Std(t)) }

func newPublisher(t *testing.T, db sqlbroker.DB) *sqlbroker.Publisher {
	t.Helper()
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	return pub
}

func newSubscriber(t *testing.T, cfg sqlbroker.SubscriberConfig) *sqlbroker.Subscriber {
	t.Helper()
	cfg.InitializeSchema = true
	sub, err := sqlbroker.NewSubscriber(pgxDB(t), cfg, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

func publish(t *testing.T, pub message.Publisher, topic string, payloads ...string) []*message.Message {
	t.Helper()
	msgs := make([]*message.Message, len(payloads))
	for i, p := range payloads {
		msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(p))
	}
	require.NoError(t, pub.Publish(topic, msgs...))
	return msgs
}

// numbered returns the payloads "0" to n-1, as strings.
func numbered(n int) []string {
	ps := make([]string, n)
	for i := range ps {
		ps[i] = strconv.Itoa(i)
	}
	return ps
}

// receive reads one message from ch within timeout.
var receive = testdb.Receive

// noMessage asserts that nothing arrives for d: it checks that something is held back, not
// how fast anything is.
func noMessage(t *testing.T, ch <-chan *message.Message, d time.Duration) {
	t.Helper()
	select {
	case m, ok := <-ch:
		if ok {
			t.Fatalf("unexpected message %s (payload %q)", m.UUID, m.Payload)
		}
	case <-time.After(d):
	}
}

func tables(topic string) offsets.Tables { return offsets.NewTables("", "sqlbroker_", topic) }

func queryInt(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}
