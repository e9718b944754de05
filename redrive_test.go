package sqlbroker_test

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"github.com/jackc/pgx/v5/pgxpool"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// redriveDatabases are the databases of the redrive tests: each gives a DB for the test, a
// handle for raw SQL on the same data, and how a child process opens it.
var redriveDatabases = []struct {
	name string
	open func(t *testing.T) (db sqlbroker.DB, raw rawSQL, child string)
}{
	{"pgx", func(t *testing.T) (sqlbroker.DB, rawSQL, string) {
		return pgxDB(t), rawSQL{pg: testdb.Pgx(t)}, "pgx:redrive-child-" + uuid.NewString()[:8]
	}},
	{"sqlite", func(t *testing.T) (sqlbroker.DB, rawSQL, string) {
		path := testdb.SQLitePath(t)
		h, err := sql.Open("sqlite", "file:"+path)
		require.NoError(t, err)
		t.Cleanup(func() { _ = h.Close() })
		return sqlbroker.SQLite(h), rawSQL{lite: h}, "sqlite:" + path
	}},
}

// childPool opens, in a child process, the pgx pool of a database of redriveDatabases
// ("pgx:" and a name): its connections carry the name as their application_name, so that the
// parent can see them go. It reports false for a SQLite database.
func childPool(t *testing.T, where string, maxConns int) (*pgxpool.Pool, bool) {
	app, ok := strings.CutPrefix(where, "pgx:")
	if !ok {
		return nil, false
	}
	return ownPgxPool(t, app, maxConns), true
}

// deadLetters writes n messages to the dead-letter topic dead as MaxAttempts would have moved
// them from topic, and returns them.
func deadLetters(t *testing.T, db sqlbroker.DB, topic, dead string, n int) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(uuid.NewString(), []byte(fmt.Sprintf("payload %d", i)))
		msgs[i].Metadata.Set(sqlbroker.MetadataDeadLetterTopic, topic)
		msgs[i].Metadata.Set(sqlbroker.MetadataDeadLetterGroup, "g")
		msgs[i].Metadata.Set(sqlbroker.MetadataDeadLetterAttempts, "5")
		msgs[i].Metadata.Set(sqlbroker.MetadataDeadLetterOffset, strconv.Itoa(i+1))
		msgs[i].Metadata.Set("app", "kept")
	}
	require.NoError(t, newPublisher(t, db).Publish(dead, msgs...))
	return msgs
}

// TestRedriveChild is the redriving process of TestRedrive_killedMidwayThenFinished: for
// every line "go" it reads on stdin, it moves up to 10 dead letters in one call and prints how
// many it moved; on "all" it moves every one left, one per transaction.
func TestRedriveChild(t *testing.T) {
	where, dead := os.Getenv("SQLBROKER_REDRIVE_DB"), os.Getenv("SQLBROKER_REDRIVE_TOPIC")
	if where == "" {
		t.Skip("run by TestRedrive_killedMidwayThenFinished")
	}
	var db sqlbroker.DB
	if pool, ok := childPool(t, where, 4); ok {
		db = sqlbroker.Pgx(pool)
	} else {
		h, err := sql.Open("sqlite", "file:"+where[len("sqlite:"):])
		require.NoError(t, err)
		defer h.Close()
		db = sqlbroker.SQLite(h)
	}
	admin, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{})
	require.NoError(t, err)
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		opts := sqlbroker.RedriveOptions{Limit: 10, BatchSize: 10}
		if in.Text() == "all" {
			opts = sqlbroker.RedriveOptions{BatchSize: 1}
		}
		res, err := admin.Redrive(context.Background(), dead, opts)
		require.NoError(t, err)
		fmt.Printf("moved %d\n", res.Moved)
	}
}

// 1,000 dead letters are redriven while a subscriber consumes the original topic; the
// redriving process is killed (SIGKILL) in the middle of its work. Every message is then in
// exactly one of the two topics, none lost; a second redrive moves the rest, and the
// subscriber receives every message.
func TestRedrive_killedMidwayThenFinished(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("starts a child process")
	}
	for _, d := range redriveDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			const n = 1000
			ctx := context.Background()
			db, raw, where := d.open(t)
			topic := testdb.Topic(t, "")
			dead := topic + sqlbroker.DefaultDeadLetterSuffix
			t.Cleanup(func() { testdb.DropTopic(t, "", dead) })
			sent := deadLetters(t, db, topic, dead, n)

			sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 50 * time.Millisecond})
			ch, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			var mu sync.Mutex
			received := map[string]int{}
			go func() {
				for m := range ch {
					mu.Lock()
					received[m.UUID]++
					mu.Unlock()
					assert.Equal(t, "kept", m.Metadata.Get("app"))
					assert.Empty(t, m.Metadata.Get(sqlbroker.MetadataDeadLetterTopic), "the dead-letter keys are dropped")
					assert.Equal(t, "1", m.Metadata.Get(sqlbroker.MetadataRedrives))
					assert.Equal(t, "1", m.Metadata.Get(sqlbroker.MetadataAttempt), "attempts start again")
					m.Ack()
				}
			}()

			child := exec.Command(os.Args[0], "-test.run=^TestRedriveChild$", "-test.count=1")
			child.Env = append(os.Environ(), "SQLBROKER_REDRIVE_DB="+where, "SQLBROKER_REDRIVE_TOPIC="+dead)
			stdin, err := child.StdinPipe()
			require.NoError(t, err)
			stdout, err := child.StdoutPipe()
			require.NoError(t, err)
			child.Stderr = os.Stderr
			require.NoError(t, child.Start())
			lines := bufio.NewScanner(stdout)
			for range 30 {
				_, err := io.WriteString(stdin, "go\n")
				require.NoError(t, err)
				require.True(t, lines.Scan(), "the child stopped: %v", lines.Err())
				require.Equal(t, "moved 10", lines.Text())
			}
			// Then let it move the rest one message per transaction, and kill it on the way.
			_, err = io.WriteString(stdin, "all\n")
			require.NoError(t, err)
			testdb.Eventually(t, 60*time.Second, "the child's last run under way", func() bool {
				return raw.count(t, "SELECT count(*) FROM "+tables(dead).Messages) < n-350
			})
			require.NoError(t, child.Process.Kill())
			_ = child.Wait()
			if app, ok := strings.CutPrefix(where, "pgx:"); ok {
				// The server may still be running the killed process's last transaction, its
				// COMMIT sent before the kill: counted before that ends, a message could be
				// seen in neither table's count, or in both.
				testdb.Eventually(t, 30*time.Second, "the killed process's backends gone", func() bool { return backends(t, app) == 0 })
			}

			left := raw.count(t, "SELECT count(*) FROM "+tables(dead).Messages)
			back := raw.count(t, "SELECT count(*) FROM "+tables(topic).Messages)
			t.Logf("after the kill: %d dead letters left, %d back in the topic", left, back)
			require.True(t, left > 0 && left < n-350, "killed midway: %d left", left)
			assert.Equal(t, n, left+back, "every message in exactly one place")
			assert.Equal(t, n, raw.count(t, "SELECT count(DISTINCT uuid) FROM (SELECT uuid FROM "+tables(dead).Messages+
				" UNION ALL SELECT uuid FROM "+tables(topic).Messages+") u"), "no message lost, none in both")

			admin, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{})
			require.NoError(t, err)
			res, err := admin.Redrive(ctx, dead, sqlbroker.RedriveOptions{})
			require.NoError(t, err)
			assert.Equal(t, int64(left), res.Moved)
			assert.Equal(t, map[string]int64{topic: int64(left)}, res.Topics)
			assert.Zero(t, raw.count(t, "SELECT count(*) FROM "+tables(dead).Messages))
			assert.Equal(t, n, raw.count(t, "SELECT count(*) FROM "+tables(topic).Messages))
			assert.Equal(t, n, raw.count(t, "SELECT count(DISTINCT uuid) FROM "+tables(topic).Messages))

			testdb.Eventually(t, 60*time.Second, "every message received", func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(received) == n
			})
			mu.Lock()
			defer mu.Unlock()
			for _, m := range sent {
				assert.Equal(t, 1, received[m.UUID], "message %s", m.UUID)
			}
		})
	}
}

// -to sends every message to another topic, -limit bounds the move, a dry run moves nothing,
// a message of unknown origin stays, and a missing destination is named.
func TestRedrive_options(t *testing.T) {
	t.Parallel()
	for _, d := range redriveDatabases {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			db, raw, _ := d.open(t)
			topic, other := testdb.Topic(t, ""), testdb.Topic(t, "")
			dead := topic + sqlbroker.DefaultDeadLetterSuffix
			t.Cleanup(func() { testdb.DropTopic(t, "", dead) })
			deadLetters(t, db, topic, dead, 10)
			require.NoError(t, newPublisher(t, db).Publish(dead, message.NewMessage(uuid.NewString(), []byte("orphan"))))
			admin, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{})
			require.NoError(t, err)

			_, err = admin.Redrive(ctx, dead, sqlbroker.RedriveOptions{})
			var missing *sqlbroker.MissingTableError
			require.ErrorAs(t, err, &missing, "the original topic has no tables yet")
			assert.Equal(t, 11, raw.count(t, "SELECT count(*) FROM "+tables(dead).Messages), "nothing moved")

			newPublisher(t, db) // creates no table; the subscriber below does
			newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g"}).Subscribe(ctx, topic)
			newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ConsumerGroup: "g"}).Subscribe(ctx, other)

			res, err := admin.Redrive(ctx, dead, sqlbroker.RedriveOptions{DryRun: true, BatchSize: 3})
			require.NoError(t, err)
			assert.Equal(t, sqlbroker.RedriveResult{Moved: 10, Skipped: 1, Topics: map[string]int64{topic: 10}, DryRun: true}, res)
			assert.Equal(t, 11, raw.count(t, "SELECT count(*) FROM "+tables(dead).Messages), "a dry run moves nothing")

			res, err = admin.Redrive(ctx, dead, sqlbroker.RedriveOptions{Limit: 4, BatchSize: 3})
			require.NoError(t, err)
			assert.Equal(t, int64(4), res.Moved)
			res, err = admin.Redrive(ctx, dead, sqlbroker.RedriveOptions{To: other})
			require.NoError(t, err)
			assert.Equal(t, sqlbroker.RedriveResult{Moved: 7, Topics: map[string]int64{other: 7}}, res)
			assert.Equal(t, 4, raw.count(t, "SELECT count(*) FROM "+tables(topic).Messages))
			assert.Equal(t, 7, raw.count(t, "SELECT count(*) FROM "+tables(other).Messages))
			assert.Zero(t, raw.count(t, "SELECT count(*) FROM "+tables(dead).Messages))

			_, err = admin.Redrive(ctx, dead, sqlbroker.RedriveOptions{To: "bad name"})
			var ne *sqlbroker.NameError
			require.ErrorAs(t, err, &ne)
			assert.Equal(t, "To", ne.Field)
		})
	}
}
