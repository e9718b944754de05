package testdb

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// Fixture is a topic set up, through the library's own statements, in a known state for the
// tests of what operators read: 10 messages published (one a partition), then
//   - group "ahead" claimed 6 of them: 3 leased for an hour (in work), 1 nacked with an hour's
//     backoff (waiting), 2 whose lease ran out (due);
//   - group "behind" exists at the oldest message and claimed nothing (lag 10).
//
// HoldHorizon then opens a transaction that takes an xid and publishes 2 messages after it.
type Fixture struct {
	Topic  string
	Tables offsets.Tables
	Store  *offsets.Store
	Pool   *pgxpool.Pool
}

// NewFixture builds the fixture on a unique topic, dropped when t ends.
func NewFixture(t testing.TB) *Fixture {
	t.Helper()
	ctx := context.Background()
	topic := Topic(t, "")
	pool := Pgx(t)
	db := dbx.NewPgxPool(pool)
	f := &Fixture{Topic: topic, Tables: offsets.NewTables("", "sqlbroker_", topic), Pool: pool}
	f.Store = offsets.NewStore(f.Tables, false)
	must(t, f.Tables.Create(ctx, db))
	SmallPartitions(t, f.Tables, 1, 12) // a message a partition: retention drops them one by one
	f.Publish(t, 10)
	ahead, err := f.Store.EnsureGroup(ctx, db, "ahead", false)
	must(t, err)
	_, err = f.Store.EnsureGroup(ctx, db, "behind", false)
	must(t, err)

	claim := func(n int, ttl time.Duration, token int64) []offsets.Claimed {
		var got []offsets.Claimed
		// A transaction of another test may hold the horizon back for a while.
		Eventually(t, 60*time.Second, "messages to claim", func() bool {
			c, err := f.Store.Claim(ctx, db, ahead, token, ttl, n-len(got), offsets.DueNone, nil)
			must(t, err)
			got = append(got, c...)
			return len(got) == n
		})
		return got
	}
	claim(3, time.Hour, 1)
	nacked := claim(1, time.Hour, 2)
	_, err = f.Store.Nack(ctx, db, ahead, offsets.Fence(nacked, 2), time.Hour)
	must(t, err)
	claim(2, time.Millisecond, 3)
	return f
}

// Publish writes n messages.
func (f *Fixture) Publish(t testing.TB, n int) {
	t.Helper()
	rows := make([]offsets.Row, n)
	for i := range rows {
		rows[i] = offsets.Row{UUID: "m" + strconv.Itoa(i), Payload: []byte("x"), Metadata: "{}"}
	}
	must(t, f.Store.Insert(context.Background(), dbx.NewPgxPool(f.Pool), rows, ""))
}

// HoldHorizon opens a transaction that takes an xid and stays open until t ends, publishes n
// messages after it, and returns the transaction's backend pid.
func (f *Fixture) HoldHorizon(t testing.TB, n int) int64 {
	t.Helper()
	ctx := context.Background()
	tx, err := f.Pool.BeginTx(ctx, pgx.TxOptions{})
	must(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var pid int64
	must(t, tx.QueryRow(ctx, "SELECT pg_backend_pid(), txid_current()").Scan(&pid, new(int64)))
	f.Publish(t, n)
	return pid
}

// Int runs a query returning one bigint.
func (f *Fixture) Int(t testing.TB, sql string, args ...any) int64 {
	t.Helper()
	var n int64
	must(t, f.Pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// WaitHorizon waits until the xmin horizon has passed every row of messagesTable (a quoted
// table name), so that a claim sees them: an open transaction of any other session of the
// server (another test package, another user of a shared server) holds them back until it
// ends.
func WaitHorizon(t testing.TB, ctx context.Context, q dbx.Querier, messagesTable string) {
	t.Helper()
	Eventually(t, 2*time.Minute, "the xmin horizon passes the rows of "+messagesTable, func() bool {
		var passed bool
		err := dbx.QueryRow(ctx, q, `SELECT coalesce(max("xid") < pg_snapshot_xmin(pg_current_snapshot()), true) FROM `+messagesTable, nil, &passed)
		if err != nil {
			t.Fatal(err)
		}
		return passed
	})
}
