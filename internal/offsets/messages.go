package offsets

// Reading a topic's messages as they are stored, and taking them out of it: what the
// dead-letter tools of the Admin need.

import (
	"context"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// Stored is a message as its topic's messages table holds it.
type Stored struct {
	Offset   int64
	UUID     string
	Payload  []byte
	Metadata string // JSON object
	// CreatedAtMS and DeliverAtMS are Unix milliseconds; DeliverAtMS is 0 when the message
	// is not delayed.
	CreatedAtMS, DeliverAtMS int64
}

// ReadMessages reads up to limit messages whose offset is from or more, in offset order.
func (t Tables) ReadMessages(ctx context.Context, q dbx.Querier, from int64, limit int) ([]Stored, error) {
	return scanStored(q.Query(ctx, t.database().messagesSQL(t, false), from, limit))
}

// TakeMessages reads up to limit messages whose offset is after, in offset order, for a
// transaction that will delete them: on PostgreSQL their rows stay locked until it ends
// (a message another transaction deleted meanwhile is skipped); on SQLite the write
// transaction holds the database.
func (t Tables) TakeMessages(ctx context.Context, tx dbx.Querier, after int64, limit int) ([]Stored, error) {
	return scanStored(tx.Query(ctx, t.database().messagesSQL(t, true), after, limit))
}

// CountMessages counts the messages of the topic.
func (t Tables) CountMessages(ctx context.Context, q dbx.Querier) (int64, error) {
	var n int64
	err := dbx.QueryRow(ctx, q, `SELECT count(*) FROM `+t.Messages, nil, &n)
	return n, err
}

// DeleteMessages deletes the messages at offsets, and the claims any consumer group holds on
// them (an ack of such a claim is then refused as stale), and returns how many messages it
// deleted.
func (t Tables) DeleteMessages(ctx context.Context, tx dbx.Querier, offs []int64) (int64, error) {
	if len(offs) == 0 {
		return 0, nil
	}
	return t.database().deleteMessages(ctx, t, tx, offs)
}

func scanStored(rows dbx.Rows, err error) ([]Stored, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Stored
	for rows.Next() {
		var s Stored
		if err := rows.Scan(&s.Offset, &s.UUID, &s.Payload, &s.Metadata, &s.CreatedAtMS, &s.DeliverAtMS); err != nil {
			return nil, err
		}
		out = append(out, s)
	}
	return out, rows.Err()
}
