package offsets

// Reading a topic's messages as they are stored, and taking them out of it: what the
// dead-letter tools of the Admin need.

import (
	"context"
	"fmt"
	"strings"

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

func (t Tables) messagesSelect() string {
	if t.sqlite {
		return fmt.Sprintf(`SELECT "offset", "uuid", "payload", "metadata", "created_at", coalesce("deliver_at", 0) FROM %s`, t.Messages)
	}
	return fmt.Sprintf(`SELECT "offset", "uuid", "payload", "metadata"::text,
	(extract(epoch FROM "created_at") * 1000)::bigint, coalesce((extract(epoch FROM "deliver_at") * 1000)::bigint, 0) FROM %s`, t.Messages)
}

// ReadMessages reads up to limit messages whose offset is from or more, in offset order.
func (t Tables) ReadMessages(ctx context.Context, q dbx.Querier, from int64, limit int) ([]Stored, error) {
	sql := t.messagesSelect() + ` WHERE "offset" >= $1 ORDER BY "offset" LIMIT $2`
	return scanStored(q.Query(ctx, sql, from, limit))
}

// TakeMessages reads up to limit messages whose offset is after, in offset order, for a
// transaction that will delete them: on PostgreSQL their rows stay locked until it ends
// (a message another transaction deleted meanwhile is skipped); on SQLite the write
// transaction holds the database.
func (t Tables) TakeMessages(ctx context.Context, tx dbx.Querier, after int64, limit int) ([]Stored, error) {
	sql := t.messagesSelect() + ` WHERE "offset" > $1 ORDER BY "offset" LIMIT $2`
	if !t.sqlite {
		sql += ` FOR UPDATE`
	}
	return scanStored(tx.Query(ctx, sql, after, limit))
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
	if !t.sqlite {
		return tx.Exec(ctx, fmt.Sprintf(`WITH c AS (DELETE FROM %s WHERE "offset" = ANY ($1::bigint[]))
DELETE FROM %s WHERE "offset" = ANY ($1::bigint[])`, t.Claims, t.Messages), offs)
	}
	var total int64
	for len(offs) > 0 {
		n := min(len(offs), sqliteSettleChunk)
		args := make([]any, n)
		for i, o := range offs[:n] {
			args[i] = o
		}
		in := strings.TrimSuffix(strings.Repeat("?,", n), ",")
		if _, err := tx.Exec(ctx, fmt.Sprintf(`DELETE FROM %s WHERE "offset" IN (%s)`, t.Claims, in), args...); err != nil {
			return total, err
		}
		d, err := tx.Exec(ctx, fmt.Sprintf(`DELETE FROM %s WHERE "offset" IN (%s)`, t.Messages, in), args...)
		total += d
		if err != nil {
			return total, err
		}
		offs = offs[n:]
	}
	return total, nil
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
