package sqlbroker_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// An advisory claim that waits longer than LockWaitTimeout for a table lock held elsewhere (a
// migration's LOCK TABLE) is expected contention: it is logged at Info, not at Error, and is
// not counted in Stats().Errors; the claim is tried again and takes the message once the lock
// is gone. On both drivers.
func TestSubscriber_advisoryClaimLockTimeoutLoggedAtInfo(t *testing.T) {
	t.Parallel()
	for _, d := range []database{{"pgx", pgxDB}, {"libpq", stdDB}} {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			db := d.open(t)
			pub := newPublisher(t, db)
			publish(t, pub, topic, "first") // creates the tables
			logger := &levelLogger{}
			sub, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ClaimMode: sqlbroker.ClaimAdvisoryLock, InitializeSchema: true,
				PollInterval: 20 * time.Millisecond, RetryInterval: 50 * time.Millisecond, LockWaitTimeout: 100 * time.Millisecond}, logger)
			require.NoError(t, err)
			t.Cleanup(func() { _ = sub.Close() })
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			receive(t, msgs, 10*time.Second).Ack()

			tx, err := testdb.Pgx(t).Begin(ctx)
			require.NoError(t, err)
			defer func() { _ = tx.Rollback(ctx) }()
			_, err = tx.Exec(ctx, lockTableSQL(tables(topic).Claims))
			require.NoError(t, err)
			// Woken by the publish, the claim meets the lock; the publish itself does not.
			publish(t, pub, topic, "second")
			timedOut := func(level watermill.LogLevel) int {
				return logger.count(level, "LockWaitTimeout")
			}
			testdb.Eventually(t, 10*time.Second, "a claim that ran out of LockWaitTimeout, logged", func() bool {
				return timedOut(watermill.InfoLogLevel)+timedOut(watermill.ErrorLogLevel)+timedOut(watermill.DebugLogLevel) >= 2
			})
			require.NoError(t, tx.Rollback(ctx))
			m := receive(t, msgs, 10*time.Second)
			assert.Equal(t, "second", string(m.Payload))
			m.Ack()

			assert.Zero(t, timedOut(watermill.ErrorLogLevel), "a lock wait that ran out was logged at Error")
			assert.NotZero(t, timedOut(watermill.InfoLogLevel), "a lock wait that ran out was not logged at Info")
			assert.Zero(t, sub.Stats().Errors, "a lock wait that ran out was counted as a database error")
		})
	}
}

// levelLogger records the level of every entry, with its message, error and fields as text;
// safe for concurrent use, read while the subscriber logs.
type levelLogger struct {
	mu      sync.Mutex
	entries []levelEntry
	fields  watermill.LogFields
}

type levelEntry struct {
	level watermill.LogLevel
	text  string
}

func (l *levelLogger) log(level watermill.LogLevel, msg string, err error, fields watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.entries = append(l.entries, levelEntry{level, fmt.Sprint(msg, " ", err, " ", l.fields, " ", fields)})
}

// count returns how many entries at level contain s.
func (l *levelLogger) count(level watermill.LogLevel, s string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, e := range l.entries {
		if e.level == level && strings.Contains(e.text, s) {
			n++
		}
	}
	return n
}

func (l *levelLogger) Error(msg string, err error, fields watermill.LogFields) {
	l.log(watermill.ErrorLogLevel, msg, err, fields)
}
func (l *levelLogger) Info(msg string, fields watermill.LogFields) {
	l.log(watermill.InfoLogLevel, msg, nil, fields)
}
func (l *levelLogger) Debug(msg string, fields watermill.LogFields) {
	l.log(watermill.DebugLogLevel, msg, nil, fields)
}
func (l *levelLogger) Trace(msg string, fields watermill.LogFields) {
	l.log(watermill.TraceLogLevel, msg, nil, fields)
}

// at returns the text of every entry at level.
func (l *levelLogger) at(level watermill.LogLevel) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, e := range l.entries {
		if e.level == level {
			out = append(out, e.text)
		}
	}
	return out
}

// With shares the entries: the subscriber logs through loggers made With its fields.
func (l *levelLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &sharedLevelLogger{l, l.fields.Add(fields)}
}

type sharedLevelLogger struct {
	l      *levelLogger
	fields watermill.LogFields
}

func (s *sharedLevelLogger) Error(msg string, err error, fields watermill.LogFields) {
	s.l.log(watermill.ErrorLogLevel, msg, err, s.fields.Add(fields))
}
func (s *sharedLevelLogger) Info(msg string, fields watermill.LogFields) {
	s.l.log(watermill.InfoLogLevel, msg, nil, s.fields.Add(fields))
}
func (s *sharedLevelLogger) Debug(msg string, fields watermill.LogFields) {
	s.l.log(watermill.DebugLogLevel, msg, nil, s.fields.Add(fields))
}
func (s *sharedLevelLogger) Trace(msg string, fields watermill.LogFields) {
	s.l.log(watermill.TraceLogLevel, msg, nil, s.fields.Add(fields))
}
func (s *sharedLevelLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return &sharedLevelLogger{s.l, s.fields.Add(fields)}
}
