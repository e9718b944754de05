package sqlbrokerprom_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
	"github.com/sqlbroker/watermill-sqlbroker/sqlbrokerprom"
)

// scrape gathers the collector's metrics through a registry, as a Prometheus server would, and
// indexes them by name and label values.
func scrape(t *testing.T, c prometheus.Collector) map[string]map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]map[string]float64{}
	for _, mf := range mfs {
		byLabels := map[string]float64{}
		for _, m := range mf.GetMetric() {
			key := ""
			for _, l := range m.GetLabel() {
				key += l.GetName() + "=" + l.GetValue() + ","
			}
			byLabels[key] = value(m)
		}
		out[mf.GetName()] = byLabels
	}
	return out
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	}
	return 0
}

func labels(topic, group string) string { return "consumer_group=" + group + ",topic=" + topic + "," }

// A scrape reports each figure as the database holds it: the lag of a group that is behind,
// the claims in work, waiting and due, the oldest unsettled message's age, and the horizon
// held back by an open transaction, with the messages it holds back.
func TestCollector_scrapeMatchesDatabase(t *testing.T) {
	t.Parallel()
	f := testdb.NewFixture(t)
	pid := f.HoldHorizon(t, 2)
	time.Sleep(20 * time.Millisecond) // ages grow past 0

	c := sqlbrokerprom.NewCollector(sqlbroker.StdSQL(testdb.Std(t)), sqlbrokerprom.Options{Topics: []string{f.Topic}})
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)

	got := scrape(t, c)
	ahead, behind := labels(f.Topic, "ahead"), labels(f.Topic, "behind")
	heldBack := f.Int(t, `SELECT count(*) FROM `+f.Tables.Messages+` m, `+f.Tables.Groups+` g
		WHERE g.consumer_group = 'behind' AND (m.xid, m."offset") > (g.last_xid, g.last_offset)
		  AND m.xid >= pg_snapshot_xmin(pg_current_snapshot())`)
	claims := func(cond string) float64 {
		return float64(f.Int(t, `SELECT coalesce(sum(cardinality(c.offsets)), 0) FROM `+f.Tables.Claims+` c JOIN `+f.Tables.Groups+` g USING (group_id)
			WHERE g.consumer_group = 'ahead' AND `+cond))
	}
	lagOf := func(group string) float64 {
		return float64(f.Int(t, `SELECT count(*) FROM `+f.Tables.Messages+` m, `+f.Tables.Groups+` g
			WHERE g.consumer_group = $1 AND (m.xid, m."offset") > (g.last_xid, g.last_offset)`, group))
	}

	assert.Equal(t, lagOf("behind"), got["sqlbroker_group_lag_messages"][behind])
	assert.Equal(t, 12.0, got["sqlbroker_group_lag_messages"][behind], "the group that is behind")
	assert.Equal(t, lagOf("ahead"), got["sqlbroker_group_lag_messages"][ahead])
	assert.Equal(t, 0.0, got["sqlbroker_group_lag_estimated"][behind])
	assert.Equal(t, claims(`token > 0 AND visible_at > now()`), got["sqlbroker_group_claims_in_work"][ahead])
	assert.Equal(t, 3.0, got["sqlbroker_group_claims_in_work"][ahead])
	assert.Equal(t, claims(`token <= 0 AND visible_at > now()`), got["sqlbroker_group_claims_waiting"][ahead])
	assert.Equal(t, 1.0, got["sqlbroker_group_claims_waiting"][ahead])
	assert.Equal(t, claims(`visible_at <= now()`), got["sqlbroker_group_claims_due"][ahead])
	assert.Equal(t, 2.0, got["sqlbroker_group_claims_due"][ahead])
	assert.Equal(t, 0.0, got["sqlbroker_group_claims_in_work"][behind])
	assert.Equal(t, float64(heldBack), got["sqlbroker_group_held_back_messages"][behind])
	assert.GreaterOrEqual(t, got["sqlbroker_group_held_back_messages"][behind], 2.0)
	assert.Equal(t, 6.0, got["sqlbroker_group_position_offset"][ahead])

	oldest := float64(f.Int(t, `SELECT (extract(epoch FROM now() - min(created_at)) * 1000)::bigint FROM `+f.Tables.Messages)) / 1000
	assert.InDelta(t, oldest, got["sqlbroker_group_oldest_unsettled_age_seconds"][behind], 1.0)
	assert.Positive(t, got["sqlbroker_group_oldest_unsettled_age_seconds"][behind])

	txAge := float64(f.Int(t, `SELECT (extract(epoch FROM now() - xact_start) * 1000)::bigint FROM pg_stat_activity WHERE pid = $1`, pid)) / 1000
	assert.GreaterOrEqual(t, got["sqlbroker_xmin_horizon_age_seconds"][""], txAge-1, "the open transaction, or an older one")
	assert.Positive(t, got["sqlbroker_xmin_horizon_age_seconds"][""])
	assert.Equal(t, 0.0, got["sqlbroker_scrape_error"][""])
	assert.Equal(t, 0.0, got["sqlbroker_topic_scrape_error"]["topic="+f.Topic+","])
}

// The counters of the subscribers are exported per consumer group and claim mode, summed over
// the subscribers that share them.
func TestCollector_subscriberCounters(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	db := sqlbroker.Pgx(testdb.Pgx(t))
	pub, err := sqlbroker.NewPublisher(db, sqlbroker.PublisherConfig{InitializeSchema: true}, nil)
	require.NoError(t, err)
	defer pub.Close()
	require.NoError(t, pub.Publish(topic, message.NewMessage(watermill.NewUUID(), []byte("a")), message.NewMessage(watermill.NewUUID(), []byte("b"))))

	var subs []*sqlbroker.Subscriber
	for range 2 {
		s, err := sqlbroker.NewSubscriber(db, sqlbroker.SubscriberConfig{ConsumerGroup: "workers", InitializeSchema: true, PollInterval: 20 * time.Millisecond, MaxInFlight: 1}, nil)
		require.NoError(t, err)
		defer s.Close()
		subs = append(subs, s)
	}
	var chs []<-chan *message.Message
	for _, s := range subs {
		ch, err := s.Subscribe(ctx, topic)
		require.NoError(t, err)
		chs = append(chs, ch)
	}
	next := func() *message.Message {
		select {
		case m := <-chs[0]:
			return m
		case m := <-chs[1]:
			return m
		case <-time.After(10 * time.Second):
			t.Fatal("no message within 10s")
			return nil
		}
	}
	next().Ack()
	next().Nack()
	next().Ack() // the nacked message, again
	testdb.Eventually(t, 10*time.Second, "the acks and the nack", func() bool {
		return subs[0].Stats().Acked+subs[1].Stats().Acked == 2 && subs[0].Stats().Nacked+subs[1].Stats().Nacked == 1
	})

	c := sqlbrokerprom.NewCollector(db, sqlbrokerprom.Options{SkipDatabase: true}, subs...)
	got := scrape(t, c)
	l := "claim_mode=lease,consumer_group=workers,"
	assert.Equal(t, 2.0, got["sqlbroker_subscriber_acked_total"][l])
	assert.Equal(t, 1.0, got["sqlbroker_subscriber_nacked_total"][l])
	assert.Equal(t, float64(subs[0].Stats().Claimed+subs[1].Stats().Claimed), got["sqlbroker_subscriber_claimed_total"][l])
	assert.GreaterOrEqual(t, got["sqlbroker_subscriber_claimed_total"][l], 3.0)
	assert.Len(t, got["sqlbroker_subscriber_acked_total"], 1, "one series for both subscribers")
	for name, v := range map[string]int64{
		"sqlbroker_subscriber_dead_lettered_total": subs[0].Stats().DeadLettered + subs[1].Stats().DeadLettered,
		"sqlbroker_subscriber_handed_over_total":   subs[0].Stats().HandedOver + subs[1].Stats().HandedOver,
	} {
		if assert.Contains(t, got, name) {
			assert.Equal(t, float64(v), got[name][l], name)
		}
	}
	assert.NotContains(t, got, "sqlbroker_group_lag_messages")
}

// A scrape is bounded: when the database does not answer within the timeout, the collector
// reports the scrape error instead of hanging, and the subscribers' counters are still there.
func TestCollector_scrapeBoundedByTimeout(t *testing.T) {
	t.Parallel()
	f := testdb.NewFixture(t)
	// A migration's lock on the groups table: the scrape's read would wait on it.
	tx, err := f.Pool.Begin(context.Background())
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(context.Background()) }()
	_, err = tx.Exec(context.Background(), "LOCK TABLE "+f.Tables.Groups+" IN ACCESS EXCLUSIVE MODE")
	require.NoError(t, err)

	c := sqlbrokerprom.NewCollector(sqlbroker.Pgx(testdb.Pgx(t)), sqlbrokerprom.Options{
		Topics: []string{f.Topic},
		Admin:  sqlbroker.AdminConfig{StatementTimeout: 200 * time.Millisecond},
	})
	start := time.Now()
	got := scrape(t, c)
	assert.Less(t, time.Since(start), 5*time.Second)
	assert.Equal(t, 1.0, got["sqlbroker_topic_scrape_error"]["topic="+f.Topic+","])
	assert.NotContains(t, got, "sqlbroker_group_lag_messages")
}
