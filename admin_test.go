package sqlbroker_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

func newAdmin(t *testing.T, db sqlbroker.DB) *sqlbroker.Admin {
	t.Helper()
	a, err := sqlbroker.NewAdmin(db, sqlbroker.AdminConfig{})
	require.NoError(t, err)
	return a
}

func groupState(t *testing.T, ins sqlbroker.Inspection, topic, group string) sqlbroker.GroupState {
	t.Helper()
	for _, ts := range ins.Topics {
		if ts.Topic != topic {
			continue
		}
		require.Empty(t, ts.Error)
		for _, g := range ts.Groups {
			if g.Group == group {
				return g
			}
		}
	}
	t.Fatalf("topic %s group %s not in the inspection", topic, group)
	return sqlbroker.GroupState{}
}

// Each figure Inspect reads matches the state the library's statements left, on both drivers,
// and the horizon held back by an open transaction shows as its age and held-back messages.
func TestAdmin_inspectFiguresMatchDatabase(t *testing.T) {
	t.Parallel()
	f := testdb.NewFixture(t)
	pid := f.HoldHorizon(t, 2)
	heldBack := func() int64 {
		return f.Int(t, `SELECT count(*) FROM `+f.Tables.Messages+` m, `+f.Tables.Groups+` g
			WHERE g.consumer_group = 'behind' AND (m.xid, m."offset") > (g.last_xid, g.last_offset)
			  AND m.xid >= pg_snapshot_xmin(pg_current_snapshot())`)
	}
	require.GreaterOrEqual(t, heldBack(), int64(2), "the messages published after the open transaction are held back")
	time.Sleep(20 * time.Millisecond) // the horizon's age and the oldest message's age grow past 0

	for name, db := range map[string]sqlbroker.DB{"pgx": pgxDB(t), "lib/pq": stdDB(t)} {
		t.Run(name, func(t *testing.T) {
			ins, err := newAdmin(t, db).Inspect(context.Background(), sqlbroker.InspectOptions{Topics: []string{f.Topic}, Claims: 100})
			require.NoError(t, err)
			ahead := groupState(t, ins, f.Topic, "ahead")
			behind := groupState(t, ins, f.Topic, "behind")

			assert.Equal(t, int64(6), ahead.Offset)
			assert.Equal(t, int64(6), ahead.Lag, "4 unclaimed and 2 published after the open transaction")
			assert.Equal(t, int64(3), ahead.InWork)
			assert.Equal(t, int64(1), ahead.Waiting)
			assert.Equal(t, int64(2), ahead.Due)
			assert.Equal(t, int64(0), behind.Offset)
			assert.Equal(t, int64(12), behind.Lag)
			assert.False(t, behind.LagEstimated)
			assert.Equal(t, int64(0), behind.InWork+behind.Waiting+behind.Due)
			hb := heldBack()
			assert.Equal(t, hb, behind.HeldBack)
			assert.Equal(t, min(hb, 2), ahead.HeldBack, "the ahead group has passed every message but the last 4+2")

			oldest := time.Duration(f.Int(t, `SELECT (extract(epoch FROM now() - min(created_at)) * 1000)::bigint FROM `+f.Tables.Messages)) * time.Millisecond
			assert.InDelta(t, oldest.Seconds(), behind.OldestUnsettled.Seconds(), 1.0)
			assert.InDelta(t, oldest.Seconds(), ahead.OldestUnsettled.Seconds(), 1.0, "its first claim holds the oldest message")
			assert.Positive(t, behind.OldestUnsettled)

			// The open transaction, or an older one of another test on the same server.
			txAge := time.Duration(f.Int(t, `SELECT (extract(epoch FROM now() - xact_start) * 1000)::bigint FROM pg_stat_activity WHERE pid = $1`, pid)) * time.Millisecond
			assert.GreaterOrEqual(t, ins.Horizon.Age, txAge-time.Second)
			assert.Positive(t, ins.Horizon.Age)
			if ins.Horizon.PID != pid {
				assert.Greater(t, ins.Horizon.Age, txAge-time.Second, "another, older transaction holds the horizon")
			}

			var leased, waiting int
			for _, c := range ins.Topics[0].Claims {
				assert.Equal(t, "ahead", c.Group)
				assert.False(t, c.Advisory)
				if c.Waiting {
					waiting++
					assert.WithinDuration(t, time.Now().Add(time.Hour), c.Deadline, time.Minute)
				} else if c.Deadline.After(time.Now()) {
					leased++
				}
			}
			assert.Equal(t, 3, leased)
			assert.Equal(t, 1, waiting)
		})
	}
}

// The lag is counted up to CountCap; past it, it is estimated from offsets and says so.
func TestAdmin_lagPastTheCapIsEstimated(t *testing.T) {
	t.Parallel()
	f := testdb.NewFixture(t)
	a, err := sqlbroker.NewAdmin(pgxDB(t), sqlbroker.AdminConfig{CountCap: 5})
	require.NoError(t, err)
	ins, err := a.Inspect(context.Background(), sqlbroker.InspectOptions{Topics: []string{f.Topic}})
	require.NoError(t, err)
	behind := groupState(t, ins, f.Topic, "behind")
	assert.True(t, behind.LagEstimated)
	assert.Equal(t, int64(10), behind.Lag, "newest offset 10 minus the group's 0")
}

// Topics lists topics from the catalog, by their names, long ones (whose table names are
// shortened with a hash) included.
func TestAdmin_topicsFoundInCatalog(t *testing.T) {
	t.Parallel()
	short := testdb.Topic(t, "")
	long := "long/" + strings.Repeat("x", 80) + "/" + testdb.Topic(t, "")
	t.Cleanup(func() { testdb.DropTopic(t, "", long) })
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, short, "a")
	publish(t, pub, long, "b")

	a, err := sqlbroker.NewAdmin(stdDB(t), sqlbroker.AdminConfig{MaxTopics: 100000})
	require.NoError(t, err)
	topics, _, err := a.Topics(context.Background())
	require.NoError(t, err)
	assert.Contains(t, topics, short)
	assert.Contains(t, topics, long)

	ins, err := a.Inspect(context.Background(), sqlbroker.InspectOptions{Topics: []string{long}})
	require.NoError(t, err)
	require.Len(t, ins.Topics, 1)
	assert.Empty(t, ins.Topics[0].Error)
}

// After a reset to an offset, the group receives again from that message on; after a reset
// to a time, from the first message written at or after it.
func TestAdmin_resetGroupRedelivers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, numbered(5)...)
	cfg := sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond, MaxInFlight: 1}
	sub := newSubscriber(t, cfg)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for i := range 5 {
		m := receive(t, msgs, 10*time.Second)
		require.Equal(t, numbered(5)[i], string(m.Payload))
		m.Ack()
	}
	testdb.Eventually(t, 10*time.Second, "the acks", func() bool { return sub.Stats().Acked == 5 })
	_, err = sub.Shutdown(ctx)
	require.NoError(t, err)

	a := newAdmin(t, stdDB(t))
	first, err := a.ResetGroup(ctx, topic, "g", 3)
	require.NoError(t, err)
	assert.Equal(t, int64(3), first)

	sub = newSubscriber(t, cfg)
	msgs, err = sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for _, want := range []string{"2", "3", "4"} { // offsets 3, 4, 5
		m := receive(t, msgs, 10*time.Second)
		assert.Equal(t, want, string(m.Payload))
		m.Ack()
	}
	noMessage(t, msgs, 200*time.Millisecond)
	_, err = sub.Shutdown(ctx)
	require.NoError(t, err)

	// By time: the messages written after cut.
	var cut time.Time
	require.NoError(t, testdb.Pgx(t).QueryRow(ctx, "SELECT clock_timestamp()").Scan(&cut))
	publish(t, pub, topic, "after")
	first, err = a.ResetGroupToTime(ctx, topic, "g", cut)
	require.NoError(t, err)
	assert.Equal(t, int64(6), first)
	sub = newSubscriber(t, cfg)
	msgs, err = sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	m := receive(t, msgs, 10*time.Second)
	assert.Equal(t, "after", string(m.Payload))
	m.Ack()

	// Past the newest message: the group receives only what is published next, whose offset
	// ResetGroup returned.
	next, err := a.ResetGroup(ctx, topic, "g", 100)
	require.NoError(t, err)
	assert.Equal(t, int64(7), next)
	noMessage(t, msgs, 200*time.Millisecond)
	publish(t, pub, topic, "next")
	m = receive(t, msgs, 10*time.Second)
	assert.Equal(t, "next", string(m.Payload))
	assert.Equal(t, "7", m.Metadata.Get(sqlbroker.MetadataOffset))
	m.Ack()
	_, err = a.ResetGroup(ctx, topic, "nobody", 1)
	assert.ErrorIs(t, err, sqlbroker.ErrNoGroup)
	assert.Contains(t, err.Error(), topic)
}

// A group that is gone holds retention back until it is deleted; then one retention pass
// deletes what it held.
func TestAdmin_deleteGroupLetsRetentionDelete(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	smallPartitions(t, topic, 1, 5)
	pub := newPublisher(t, pgxDB(t))
	gone := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "gone"})
	_, err := gone.Subscribe(ctx, topic) // creates the group at the oldest message
	require.NoError(t, err)
	_, err = gone.Shutdown(ctx)
	require.NoError(t, err)

	publish(t, pub, topic, numbered(5)...)
	live := newSubscriber(t, sqlbroker.SubscriberConfig{ConsumerGroup: "live", PollInterval: 20 * time.Millisecond})
	msgs, err := live.Subscribe(ctx, topic)
	require.NoError(t, err)
	for range 5 {
		receive(t, msgs, 10*time.Second).Ack()
	}
	testdb.Eventually(t, 10*time.Second, "the acks", func() bool { return live.Stats().Acked == 5 })

	a := newAdmin(t, stdDB(t))
	n, err := a.Prune(ctx, topic, 0)
	require.NoError(t, err)
	assert.Zero(t, n, "the gone group has passed nothing")

	dropped, err := a.DeleteGroup(ctx, topic, "gone")
	require.NoError(t, err)
	assert.Zero(t, dropped)
	n, err = a.Prune(ctx, topic, 0)
	require.NoError(t, err)
	assert.Equal(t, int64(5), n)
	assert.Equal(t, 0, queryInt(t, "SELECT count(*) FROM "+tables(topic).Messages))

	_, err = a.DeleteGroup(ctx, topic, "gone")
	assert.ErrorIs(t, err, sqlbroker.ErrNoGroup)
	assert.Contains(t, err.Error(), `consumer group "gone"`)
}

// The procedure docs/operations.md gives after a dump is restored into another cluster works:
// with the restored rows carrying transaction ids above the new cluster's, a group receives
// nothing (the restored messages are held back, the new ones skipped); after the restored messages are given xid 3 and the group is reset to
// its offset + 1, it receives the rest of the restored messages and the new ones, in order.
func TestAdmin_restoreIntoAnotherCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	pub := newPublisher(t, pgxDB(t))
	publish(t, pub, topic, numbered(4)...)
	cfg := sqlbroker.SubscriberConfig{ConsumerGroup: "g", PollInterval: 20 * time.Millisecond, MaxInFlight: 1}
	sub := newSubscriber(t, cfg)
	msgs, err := sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for range 2 {
		receive(t, msgs, 10*time.Second).Ack()
	}
	testdb.Eventually(t, 10*time.Second, "the acks", func() bool { return sub.Stats().Acked == 2 })
	_, err = sub.Shutdown(ctx)
	require.NoError(t, err)

	// The ids of the old cluster, far above the ones this cluster hands out.
	tb := tables(topic)
	_, err = testdb.Pgx(t).Exec(ctx, `UPDATE `+tb.Messages+` SET xid = (xid::text::bigint + 1000000000)::text::xid8`)
	require.NoError(t, err)
	_, err = testdb.Pgx(t).Exec(ctx, `UPDATE `+tb.Groups+` SET last_xid = (last_xid::text::bigint + 1000000000)::text::xid8`)
	require.NoError(t, err)
	publish(t, pub, topic, "new")

	sub = newSubscriber(t, cfg)
	msgs, err = sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	// The restored messages lie above every running transaction: held back (but a claim
	// given back at the stop is redelivered); "new" sorts before the group's position: skipped.
	deadline := time.After(700 * time.Millisecond)
	for done := false; !done; {
		select {
		case m := <-msgs:
			assert.NotEqual(t, "new", string(m.Payload))
			m.Ack()
		case <-deadline:
			done = true
		}
	}
	_, err = sub.Shutdown(ctx)
	require.NoError(t, err)

	// The procedure, with the group put back at offset 2 (its last offset then) + 1.
	_, err = testdb.Pgx(t).Exec(ctx, `UPDATE `+tb.Messages+` SET xid = '3' WHERE "offset" <= 4`)
	require.NoError(t, err)
	next, err := newAdmin(t, pgxDB(t)).ResetGroup(ctx, topic, "g", 3)
	require.NoError(t, err)
	assert.Equal(t, int64(3), next)
	sub = newSubscriber(t, cfg)
	msgs, err = sub.Subscribe(ctx, topic)
	require.NoError(t, err)
	for _, want := range []string{"2", "3", "new"} {
		m := receive(t, msgs, 10*time.Second)
		assert.Equal(t, want, string(m.Payload))
		m.Ack()
	}
}
