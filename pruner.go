package sqlbroker

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// pruner deletes a topic's settled messages older than Retention while its subscription
// claims (run); a delete running when the subscription stops is cancelled on the server.
type pruner struct {
	sub   *subscription
	every time.Duration
}

func newPruner(sub *subscription) *pruner {
	return &pruner{sub: sub, every: min(max(sub.cfg.Retention/10, time.Second), time.Minute)}
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

// runOnce deletes settled messages older than Retention, a batch at a time, until a batch is
// short; it reports false once the subscription stopped.
func (p *pruner) runOnce() bool {
	sub := p.sub
	for {
		var n int64
		err := sub.s.tracker.Run(sub.ctx, stmtPrune, p.every, func(ctx context.Context, q dbx.Querier) error {
			var err error
			n, err = sub.store.Prune(ctx, q, sub.cfg.Retention, pruneBatch)
			return err
		})
		if err != nil {
			if sub.ctx.Err() != nil {
				return false // stopped: cancelled on the server, and it is tried again by the next run
			}
			sub.s.stats.errors.Add(1)
			sub.logger.Error("Deleting settled messages failed", err, nil)
			return true
		}
		if n > 0 {
			sub.logger.Debug("Deleted settled messages", watermill.LogFields{"count": n})
		}
		if n < pruneBatch || sub.ctx.Err() != nil {
			return true
		}
	}
}
