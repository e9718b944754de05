// Package sqlbrokerprom exports the state of watermill-sqlbroker's topics and consumer groups,
// and the counters of a process's subscribers, as Prometheus metrics. It is a package of its
// own so that the library does not import Prometheus.
//
// One line registers it:
//
//	prometheus.MustRegister(sqlbrokerprom.NewCollector(db, sqlbrokerprom.Options{}, sub1, sub2))
//
// At every scrape the collector reads, per topic and consumer group, the lag, the claims in
// work, waiting and due, the age of the oldest unsettled message and the messages the oldest
// running transaction holds back, and, once for the cluster, that transaction's age. Each
// topic costs one statement, bounded on the server (statement_timeout), each count stops at
// a cap, and at most MaxTopics topics of MaxGroups groups are read, so the series are bounded
// by topics x groups. The subscribers' counters are read from memory: a scrape never waits on
// a subscriber's work or its statements.
//
// It reads PostgreSQL, SQLite and MySQL alike. On SQLite and MySQL, where offsets commit in
// order and no transaction holds a message back, the held-back messages and the xmin horizon
// have no meaning: their series are not exported, and the others mean what they mean on
// PostgreSQL. On SQLite the reads take no write lock.
//
// The metrics and what to alert on are described in the repository's docs/operations.md.
package sqlbrokerprom

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
)

// DefaultTimeout bounds one scrape's reads of the database.
const DefaultTimeout = 10 * time.Second

// Options configures a Collector.
type Options struct {
	// Admin says where the tables are (Schema, TablePrefix) and bounds the reads (MaxTopics,
	// MaxGroups, CountCap, StatementTimeout); see sqlbroker.AdminConfig for the defaults.
	Admin sqlbroker.AdminConfig

	// Topics are the topics to read; nil reads every topic found in the catalog, up to
	// Admin.MaxTopics.
	Topics []string

	// Timeout bounds the reads of one scrape. Defaults to DefaultTimeout.
	Timeout time.Duration

	// SkipDatabase reads nothing from the database: only the subscribers' counters are
	// exported (for a process that is not the one meant to report the topics' state).
	// Defaults to false.
	SkipDatabase bool
}

// Collector is a prometheus.Collector of watermill-sqlbroker's metrics.
type Collector struct {
	admin *sqlbroker.Admin
	opts  Options
	subs  []*sqlbroker.Subscriber
}

var _ prometheus.Collector = (*Collector)(nil)

const ns = "sqlbroker"

var (
	groupLabels = []string{"topic", "consumer_group"}
	subLabels   = []string{"consumer_group", "claim_mode"}

	descLag          = prometheus.NewDesc(ns+"_group_lag_messages", "Messages after the consumer group's position: published and not yet handed out to it. Exact up to the count cap, estimated from offsets past it (see sqlbroker_group_lag_estimated).", groupLabels, nil)
	descLagEstimated = prometheus.NewDesc(ns+"_group_lag_estimated", "1 when sqlbroker_group_lag_messages passed the count cap and is the newest offset minus the group's.", groupLabels, nil)
	descInWork       = prometheus.NewDesc(ns+"_group_claims_in_work", "Messages claimed by a consumer of the group and not settled: leased, or held by an advisory lock.", groupLabels, nil)
	descParked       = prometheus.NewDesc(ns+"_group_parked_messages", "Messages of a group ordered by key that wait behind an earlier message of their key.", groupLabels, nil)
	descWaiting      = prometheus.NewDesc(ns+"_group_claims_waiting", "Nacked messages waiting for their backoff before they can be claimed again.", groupLabels, nil)
	descDue          = prometheus.NewDesc(ns+"_group_claims_due", "Messages due again now: nacked or given back with their backoff passed, or whose lease ran out.", groupLabels, nil)
	descHeldBack     = prometheus.NewDesc(ns+"_group_held_back_messages", "Committed messages after the group's position that the oldest running transaction of the cluster holds back from delivery (counted up to the cap).", groupLabels, nil)
	descOldest       = prometheus.NewDesc(ns+"_group_oldest_unsettled_age_seconds", "Age of the oldest message the group has not settled (claimed and not acked, or not yet handed out); 0 when there is none.", groupLabels, nil)
	descOffset       = prometheus.NewDesc(ns+"_group_position_offset", "Offset of the last message handed out to the group.", groupLabels, nil)
	descHorizon      = prometheus.NewDesc(ns+"_xmin_horizon_age_seconds", "Age of the oldest transaction of the cluster that holds a transaction id; messages published after it started are delivered only once it ends. 0 when none runs.", nil, nil)
	descTopicError   = prometheus.NewDesc(ns+"_topic_scrape_error", "1 when the topic's state could not be read at this scrape.", []string{"topic"}, nil)
	descScrapeError  = prometheus.NewDesc(ns+"_scrape_error", "1 when this scrape could not read the database (listing topics or the horizon failed, or the scrape timed out).", nil, nil)
	descMoreTopics   = prometheus.NewDesc(ns+"_topics_truncated", "1 when the catalog holds more topics than the collector reads (MaxTopics).", nil, nil)
	descDuration     = prometheus.NewDesc(ns+"_scrape_duration_seconds", "Time the collector spent reading the database at this scrape.", nil, nil)

	descClaimed      = prometheus.NewDesc(ns+"_subscriber_claimed_total", "Messages claimed by the process's subscribers, first deliveries and redeliveries.", subLabels, nil)
	descAcked        = prometheus.NewDesc(ns+"_subscriber_acked_total", "Acks applied.", subLabels, nil)
	descNacked       = prometheus.NewDesc(ns+"_subscriber_nacked_total", "Nacks applied.", subLabels, nil)
	descReleased     = prometheus.NewDesc(ns+"_subscriber_released_total", "Claims given back without reaching a handler (at shutdown or when a subscription stops).", subLabels, nil)
	descStale        = prometheus.NewDesc(ns+"_subscriber_stale_settlements_total", "Acks and nacks refused because the claim was no longer the delivery's (its lease ran out and the message was claimed again, or its lock connection died).", subLabels, nil)
	descLost         = prometheus.NewDesc(ns+"_subscriber_leases_lost_total", "Deliveries whose claim was lost while their handler ran.", subLabels, nil)
	descErrors       = prometheus.NewDesc(ns+"_subscriber_errors_total", "Database errors met by claims, lease extensions and settlements.", subLabels, nil)
	descInFlight     = prometheus.NewDesc(ns+"_subscriber_in_flight", "Messages claimed by the process's subscribers and not yet settled.", subLabels, nil)
	descDeadLettered = prometheus.NewDesc(ns+"_subscriber_dead_lettered_total", "Messages moved to the dead-letter topic after MaxAttempts deliveries (counted in sqlbroker_subscriber_nacked_total too).", subLabels, nil)
	descHandedOver   = prometheus.NewDesc(ns+"_subscriber_handed_over_total", "Messages of a group ordered by key claimed by the ack of the message before them of their key (PostgreSQL; counted in sqlbroker_subscriber_claimed_total too).", subLabels, nil)
	descLocks        = prometheus.NewDesc(ns+"_subscriber_locks_held", "Advisory locks held by the subscribers' lock connections (advisory mode).", subLabels, nil)
)

// NewCollector builds the collector: it reads the topics' state through db (which must wrap
// a pool, Pgx, StdSQL, SQLite or MySQL, or be a Broker's DB; one connection at a time, for the
// length of a scrape) and the counters of subs. With Options.SkipDatabase, db may be the zero DB. It panics when db or
// the options are invalid, as prometheus.MustRegister does for its own errors: registration
// runs once, at start.
func NewCollector(db sqlbroker.DB, opts Options, subs ...*sqlbroker.Subscriber) *Collector {
	c, err := New(db, opts, subs...)
	if err != nil {
		panic(err)
	}
	return c
}

// New is NewCollector returning its error.
func New(db sqlbroker.DB, opts Options, subs ...*sqlbroker.Subscriber) (*Collector, error) {
	if opts.Timeout == 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.Topics != nil {
		// A topic named twice would export its series twice, which a registry refuses.
		seen := map[string]bool{}
		topics := []string{}
		for _, t := range opts.Topics {
			if !seen[t] {
				seen[t] = true
				topics = append(topics, t)
			}
		}
		opts.Topics = topics
	}
	c := &Collector{opts: opts, subs: subs}
	if !opts.SkipDatabase {
		a, err := sqlbroker.NewAdmin(db, opts.Admin)
		if err != nil {
			return nil, err
		}
		c.admin = a
	}
	return c, nil
}

// Describe sends the descriptions of every metric.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		descClaimed, descAcked, descNacked, descReleased, descStale, descLost, descErrors, descDeadLettered, descHandedOver,
		descInFlight, descLocks,
	} {
		ch <- d
	}
	if c.admin == nil {
		return
	}
	for _, d := range []*prometheus.Desc{
		descLag, descLagEstimated, descInWork, descWaiting, descParked, descDue, descHeldBack, descOldest, descOffset,
		descHorizon, descTopicError, descScrapeError, descMoreTopics, descDuration,
	} {
		ch <- d
	}
}

// Collect reads the subscribers' counters, then the database.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.collectStats(ch)
	if c.admin != nil {
		c.collectDatabase(ch)
	}
}

// collectStats sums the counters of the subscribers that share a consumer group and claim
// mode (one series per pair, whatever the number of subscribers).
func (c *Collector) collectStats(ch chan<- prometheus.Metric) {
	type key struct{ group, mode string }
	sums := map[key]*sqlbroker.Stats{}
	var order []key
	for _, s := range c.subs {
		k := key{s.ConsumerGroup(), s.ClaimMode().String()}
		st := s.Stats()
		sum := sums[k]
		if sum == nil {
			sum = &sqlbroker.Stats{}
			sums[k] = sum
			order = append(order, k)
		}
		sum.Claimed += st.Claimed
		sum.Acked += st.Acked
		sum.Nacked += st.Nacked
		sum.Released += st.Released
		sum.StaleSettlements += st.StaleSettlements
		sum.LeasesLost += st.LeasesLost
		sum.Errors += st.Errors
		sum.DeadLettered += st.DeadLettered
		sum.HandedOver += st.HandedOver
		sum.InFlight += st.InFlight
		sum.LocksHeld += st.LocksHeld
	}
	for _, k := range order {
		s := sums[k]
		for _, m := range []struct {
			d *prometheus.Desc
			v int64
		}{
			{descClaimed, s.Claimed}, {descAcked, s.Acked}, {descNacked, s.Nacked}, {descReleased, s.Released},
			{descStale, s.StaleSettlements}, {descLost, s.LeasesLost}, {descErrors, s.Errors},
			{descDeadLettered, s.DeadLettered}, {descHandedOver, s.HandedOver},
		} {
			ch <- prometheus.MustNewConstMetric(m.d, prometheus.CounterValue, float64(m.v), k.group, k.mode)
		}
		ch <- prometheus.MustNewConstMetric(descInFlight, prometheus.GaugeValue, float64(s.InFlight), k.group, k.mode)
		ch <- prometheus.MustNewConstMetric(descLocks, prometheus.GaugeValue, float64(s.LocksHeld), k.group, k.mode)
	}
}

func (c *Collector) collectDatabase(ch chan<- prometheus.Metric) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.Timeout)
	defer cancel()
	ins, err := c.admin.Inspect(ctx, sqlbroker.InspectOptions{Topics: c.opts.Topics})
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	flag := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	for _, t := range ins.Topics {
		gauge(descTopicError, flag(t.Error != ""), t.Topic)
		for _, g := range t.Groups {
			l := []string{t.Topic, g.Group}
			gauge(descLag, float64(g.Lag), l...)
			gauge(descLagEstimated, flag(g.LagEstimated), l...)
			gauge(descInWork, float64(g.InWork), l...)
			gauge(descWaiting, float64(g.Waiting), l...)
			gauge(descParked, float64(g.Parked), l...)
			gauge(descDue, float64(g.Due), l...)
			if !ins.Horizon.NotApplicable {
				gauge(descHeldBack, float64(g.HeldBack), l...)
			}
			gauge(descOldest, g.OldestUnsettled.Seconds(), l...)
			gauge(descOffset, float64(g.Offset), l...)
		}
	}
	if err == nil && !ins.Horizon.NotApplicable {
		gauge(descHorizon, ins.Horizon.Age.Seconds())
	}
	gauge(descScrapeError, flag(err != nil))
	gauge(descMoreTopics, flag(ins.MoreTopics))
	gauge(descDuration, time.Since(start).Seconds())
}
