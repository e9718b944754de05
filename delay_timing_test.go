package sqlbroker_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// allDrivers are the databases and drivers the delay tests run on.
var allDrivers = []database{{"pgx", pgxDB}, {"libpq", stdDB}, {"sqlite", sqliteDB}}

// visibleAt is when every message of topic could first be handed out: at once on SQLite; on
// PostgreSQL once the xmin horizon passed them (a transaction of another test still running
// holds them back, by design). ok is false when the horizon did not pass within a second: the
// caller then checks no timing.
func visibleAt(t *testing.T, db, topic string) (at time.Time, ok bool) {
	t.Helper()
	if db == "sqlite" {
		return time.Now(), true
	}
	if !horizonPassedWithin(t, topic, time.Second) {
		t.Logf("another transaction held the xmin horizon for 1s: timing not checked")
		return time.Time{}, false
	}
	return time.Now(), true
}

// A message published behind a run of delayed ones is delivered as soon as it is visible,
// without waiting for the idle poll: 2,000 messages delayed by an hour, then a plain one; and,
// with MaxInFlight 1, 20 delayed ones ahead. The idle poll is made long (10 s), so that a
// claim loop that went idle after passing the delayed messages shows.
func TestDelay_runOfDelayedDoesNotHoldBackTheNext(t *testing.T) {
	t.Parallel()
	const poll = 250 * time.Millisecond
	for _, d := range allDrivers {
		for _, mode := range d.modes() {
			for _, c := range []struct {
				name        string
				maxInFlight int
				ahead       int
			}{{"2000-ahead", 0, 2000}, {"inflight1-20-ahead", 1, 20}, {"inflight1-2000-ahead", 1, 2000}} {
				t.Run(d.name+"/"+mode.String()+"/"+c.name, func(t *testing.T) {
					t.Parallel()
					topic := testdb.Topic(t, "")
					db := d.open(t)
					pub := newPublisher(t, db)
					sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ClaimMode: mode, PollInterval: poll,
						IdlePollInterval: 10 * time.Second, MaxInFlight: c.maxInFlight})
					ch, err := sub.Subscribe(context.Background(), topic)
					require.NoError(t, err)

					batch := make([]*message.Message, c.ahead)
					for i := range batch {
						batch[i] = message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint("delayed ", i)))
						delay.Message(batch[i], delay.For(time.Hour))
					}
					require.NoError(t, pub.Publish(topic, batch...))
					publish(t, pub, topic, "plain")
					from, timed := visibleAt(t, d.name, topic)
					m := receive(t, ch, 60*time.Second)
					took := time.Since(from)
					require.Equal(t, "plain", string(m.Payload))
					m.Ack()
					t.Logf("%d delayed ahead: the plain message arrived %v after it was visible", c.ahead, took)
					if timed {
						// 12 PollIntervals: far above the few claims it takes, far below the idle poll.
						assert.Less(t, took, 3*time.Second, "the plain message was held back by the delayed ones ahead of it")
					}
				})
			}
		}
	}
}

// The subscription that passed several delayed messages delivers each at its time, give or
// take a PollInterval, not only the first: three messages delayed 300 ms, 900 ms and 1500 ms,
// with an idle poll (5 s) far longer than their gaps.
func TestDelay_eachOfSeveralDelayedComesAtItsTime(t *testing.T) {
	t.Parallel()
	const poll = 100 * time.Millisecond
	delays := []time.Duration{300 * time.Millisecond, 900 * time.Millisecond, 1500 * time.Millisecond}
	for _, d := range allDrivers {
		for _, mode := range d.modes() {
			t.Run(d.name+"/"+mode.String(), func(t *testing.T) {
				t.Parallel()
				topic := testdb.Topic(t, "")
				db := d.open(t)
				pub := newPublisher(t, db)
				sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{ClaimMode: mode, PollInterval: poll, IdlePollInterval: 5 * time.Second})
				ch, err := sub.Subscribe(context.Background(), topic)
				require.NoError(t, err)

				before := time.Now()
				batch := make([]*message.Message, len(delays))
				for i, dl := range delays {
					batch[i] = message.NewMessage(watermill.NewUUID(), []byte(dl.String()))
					delay.Message(batch[i], delay.For(dl))
				}
				require.NoError(t, pub.Publish(topic, batch...))
				after := time.Now()
				visible, timed := visibleAt(t, d.name, topic)
				for _, dl := range delays {
					m := receive(t, ch, dl+lateness)
					arrived := time.Now()
					require.Equal(t, dl.String(), string(m.Payload), "out of order")
					m.Ack()
					assert.False(t, arrived.Before(before.Add(dl)), "%v: delivered before its time", dl)
					due := after.Add(dl)
					if visible.After(due) {
						due = visible
					}
					late := arrived.Sub(due)
					t.Logf("delayed %v: %v late", dl, late)
					if timed {
						assert.Less(t, late, poll+700*time.Millisecond, "%v: delivered long after its time", dl)
					}
				}
			})
		}
	}
}

// On SQLite a single delayed message comes at its time, give or take a PollInterval: one
// message at a time delayed by 300 ms, eight times over, on eight databases at once, each with
// its only subscription.
func TestDelay_sqliteSingleDelayedComesAtItsTime(t *testing.T) {
	t.Parallel()
	const poll = 100 * time.Millisecond
	const wait = 300 * time.Millisecond
	for i := range 8 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			db := sqliteDB(t)
			topic := testdb.Topic(t, "")
			pub := newPublisher(t, db)
			sub := newSubscriberOn(t, db, sqlbroker.SubscriberConfig{PollInterval: poll})
			ch, err := sub.Subscribe(context.Background(), topic)
			require.NoError(t, err)
			for j := range 8 {
				m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprint(j)))
				before := time.Now()
				delay.Message(m, delay.For(wait))
				require.NoError(t, pub.Publish(topic, m))
				got := receive(t, ch, wait+lateness)
				late := time.Since(before.Add(wait))
				got.Ack()
				require.Equal(t, fmt.Sprint(j), string(got.Payload))
				t.Logf("message %d: %v late", j, late)
				assert.GreaterOrEqual(t, late, time.Duration(0), "message %d: delivered before its time", j)
				assert.Less(t, late, poll+400*time.Millisecond, "message %d: delivered long after its time", j)
			}
		})
	}
}
