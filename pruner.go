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
type pruner struct {
	sub   *subscription
	every time.Duration
}

// pruneLimit bounds one pass: a partition's detach waits for the transactions that use the
// table when it starts (offsets.MaintainOptions), up to a few seconds.
const pruneLimit = 30 * time.Second

// pruneEvery is the period of the passes without Retention (partitions and floors only).
const pruneEvery = 10 * time.Second

func newPruner(sub *subscription) *pruner {
	every := pruneEvery
	if r := sub.cfg.Retention; r > 0 {
		every = min(max(r/10, time.Second), pruneEvery)
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
		if !p.runOnce() {
			return
		}
	}
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
