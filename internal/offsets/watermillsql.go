package offsets

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
)

// WatermillSQL is the statements on a topic's tables of watermill-sql v4 on PostgreSQL (its
// default schema adapter's messages table and offsets adapter's table), which a migration
// reads from. Messages and Offsets are quoted names.
type WatermillSQL struct {
	Messages, Offsets string
}

// ReadsWatermillSQL reports whether a database of dialect d can hold watermill-sql's tables
// that these statements read: PostgreSQL's only.
func ReadsWatermillSQL(d dbx.Dialect) bool { return d == dbx.Postgres }

// NewWatermillSQL quotes the tables' names, in schema when it is not empty.
func NewWatermillSQL(schema, messages, offsets string) WatermillSQL {
	ident := func(name string) string {
		if schema != "" {
			return pgx.Identifier{schema, name}.Sanitize()
		}
		return pgx.Identifier{name}.Sanitize()
	}
	return WatermillSQL{Messages: ident(messages), Offsets: ident(offsets)}
}

// WatermillPosition is a watermill-sql group's position: the last message it consumed.
type WatermillPosition struct {
	Offset int64
	TxID   string // xid8, as text
}

// WatermillMessage is one row of watermill-sql's messages table.
type WatermillMessage struct {
	Pos      WatermillPosition
	UUID     string
	Payload  []byte
	Metadata string // JSON, or "" / "null"
}

// Missing returns the first of the two tables that does not exist, or "".
func (w WatermillSQL) Missing(ctx context.Context, q dbx.Querier) (string, error) {
	for _, t := range []string{w.Messages, w.Offsets} {
		var found bool
		if err := dbx.QueryRow(ctx, q, `SELECT to_regclass($1) IS NOT NULL`, []any{t}, &found); err != nil {
			return "", err
		}
		if !found {
			return t, nil
		}
	}
	return "", nil
}

// Position reads group's position; with lock, it locks the group's row, as watermill-sql's
// consumers do while they handle a batch. dbx.ErrNoRows: the group has no row.
func (w WatermillSQL) Position(ctx context.Context, q dbx.Querier, group string, lock bool) (WatermillPosition, error) {
	var pos WatermillPosition
	query := `SELECT COALESCE(offset_acked, 0), last_processed_transaction_id::text FROM ` + w.Offsets + ` WHERE consumer_group = $1`
	if lock {
		query += ` FOR UPDATE`
	}
	err := dbx.QueryRow(ctx, q, query, []any{group}, &pos.Offset, &pos.TxID)
	return pos, err
}

// Groups lists up to limit consumer groups of the offsets table, in order.
func (w WatermillSQL) Groups(ctx context.Context, q dbx.Querier, limit int) ([]string, error) {
	rows, err := q.Query(ctx, `SELECT consumer_group FROM `+w.Offsets+` ORDER BY consumer_group LIMIT $1`, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var groups []string
	for rows.Next() {
		var g string
		if err := rows.Scan(&g); err != nil {
			return nil, err
		}
		groups = append(groups, g)
	}
	return groups, rows.Err()
}

// after is the predicate of the messages after a position ($1 its transaction id as text, $2
// its offset), in watermill-sql's order.
const watermillAfter = `((transaction_id = $1::text::xid8 AND "offset" > $2) OR transaction_id > $1::text::xid8)`

// Read returns up to size messages after pos that watermill-sql would deliver now (written by
// transactions older than every running one), in its order.
func (w WatermillSQL) Read(ctx context.Context, q dbx.Querier, pos WatermillPosition, size int) ([]WatermillMessage, error) {
	rows, err := q.Query(ctx, `SELECT "offset", transaction_id::text, uuid, payload, COALESCE(metadata::text, '')
	FROM `+w.Messages+`
	WHERE `+watermillAfter+`
	AND transaction_id < pg_snapshot_xmin(pg_current_snapshot())
	ORDER BY transaction_id, "offset" LIMIT $3`, pos.TxID, pos.Offset, size)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []WatermillMessage
	for rows.Next() {
		var m WatermillMessage
		if err := rows.Scan(&m.Pos.Offset, &m.Pos.TxID, &m.UUID, &m.Payload, &m.Metadata); err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, rows.Err()
}

// Count counts the messages after pos: those a read may return now, and those a running
// transaction holds back.
func (w WatermillSQL) Count(ctx context.Context, q dbx.Querier, pos WatermillPosition) (due, heldBack int64, err error) {
	err = dbx.QueryRow(ctx, q, `SELECT
		count(*) FILTER (WHERE transaction_id < pg_snapshot_xmin(pg_current_snapshot())),
		count(*) FILTER (WHERE transaction_id >= pg_snapshot_xmin(pg_current_snapshot()))
	FROM `+w.Messages+`
	WHERE `+watermillAfter, []any{pos.TxID, pos.Offset}, &due, &heldBack)
	return due, heldBack, err
}

// Advance moves group's position to pos.
func (w WatermillSQL) Advance(ctx context.Context, q dbx.Querier, group string, pos WatermillPosition) error {
	_, err := q.Exec(ctx, `UPDATE `+w.Offsets+` SET offset_acked = $2, last_processed_transaction_id = $3::text::xid8
	WHERE consumer_group = $1`, group, pos.Offset, pos.TxID)
	return err
}
