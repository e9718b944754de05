package sqlbroker_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// statementLog records, for every statement that writes into topic's messages table, its
// rows and their payload bytes (a statement-level trigger), and returns a function that reads
// them in order, one [rows, bytes] pair a statement.
func statementLog(t *testing.T, topic string) func() [][2]int {
	t.Helper()
	ctx := context.Background()
	db := testdb.Pgx(t)
	name := "stmtlog_" + strings.TrimPrefix(topic, "t_")
	log, fn := pgx.Identifier{name}.Sanitize(), pgx.Identifier{name + "_fn"}.Sanitize()
	_, err := db.Exec(ctx, `CREATE TABLE `+log+` (id bigserial, n int, bytes bigint)`)
	require.NoError(t, err)
	_, err = db.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
		INSERT INTO `+log+` (n, bytes) SELECT count(*), coalesce(sum(octet_length(payload)), 0) FROM new_rows;
		RETURN NULL; END $$`)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, _ = db.Exec(context.Background(), `DROP FUNCTION IF EXISTS `+fn+` CASCADE`)
		_, _ = db.Exec(context.Background(), `DROP TABLE IF EXISTS `+log)
	})
	_, err = db.Exec(ctx, `CREATE TRIGGER `+pgx.Identifier{name + "_trg"}.Sanitize()+` AFTER INSERT ON `+tables(topic).Messages+
		` REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION `+fn+`()`)
	require.NoError(t, err)
	return func() [][2]int {
		rows, err := db.Query(context.Background(), `SELECT n, bytes FROM `+log+` ORDER BY id`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]int, error) {
			var s [2]int
			return s, r.Scan(&s[0], &s[1])
		})
		require.NoError(t, err)
		return out
	}
}

// sharedPayload makes n messages that share one payload of size bytes (zeros: PostgreSQL
// compresses them, so the rows take little room however large they are).
func sharedPayload(n, size int) []*message.Message {
	payload := make([]byte, size)
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
	}
	return msgs
}

// groupBehindLock publishes one small call, blocked on a table lock, queues one call per
// message of msgs behind it, then lets them all run, and returns each queued call's error.
func groupBehindLock(t *testing.T, pub *sqlbroker.Publisher, topic string, msgs []*message.Message) []error {
	t.Helper()
	release := blockInserts(t, topic)
	leader := publishAsync(pub, topic, message.NewMessage(watermill.NewUUID(), []byte("leader")))
	waitBlocked(t, topic, 1)
	chs := make([]<-chan error, len(msgs))
	for i, m := range msgs {
		chs[i] = publishAsync(pub, topic, m)
	}
	waitQueued(t, pub, topic, len(msgs))
	release()
	require.NoError(t, result(t, leader))
	// The queued calls run one statement after another in the order they were queued, which
	// is not their index order: wait for them together, allowing each its share of the time
	// (a 63 MiB statement takes seconds under the race detector).
	deadline := time.After(15*time.Second + time.Duration(len(msgs))*10*time.Second)
	errs := make([]error, len(msgs))
	for i, ch := range chs {
		select {
		case errs[i] = <-ch:
		case <-deadline:
			t.Fatalf("Publish did not return: call %d of %d still waiting", i, len(msgs))
		}
	}
	return errs
}

// Calls queued together are grouped into statements of at most MaxStatementBytes (its
// default here): three calls of 24 MiB each go into two statements, not one of 72 MiB, and
// each lands, with both drivers.
func TestPublisher_group_boundedByBytes(t *testing.T) {
	t.Parallel()
	for name, db := range drivers(t) {
		t.Run(name, func(t *testing.T) {
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, db)
			publish(t, pub, topic, "creates the tables")
			stmts := statementLog(t, topic)
			msgs := sharedPayload(3, 24<<20)
			for i, err := range groupBehindLock(t, pub, topic, msgs) {
				assert.NoError(t, err, "call %d", i)
			}
			assert.Equal(t, 3, countUUIDs(t, topic, msgs))
			log := stmts()
			t.Logf("statements [rows, payload bytes]: %v", log)
			require.NotEmpty(t, log)
			for _, s := range log {
				assert.LessOrEqual(t, s[1], sqlbroker.DefaultMaxStatementBytes, "a statement of %d rows carries %d bytes", s[0], s[1])
			}
			assert.Equal(t, [][2]int{{1, len("leader")}, {2, 48 << 20}, {1, 24 << 20}}, log, "the calls are grouped up to the bound, in order")
		})
	}
}

// With a small MaxStatementBytes: grouped calls never take a statement past it, a single call
// larger than it is written in several statements of one transaction (whole, in order), and
// a message larger than it goes alone. PostgreSQL's statements are read from a trigger; on
// SQLite, which has no statement trigger, every call lands whole and in order.
func TestPublisher_group_smallStatementBytes(t *testing.T) {
	t.Parallel()
	const limit = 1 << 20
	for _, name := range []string{"pgx", "libpq", "sqlite"} {
		t.Run(name, func(t *testing.T) {
			var db sqlbroker.DB
			raw := rawSQL{pg: testdb.Pgx(t)}
			switch name {
			case "pgx":
				db = pgxDB(t)
			case "libpq":
				db = stdDB(t)
			case "sqlite":
				db, raw = database{name: "sqlite"}.openSQL(t)
			}
			pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true, MaxStatementBytes: limit}, nil)
			require.NoError(t, err)
			t.Cleanup(func() { _ = pub.Close() })
			topic := testdb.Topic(t, "")
			require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("creates the tables"))))
			var stmts func() [][2]int
			if name != "sqlite" {
				stmts = statementLog(t, topic)
			}

			var calls [][]*message.Message
			for c := range 8 {
				n := 1 + c%3 // 1, 2 or 3 messages of 300 KiB: up to 900 KiB a call
				if c == 5 {
					n = 9 // 2.7 MiB: more than one statement holds
				}
				msgs := sharedPayload(n, 300<<10)
				if c == 6 {
					msgs = sharedPayload(1, 3<<20) // one message over the bound: alone
				}
				for i, m := range msgs {
					m.Metadata.Set("call", fmt.Sprint(c))
					m.Metadata.Set("i", fmt.Sprint(i))
				}
				calls = append(calls, msgs)
			}
			var wg sync.WaitGroup
			for c, msgs := range calls {
				wg.Add(1)
				go func() {
					defer wg.Done()
					assert.NoError(t, pub.Publish(topic, msgs...), "call %d", c)
				}()
			}
			wg.Wait()

			// Every call landed whole, its messages consecutive and in its order.
			m := tables(topic).Messages
			for c, msgs := range calls {
				q := `SELECT count(*) FROM ` + m + ` WHERE metadata->>'call' = $1`
				if name == "sqlite" {
					q = `SELECT count(*) FROM ` + m + ` WHERE json_extract(metadata, '$.call') = $1`
				}
				assert.Equal(t, len(msgs), raw.count(t, q, fmt.Sprint(c)), "call %d", c)
			}
			if name == "sqlite" {
				return
			}
			assert.Zero(t, raw.count(t, `SELECT count(*) FROM (
				SELECT metadata->>'call' FROM `+m+` WHERE metadata ? 'call' GROUP BY 1
				HAVING count(DISTINCT xid) <> 1 OR max("offset") - min("offset") + 1 <> count(*)
				    OR array_agg((metadata->>'i')::int ORDER BY "offset") <> array_agg((metadata->>'i')::int ORDER BY (metadata->>'i')::int)
			) bad`), "a call's messages were split across transactions or reordered")
			log := stmts()
			t.Logf("statements [rows, payload bytes]: %v", log)
			for _, s := range log {
				if s[0] == 1 {
					continue // a single message may be larger than the bound
				}
				assert.LessOrEqual(t, s[1], limit, "a statement of %d rows carries %d bytes", s[0], s[1])
			}
		})
	}
}

// A grouped statement near PostgreSQL's 1 GiB limit: 17 concurrent calls of one 63 MiB
// message each (1071 MiB together) all land; merged into one statement they would all fail.
// The calls share one payload, so the test holds little more than one statement in memory.
func TestPublisher_group_realStatementLimit(t *testing.T) {
	if testing.Short() {
		t.Skip("writes about 1 GiB through the server")
	}
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, "creates the tables")
	msgs := sharedPayload(17, 63<<20)
	for i, err := range groupBehindLock(t, pub, topic, msgs) {
		assert.NoError(t, err, "call %d", i)
	}
	assert.Equal(t, 17, countUUIDs(t, topic, msgs))
}

func TestPublisherConfig_maxStatementBytes(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		value int
		want  string
	}{
		{-1, "MaxStatementBytes (-1) must be between 1 and 268435456"},
		{sqlbroker.MaxStatementBytesLimit + 1, "MaxStatementBytes (268435457) must be between 1 and 268435456"},
	} {
		_, err := sqlbroker.NewPublisher(pgxDB(t), sqlbroker.PublisherConfig{MaxStatementBytes: c.value}, nil)
		var cerr *sqlbroker.ConfigError
		require.True(t, errors.As(err, &cerr), "%v", err)
		assert.ErrorContains(t, err, c.want)
	}
}

// A grouped statement that the server refuses for one call's rows (here a trigger of the
// user's refuses a payload) fails that call only: the calls grouped with it are written, each
// alone, with both drivers.
func TestPublisher_group_refusedRowsFailTheirCallOnly(t *testing.T) {
	t.Parallel()
	for name, db := range drivers(t) {
		t.Run(name, func(t *testing.T) {
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, db)
			publish(t, pub, topic, "creates the tables")
			ctx := context.Background()
			fn := pgx.Identifier{"refuse_" + strings.TrimPrefix(topic, "t_")}.Sanitize()
			_, err := testdb.Pgx(t).Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
				IF NEW.payload = 'refused'::bytea THEN RAISE EXCEPTION 'payload refused' USING ERRCODE = 'check_violation'; END IF;
				RETURN NEW; END $$`)
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = testdb.Pgx(t).Exec(context.Background(), `DROP FUNCTION IF EXISTS `+fn+` CASCADE`) })
			_, err = testdb.Pgx(t).Exec(ctx, `CREATE TRIGGER refuse BEFORE INSERT ON `+tables(topic).Messages+` FOR EACH ROW EXECUTE FUNCTION `+fn+`()`)
			require.NoError(t, err)

			msgs := newMessages(3, "fine")
			msgs[1].Payload = []byte("refused")
			errs := groupBehindLock(t, pub, topic, msgs)
			assert.NoError(t, errs[0])
			assert.ErrorContains(t, errs[1], "payload refused")
			assert.NoError(t, errs[2])
			assert.Equal(t, 2, countUUIDs(t, topic, msgs))
		})
	}
}
