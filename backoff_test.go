package sqlbroker_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The default backoff waits DefaultNackBackoff after the first nack, doubles with every
// attempt, adds at most a fifth at random, and stops at MaxNackBackoff; NoBackoff waits not
// at all.
func TestNackBackoff_exponentialCappedWithJitter(t *testing.T) {
	t.Parallel()
	def := sqlbroker.SubscriberConfig{}
	for attempt, base := range map[int]time.Duration{1: time.Second, 2: 2 * time.Second, 3: 4 * time.Second, 6: 32 * time.Second} {
		seen := map[time.Duration]bool{}
		for range 50 {
			d := sqlbroker.NackBackoffFor(def, attempt)
			require.GreaterOrEqual(t, d, base, "attempt %d", attempt)
			require.Less(t, d, base+base/5, "attempt %d", attempt)
			seen[d] = true
		}
		assert.Greater(t, len(seen), 1, "attempt %d: no jitter", attempt)
	}
	for _, attempt := range []int{7, 20, 1000} {
		assert.Equal(t, sqlbroker.DefaultMaxNackBackoff, sqlbroker.NackBackoffFor(def, attempt), "attempt %d", attempt)
	}
	capped := sqlbroker.SubscriberConfig{NackBackoff: 100 * time.Millisecond, MaxNackBackoff: 300 * time.Millisecond}
	assert.Equal(t, 300*time.Millisecond, sqlbroker.NackBackoffFor(capped, 3))
	for _, attempt := range []int{1, 2, 50} {
		assert.Zero(t, sqlbroker.NackBackoffFor(sqlbroker.SubscriberConfig{NackBackoff: sqlbroker.NoBackoff}, attempt))
	}
}

func TestNackBackoff_invalidConfigNamed(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		cfg  sqlbroker.SubscriberConfig
		want string
	}{
		{sqlbroker.SubscriberConfig{NackBackoff: -time.Second}, "NackBackoff (-1s) must not be negative (NoBackoff redelivers at once)"},
		{sqlbroker.SubscriberConfig{MaxNackBackoff: -time.Second}, "MaxNackBackoff"},
		{sqlbroker.SubscriberConfig{NackBackoff: 2 * time.Second, MaxNackBackoff: time.Second}, "MaxNackBackoff (1s) must not be shorter than NackBackoff (2s)"},
	} {
		_, err := sqlbroker.NewSubscriber(pgxDB(t), c.cfg, nil)
		var cerr *sqlbroker.ConfigError
		require.ErrorAs(t, err, &cerr)
		assert.Contains(t, err.Error(), c.want)
	}
	_, err := sqlbroker.NewSubscriber(pgxDB(t), sqlbroker.SubscriberConfig{NackBackoff: sqlbroker.NoBackoff}, nil)
	require.NoError(t, err)
}

// A handler that fails on every message does not spin: each nack waits longer than the one
// before, by the database's clock (the claim's visible_at), in both claim modes.
func TestNackBackoff_growsPerAttempt(t *testing.T) {
	t.Parallel()
	for _, mode := range []sqlbroker.ClaimMode{sqlbroker.ClaimLease, sqlbroker.ClaimAdvisoryLock} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, pgxDB(t))
			base := 150 * time.Millisecond
			sub := newSubscriber(t, sqlbroker.SubscriberConfig{ClaimMode: mode, NackBackoff: base, PollInterval: 20 * time.Millisecond})
			publish(t, pub, topic, "x")
			msgs, err := sub.Subscribe(ctx, topic)
			require.NoError(t, err)
			m := receive(t, msgs, 10*time.Second)
			for attempt := 1; attempt <= 3; attempt++ {
				nacked := time.Now()
				m.Nack()
				m = receive(t, msgs, 20*time.Second)
				want := base << (attempt - 1)
				assert.GreaterOrEqual(t, time.Since(nacked), want, "attempt %d redelivered before its backoff", attempt)
			}
			m.Ack()
			testdb.Eventually(t, 10*time.Second, "the ack", func() bool { return sub.Stats().Acked == 1 })
		})
	}
}
