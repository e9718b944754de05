package main

import (
	"context"
	"database/sql"
	"encoding/json"
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

// deadLettered publishes a text and a binary message to a new topic, lets a subscriber with
// MaxAttempts 2 fail each twice so that both move to the dead-letter topic, and adds a message
// that Watermill's PoisonQueue would have published there. It returns the topic, the
// dead-letter topic and the text message's UUID.
func deadLettered(t *testing.T, db sqlbroker.DB, pg bool) (topic, dead, textUUID string) {
	ctx := context.Background()
	topic = "t_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:20]
	dead = topic + sqlbroker.DefaultDeadLetterSuffix
	if pg {
		t.Cleanup(func() { testdb.DropTopic(t, "", topic); testdb.DropTopic(t, "", dead) })
	}
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	text := message.NewMessage(uuid.NewString(), []byte(`{"order": 42, "note": "a rather long payload that the preview cuts"}`))
	text.Metadata.Set("trace_id", "abc123")
	binary := message.NewMessage(uuid.NewString(), []byte{0x00, 0x01, 0xfe, 0xff, 0x10})
	require.NoError(t, pub.Publish(topic, text, binary))

	sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "billing", MaxAttempts: 2, InitializeSchema: true,
		NackBackoff: 10 * time.Millisecond, MaxNackBackoff: 20 * time.Millisecond, PollInterval: 20 * time.Millisecond}, nil)
	require.NoError(t, err)
	defer sub.Close()
	ch, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for range 4 {
		testdb.Receive(t, ch, 30*time.Second).Nack()
	}
	poisoned := message.NewMessage(uuid.NewString(), []byte("poison"))
	poisoned.Metadata.Set(middleware.ReasonForPoisonedKey, "validation failed: no customer")
	poisoned.Metadata.Set(middleware.PoisonedTopicKey, topic)
	testdb.Eventually(t, 30*time.Second, "both messages moved", func() bool {
		admin, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{})
		require.NoError(t, err)
		list, err := admin.DeadLetters(ctx, dead, sqlbroker.ListOptions{})
		return err == nil && list.Total == 2
	})
	require.NoError(t, pub.Publish(dead, poisoned))
	return topic, dead, text.UUID
}

// dead-letter list and peek show what a dead-letter topic holds, as a table and as JSON, on
// PostgreSQL (both drivers' URLs) and SQLite.
func TestCommand_deadLetterListAndPeek(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		open func(t *testing.T) (sqlbroker.DB, string)
	}{
		{"pgx", func(t *testing.T) (sqlbroker.DB, string) { return sqlbroker.Pgx(testdb.Pgx(t)), testdb.URL() }},
		{"lib/pq", func(t *testing.T) (sqlbroker.DB, string) {
			return sqlbroker.Pgx(testdb.Pgx(t)), "libpq+" + testdb.URL()
		}},
		{"sqlite", func(t *testing.T) (sqlbroker.DB, string) {
			path := testdb.SQLitePath(t)
			h, err := sql.Open("sqlite", "file:"+path)
			require.NoError(t, err)
			t.Cleanup(func() { _ = h.Close() })
			return sqlbroker.SQLite(h), "sqlite:" + path
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db, url := c.open(t)
			topic, dead, textUUID := deadLettered(t, db, c.name != "sqlite")

			code, out, stderr := sqlbrokerCmd(t, nil, "dead-letter", "list", dead, "-url", url)
			require.Equal(t, 0, code, stderr)
			lines := strings.Split(strings.TrimSpace(out), "\n")
			require.Len(t, lines, 5, out)
			assert.Equal(t, `topic "`+dead+`": 3 dead letters`, lines[0])
			assert.Equal(t, []string{"OFFSET", "UUID", "MOVED", "AT", "FROM", "TOPIC", "GROUP", "ATTEMPTS", "REDRIVES", "LAST", "ERROR"}, strings.Fields(lines[1]))
			// The two moved messages come in the order they were moved, either.
			for _, l := range lines[2:4] {
				f := strings.Fields(l)
				assert.Equal(t, []string{topic, "billing", "2", "0", "-"}, f[4:])
			}
			assert.Contains(t, lines[2]+lines[3], textUUID)
			assert.Contains(t, lines[4], "validation failed: no customer")
			assert.Contains(t, lines[4], topic)

			code, out, stderr = sqlbrokerCmd(t, nil, "dead-letter", "list", dead, "-json", "-url", url)
			require.Equal(t, 0, code, stderr)
			var list sqlbroker.DeadLetterList
			require.NoError(t, json.Unmarshal([]byte(out), &list))
			require.Len(t, list.Letters, 3)
			text := list.Letters[0]
			if text.UUID != textUUID {
				text = list.Letters[1]
			}
			assert.Equal(t, int64(2), text.Attempts)
			assert.Equal(t, int64(1), text.OriginalOffset)
			assert.Equal(t, topic, text.OriginalTopic)
			assert.Equal(t, "billing", text.Group)
			assert.Equal(t, "abc123", text.Metadata["trace_id"])
			assert.Equal(t, "validation failed: no customer", list.Letters[2].LastError)
			assert.Equal(t, topic, list.Letters[2].OriginalTopic)

			code, out, stderr = sqlbrokerCmd(t, nil, "peek", dead, "-n", "2", "-width", "20", "-url", url)
			require.Equal(t, 0, code, stderr)
			assert.Contains(t, out, "uuid "+textUUID+"  published ")
			assert.Contains(t, out, `  payload: "{\"order\": 42, \"note\""…`)
			assert.Contains(t, out, "  trace_id: abc123")
			assert.Contains(t, out, "  sqlbroker_dead_letter_group: billing")
			assert.Contains(t, out, "  payload: hex:0001feff10\n")
			assert.NotContains(t, out, "offset 3")

			code, out, stderr = sqlbrokerCmd(t, nil, "peek", dead, "-offset", "1", "-json", "-url", url)
			require.Equal(t, 0, code, stderr)
			var peeked []map[string]any
			require.NoError(t, json.Unmarshal([]byte(out), &peeked))
			require.Len(t, peeked, 3)
			for _, p := range peeked[:2] {
				if p["uuid"] == textUUID {
					assert.Contains(t, p["payload_text"], `"order": 42`)
				} else {
					assert.Equal(t, "AAH+/xA=", p["payload"], "binary payloads in base64")
					assert.NotContains(t, p, "payload_text")
				}
			}
			assert.Equal(t, "poison", peeked[2]["payload_text"])

			code, _, stderr = sqlbrokerCmd(t, nil, "peek", "no-such-topic", "-url", url)
			assert.Equal(t, 1, code)
			assert.Contains(t, stderr, "no-such-topic")
			code, _, stderr = sqlbrokerCmd(t, nil, "dead-letter", "list", "-url", url)
			assert.Equal(t, 2, code)
			assert.Contains(t, stderr, "want 1 arguments")

			code, out, stderr = sqlbrokerCmd(t, nil, "dead-letter", "redrive", dead, "-dry-run", "-url", url)
			require.Equal(t, 0, code, stderr)
			assert.Contains(t, out, "would move (dry run) 3 messages")
			code, out, stderr = sqlbrokerCmd(t, nil, "dead-letter", "redrive", dead, "-url", url)
			require.Equal(t, 0, code, stderr)
			assert.Equal(t, []string{topic, "3"}, strings.Fields(strings.Split(out, "\n")[2]))
			code, out, _ = sqlbrokerCmd(t, nil, "dead-letter", "list", dead, "-url", url)
			require.Equal(t, 0, code)
			assert.Equal(t, `topic "`+dead+`": 0 dead letters`+"\n", out)
		})
	}
}

// A sqlite: URL naming no existing file is an error, not a new empty database.
func TestCommand_sqliteFileMustExist(t *testing.T) {
	path := t.TempDir() + "/typo.db"
	code, _, stderr := sqlbrokerCmd(t, nil, "peek", "orders", "-url", "sqlite:"+path)
	assert.Equal(t, 1, code)
	assert.Contains(t, stderr, "typo.db")
}
