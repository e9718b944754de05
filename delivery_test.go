package sqlbroker

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testDelivery(offset int64) *delivery {
	_, cancel := context.WithCancelCause(context.Background())
	return &delivery{offset: offset, msg: message.NewMessage(watermill.NewUUID(), nil), cancel: cancel,
		state: stateQueued, deadline: time.Now().Add(time.Minute)}
}

// The work set gives back each handler slot and held token exactly once, whatever the order
// of a delivery's steps: an ack frees its slot and token before its settlement is done, and
// the removal that follows frees nothing twice; a lost delivery stays lost once removed.
func TestWorkSet_M5_slotsAndTokensGivenBackOnce(t *testing.T) {
	cfg := &SubscriberConfig{MaxInFlight: 2, BatchSize: 2}
	w := newWorkSet(cfg, context.Background())
	require.Equal(t, 2, w.prefetch)
	ctx := context.Background()

	acked, lost := testDelivery(1), testDelivery(2)
	left, lostOne := w.left.wait(), w.lost.wait()
	require.True(t, w.takeToken(ctx))
	require.True(t, w.tryToken())
	w.add([]*delivery{acked, lost})
	assert.Equal(t, 2, len(w.held))
	assert.Equal(t, 2, w.len())

	require.True(t, w.takeSlot(ctx, acked))
	assert.Equal(t, stateHandedOut, acked.state)
	assert.Equal(t, 1, len(w.slots))

	w.settling(acked)
	assert.Equal(t, stateSettling, acked.state)
	w.freeSlot(acked)
	w.freeSlot(acked)
	w.freeToken(acked)
	assert.Equal(t, 0, len(w.slots), "the slot given back once")
	assert.Equal(t, 1, len(w.held), "the token given back once")
	w.remove(acked, context.Canceled)
	assert.Equal(t, 1, len(w.held), "the removal frees nothing twice")
	assert.Equal(t, stateDone, acked.state)
	assert.False(t, w.lose(acked), "a delivery out of the set is not lost")

	select {
	case <-left:
	default:
		t.Fatal("a removal did not wake those waiting for deliveries to leave the set")
	}
	select {
	case <-lostOne:
		t.Fatal("a removal woke those waiting for a loss")
	default:
	}
	assert.True(t, w.lose(lost))
	select {
	case <-lostOne:
	default:
		t.Fatal("a loss did not wake those waiting for one")
	}
	lostOne = w.lost.wait()
	assert.False(t, w.lose(lost), "lost once")
	select {
	case <-lostOne:
		t.Fatal("a delivery lost twice woke those waiting for a loss twice")
	default:
	}
	w.settling(lost)
	assert.Equal(t, stateLost, lost.state, "a lost delivery's settlement does not make it settling")
	w.remove(lost, context.Canceled)
	assert.Equal(t, 0, len(w.held))
	assert.Equal(t, stateLost, lost.state, "a lost delivery stays lost once removed")
	assert.Zero(t, w.len())
}

// A claim held ahead whose local deadline passed is lost before it is handed out when the
// claim mode bounds claims by their deadline (lease), and not otherwise (advisory lock).
func TestWorkSet_L4_expiredHeldAheadIsLost(t *testing.T) {
	w := newWorkSet(&SubscriberConfig{MaxInFlight: 1, BatchSize: 1}, context.Background())
	d := testDelivery(1)
	d.deadline = time.Now().Add(-time.Second)
	lost, _ := w.expire(d, false)
	assert.False(t, lost, "a lock does not expire")
	lost, _ = w.expire(d, true)
	assert.True(t, lost, "a lease does")
}

// An ack may give its held token back before its statement has run in exchange for an early
// one (the advisory mode), but no more than MaxInFlight at once: the others keep their held
// token. Each early token goes back once, when its delivery leaves the set.
func TestWorkSet_earlyTokensBounded(t *testing.T) {
	cfg := &SubscriberConfig{MaxInFlight: 2, BatchSize: 2}
	w := newWorkSet(cfg, context.Background())
	ds := []*delivery{testDelivery(1), testDelivery(2), testDelivery(3)}
	for range ds {
		require.True(t, w.tryToken())
	}
	w.add(ds)
	for _, d := range ds {
		w.freeTokenEarly(d)
	}
	assert.Equal(t, 2, len(w.early), "early tokens beyond MaxInFlight")
	assert.Equal(t, 1, len(w.held), "the ack with no early token left keeps its held token")
	w.freeTokenEarly(ds[0]) // it holds no held token any more: nothing changes
	assert.Equal(t, 2, len(w.early))
	assert.Equal(t, 1, len(w.held))

	w.remove(ds[0], context.Canceled)
	w.remove(ds[0], context.Canceled)
	assert.Equal(t, 1, len(w.early), "the early token given back once, at the removal")
	w.freeTokenEarly(ds[2])
	assert.Equal(t, 2, len(w.early))
	assert.Equal(t, 0, len(w.held))
	w.removeAll(ds[1:], context.Canceled)
	assert.Equal(t, 0, len(w.early))
	assert.Equal(t, 0, len(w.held))
}
