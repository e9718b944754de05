package sqlbroker

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// pruner keeps a subscription's topic while its subscription claims (run): on PostgreSQL, it
// adds partitions to the messages table ahead of the publishers (and of the dead-letter
// topic's), moves the groups' floors past the partitions they have passed, and with Retention
// drops the partitions every group has passed; on SQLite, with Retention, it deletes the
// settled messages. A pass running when the subscription stops is cancelled on the server.
//
// With Retention, a pass runs every Retention/10 (between 1 s and 1 min): what it may drop
// depends on every group's progress and settlements. Without, a pass only adds partitions and
// moves floors, which change only as messages are claimed: an idle subscription runs none,
// and a pass runs every 10 s only when the subscriber claimed messages since the tick before
// (and once more after that, which learns that the partitions then filled are complete).
type pruner struct {
	sub   *subscription
	every time.Duration

	claimed int64 // the subscriber's claims at the last tick
	active  bool  // it had claimed at the tick before
}

// pruneLimit bounds one pass: a partition's detach waits for the transactions that use the
// table when it starts (offsets.MaintainOptions), up to a few seconds.
const pruneLimit = 30 * time.Second

// pruneEvery is the period of the passes without Retention (partitions and floors only),
// while the subscriber claims.
const pruneEvery = 10 * time.Second

func newPruner(sub *subscription) *pruner {
	every := pruneEvery
	if r := sub.cfg.Retention; r > 0 {
		every = min(max(r/10, time.Second), time.Minute)
	}
	return &pruner{sub: sub, every: every}
}

// prunes reports whether a subscription with cfg on a database of dialect d runs a pruner:
// always on PostgreSQL (partitions), with Retention elsewhere.
func prunes(d dbx.Dialect, cfg SubscriberConfig) bool {
	return d == dbx.Postgres || cfg.Retention > 0
}

func (p *pruner) run() {
	t := time.NewTicker(p.every)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-p.sub.handout.ended:
			return
		}
		if !p.due() {
			continue
		}
		if !p.runOnce() {
			return
		}
	}
}

// due reports whether the pass of this tick runs (see pruner).
func (p *pruner) due() bool {
	c := p.sub.s.stats.claimed.Load()
	active := c != p.claimed
	run := active || p.active || p.sub.cfg.Retention > 0
	p.claimed, p.active = c, active
	return run
}

// runOnce runs one pass; it reports false once the subscription stopped.
func (p *pruner) runOnce() bool {
	sub := p.sub
	opts := offsets.MaintainOptions{Drop: sub.cfg.Retention > 0, OlderThan: sub.cfg.Retention}
	var res offsets.MaintainResult
	err := sub.s.tracker.Run(sub.ctx, stmtPrune, max(p.every, pruneLimit), func(ctx context.Context, q dbx.Querier) error {
		if dlq := sub.settler.dlq; dlq != nil {
			if err := dlq.AddPartitions(ctx, q, 0); err != nil {
				return err
			}
		}
		var err error
		res, err = sub.store.Maintain(ctx, q, opts)
		return err
	})
	if err != nil {
		if sub.ctx.Err() != nil {
			return false // stopped: cancelled on the server, and it is tried again by the next run
		}
		sub.s.stats.errors.Add(1)
		sub.logger.Error("Retention failed", err, nil)
		return true
	}
	if res.Messages > 0 || res.Dropped > 0 {
		sub.logger.Debug("Deleted settled messages", watermill.LogFields{"count": res.Messages, "partitions": res.Dropped})
	}
	if res.Waiting {
		sub.logger.Debug("A partition's detach waits for a transaction that uses the messages table; the next pass completes it", nil)
	}
	return true
}
