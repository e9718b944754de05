package sqlbroker

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// ErrNotDelivered is returned by AckInTx for a message that no Subscriber of this library
// delivered (or a copy of one: the delivery travels in the message's context).
var ErrNotDelivered = errors.New("sqlbroker: the message was not delivered by a sqlbroker Subscriber")

// AckInTx settles msg inside the caller's transaction tx (PgxTx, StdTx or SQLiteTx, on the
// database of the subscriber that delivered msg): the message's claim is settled by a statement of tx,
// fenced by the delivery's token, so the handler's own writes in tx and the ack commit
// together, or neither does. If the claim is no longer this delivery's (its lease ran out and
// another consumer took the message, or in advisory mode its lock went with its connection),
// AckInTx returns an error matching ErrLeaseLost, and the caller must roll back: the message
// is, or will be, handled by someone else.
//
// Once the caller has committed, the message is settled; the Router's (or the caller's)
// Ack that follows changes nothing in the database and is not counted as stale, and in
// advisory mode it drops the message's lock. A Nack that follows instead (the caller rolled
// back) gives the message back as usual. Call it last and commit at once: the claim's row
// stays locked by tx until it ends, and its lease is no longer extended. On PostgreSQL that
// row holds every message one claim statement took, so the acks, nacks and lease extensions
// of the subscription's other messages of that claim wait for tx meanwhile (their leases
// run out if tx outlasts LeaseTTL); on SQLite, the database's write lock is held. tx must run at READ COMMITTED, the
// PostgreSQL default.
func AckInTx(ctx context.Context, tx DB, msg *message.Message) error {
	if tx.tx == nil {
		return &ConfigError{Field: "tx", Value: "not a transaction", Reason: "must wrap the caller's transaction: use sqlbroker.PgxTx, sqlbroker.StdTx, sqlbroker.SQLiteTx or sqlbroker.MySQLTx"}
	}
	if msg == nil {
		return fmt.Errorf("sqlbroker: AckInTx: %w", ErrNotDelivered)
	}
	d, _ := msg.Context().Value(deliveryKey{}).(*delivery)
	if d == nil || d.msg != msg {
		return fmt.Errorf("sqlbroker: AckInTx of message %s: %w", msg.UUID, ErrNotDelivered)
	}
	sub := d.sub
	if d.isLost() {
		return fmt.Errorf("sqlbroker: AckInTx of offset %d: %w", d.offset, ErrLeaseLost)
	}
	done, err := sub.store.Ack(ctx, tx.tx, sub.groupID, []offsets.Fenced{{Offset: d.offset, Token: d.token}})
	if err != nil {
		return fmt.Errorf("sqlbroker: AckInTx of offset %d: %w", d.offset, err)
	}
	if !done[d.offset] {
		return fmt.Errorf("sqlbroker: AckInTx of offset %d: the claim is no longer this delivery's: %w", d.offset, ErrLeaseLost)
	}
	d.mu.Lock()
	d.ackedInTx = true
	d.mu.Unlock()
	return nil
}

// PgxTxHandler returns a handler for a Router that runs fn inside a transaction of pool and
// acks the message in it (AckInTx): begin, fn, ack, commit. An error of fn, or of the ack
// (ErrLeaseLost when the claim is no longer this delivery's), rolls the transaction back and
// is returned, so the Router nacks the message. pool must be the database of the subscriber
// that delivers the messages.
func PgxTxHandler(pool *pgxpool.Pool, fn func(ctx context.Context, tx pgx.Tx, msg *message.Message) error) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		if err := fn(ctx, tx, msg); err != nil {
			return err
		}
		if err := AckInTx(ctx, PgxTx(tx), msg); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
}

// StdTxHandler is PgxTxHandler for a database/sql pool.
func StdTxHandler(db *sql.DB, fn func(ctx context.Context, tx *sql.Tx, msg *message.Message) error) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		ctx := msg.Context()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		if err := fn(ctx, tx, msg); err != nil {
			return err
		}
		if err := AckInTx(ctx, StdTx(tx), msg); err != nil {
			return err
		}
		return tx.Commit()
	}
}

// ackedInTx takes out of sts the acks (op "ack") of deliveries acked by AckInTx: such an ack
// changes nothing in the database (the caller's commit deleted the claim) and is counted as
// applied (settledInTx). A nack of one is applied as usual, and, refused, means that the
// caller's commit deleted the claim after all: not stale either. It returns the others, and
// the acks it took out.
func (st *settler) ackedInTx(op settleOp, sts []settlement) (rest, acked []settlement) {
	for _, x := range sts {
		if x.op == op && op == opAck && x.d.wasAckedInTx() {
			acked = append(acked, x)
			continue
		}
		rest = append(rest, x)
	}
	return rest, acked
}

// settledInTx counts the acks of deliveries acked in the caller's transaction as applied, and
// drops them from the work set; in advisory mode the caller has dropped their locks first. In
// a group ordered by key, an ack frees its key: the next claim looks for the key's next
// message (the caller's transaction hands nothing over).
func (st *settler) settledInTx(acked []settlement) {
	sub := st.sub
	freed := false
	for _, x := range acked {
		sub.forget(x.d)
		sub.s.stats.acked.Add(1)
		sub.logger.Trace("Ack of a message acked in the caller's transaction", watermill.LogFields{"offset": x.d.offset})
		freed = freed || x.d.key != ""
	}
	if freed && sub.cfg.OrderByKey {
		sub.claimer.markDue(time.Now())
	}
}

func (d *delivery) wasAckedInTx() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.ackedInTx
}
