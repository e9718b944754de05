package testdb

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/dbx"
	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// State is a topic brought, through the library's own statements, into one known state on
// either database, for the tests that compare what operators read on PostgreSQL and on
// SQLite:
//   - 10 messages published to Topic;
//   - group "ahead" claimed 8 of them: 3 leased for an hour (in work), 1 nacked with an
//     hour's backoff (waiting), 2 whose lease ran out (due), 1 acked, and 1 moved to the
//     dead-letter topic Dead (which holds that one message and no group): position 8, lag 2;
//   - group "behind" at the oldest message, claimed nothing: position 0, lag 10.
type State struct {
	Topic, Dead    string
	Tables, DeadTb offsets.Tables
}

// NewState builds the state on db (a pool of either database) for topic and its dead-letter
// topic dead, whose tables it creates (the caller drops them).
func NewState(t testing.TB, db dbx.Pool, topic, dead string) *State {
	t.Helper()
	ctx := context.Background()
	d := dbx.DialectOf(db)
	s := &State{Topic: topic, Dead: dead,
		Tables: offsets.NewTables("", "sqlbroker_", topic).On(d),
		DeadTb: offsets.NewTables("", "sqlbroker_", dead).On(d)}
	must(t, s.Tables.Create(ctx, db))
	must(t, s.DeadTb.Create(ctx, db))
	if d == dbx.Postgres {
		// A message a partition: retention then drops what SQLite deletes, message by message.
		SmallPartitions(t, s.Tables, 1, 10)
	}
	store, deadStore := offsets.NewStore(s.Tables, false), offsets.NewStore(s.DeadTb, false)
	rows := make([]offsets.Row, 10)
	for i := range rows {
		rows[i] = offsets.Row{UUID: "m" + strconv.Itoa(i), Payload: []byte("x"), Metadata: "{}"}
	}
	must(t, store.Insert(ctx, db, rows, ""))
	ahead, err := store.EnsureGroup(ctx, db, "ahead", false)
	must(t, err)
	_, err = store.EnsureGroup(ctx, db, "behind", false)
	must(t, err)

	claim := func(n int, ttl time.Duration, token int64) []offsets.Claimed {
		var got []offsets.Claimed
		// A transaction of another test may hold PostgreSQL's horizon back for a while.
		Eventually(t, 60*time.Second, "messages to claim", func() bool {
			c, err := store.Claim(ctx, db, ahead, token, ttl, n-len(got), offsets.DueNone, nil)
			must(t, err)
			got = append(got, c...)
			return len(got) == n
		})
		return got
	}
	claim(3, time.Hour, 1)
	nacked := claim(1, time.Hour, 2)
	_, err = store.Nack(ctx, db, ahead, offsets.Fence(nacked, 2), time.Hour)
	must(t, err)
	claim(2, time.Millisecond, 3)
	acked := claim(1, time.Hour, 4)
	_, err = store.Ack(ctx, db, ahead, offsets.Fence(acked, 4))
	must(t, err)
	moved := claim(1, time.Hour, 5)
	done, err := store.DeadLetter(ctx, db, ahead, "ahead", offsets.Fence(moved, 5), deadStore, [2]string{"x_attempt", "x_offset"})
	must(t, err)
	if len(done) != 1 {
		t.Fatalf("dead-lettered %d messages, want 1", len(done))
	}
	return s
}
