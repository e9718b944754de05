package sqlbroker

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// settlerRig is a subscription on a unique topic whose loops do not run: the test claims
// messages and drives the settler itself.
func settlerRig(t *testing.T, mode ClaimMode) *subscription {
	t.Helper()
	var msgs []*message.Message
	for range 4 {
		msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte("x")))
	}
	return settlerRigOf(t, SubscriberConfig{ClaimMode: mode}, msgs...)
}

// settlerRigOf is settlerRig with the subscriber's configuration cfg (its consumer group,
// InitializeSchema and MaxInFlight set here) and the messages msgs published.
func settlerRigOf(t *testing.T, cfg SubscriberConfig, msgs ...*message.Message) *subscription {
	t.Helper()
	ctx := context.Background()
	topic := testdb.Topic(t, "")
	db := Pgx(testdb.Pgx(t))
	cfg.ConsumerGroup, cfg.InitializeSchema, cfg.MaxInFlight = "g", true, 16
	s, err := NewSubscriber(db, cfg, nil)
	require.NoError(t, err)
	store, err := s.stores.store(ctx, s.db, s.db, topic, true)
	require.NoError(t, err)
	groupID, err := store.EnsureGroup(ctx, s.db, "g", false)
	require.NoError(t, err)
	sub := newSubscription(s, ctx, store, groupID, nil)
	m, err := newClaimMode(ctx, sub)
	require.NoError(t, err)
	sub.mode = m
	t.Cleanup(func() {
		sub.stop(ErrClosed)
		sub.mode.abandon()
		sub.claimer.unreg()
		sub.claimer.unlisten()
	})

	// Two messages a partition: retention (the pruner's tests) drops them in pairs.
	testdb.SmallPartitions(t, store.T, 2, 3)
	pub, err := NewPublisher(db, PublisherConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	require.NoError(t, pub.Publish(topic, msgs...))
	return sub
}

// claimAll claims n messages of the rig's topic into its work set, as the claimer does.
func claimAll(t *testing.T, sub *subscription, n int) []*delivery {
	t.Helper()
	var ds []*delivery
	testdb.Eventually(t, 10*time.Second, "the messages claimed", func() bool {
		cs, token, _, err := sub.mode.claim(make([]offsets.Claimed, 0, n), n-len(ds), offsets.DueAll)
		require.NoError(t, err)
		these := make([]*delivery, len(cs))
		for i, c := range cs {
			require.True(t, sub.work.takeToken(context.Background()))
			these[i] = sub.newDelivery(c, token, time.Now().Add(sub.cfg.LeaseTTL))
		}
		sub.work.add(these)
		sub.mode.registered(these)
		ds = append(ds, these...)
		return len(ds) == n
	})
	return ds
}

// queue queues the settlement op of every delivery of ds, as their awaits do.
func queue(t *testing.T, sub *subscription, op settleOp, ds ...*delivery) {
	for _, d := range ds {
		require.True(t, sub.mode.beginSettle())
		sub.work.settling(d)
		sub.settler.enqueue(d, op)
	}
}

// Settlements queued while none is applied go into one batch: one settle round applies all
// of them, acks and nacks.
func TestSettler_L3_batchesWhatQueued(t *testing.T) {
	t.Parallel()
	for _, mode := range []ClaimMode{ClaimLease, ClaimAdvisoryLock} {
		t.Run(mode.String(), func(t *testing.T) {
			sub := settlerRig(t, mode)
			ds := claimAll(t, sub, 4)
			queue(t, sub, opAck, ds[:3]...)
			queue(t, sub, opNack, ds[3])

			first := <-sub.settler.queue
			retry := sub.settler.settle([]settlement{first})
			assert.Empty(t, retry)
			assert.Zero(t, len(sub.settler.queue), "the queue taken into the batch")
			st := sub.s.Stats()
			assert.EqualValues(t, 3, st.Acked)
			assert.EqualValues(t, 1, st.Nacked)
			assert.Zero(t, st.StaleSettlements)
			assert.Zero(t, sub.work.len(), "every settled delivery left the work set")
			// The locks' drop waits for a claim, or a few milliseconds (advisoryMode.unlock).
			testdb.Eventually(t, time.Second, "their locks dropped", func() bool { return sub.mode.locksHeld() == 0 })
		})
	}
}

// A settlement whose claim is no longer the delivery's is refused and counted stale once, in
// either mode: lease, the row's token changed; advisory, the lock was lost (no statement).
func TestSettler_L3_staleCountedOnce(t *testing.T) {
	t.Parallel()
	for _, mode := range []ClaimMode{ClaimLease, ClaimAdvisoryLock} {
		t.Run(mode.String(), func(t *testing.T) {
			sub := settlerRig(t, mode)
			ds := claimAll(t, sub, 2)
			if mode == ClaimLease {
				ds[0].token++ // another consumer's claim now
			} else {
				require.True(t, sub.work.lose(ds[0]))
				require.False(t, sub.work.lose(ds[0]), "lost once")
			}
			queue(t, sub, opAck, ds...)
			first := <-sub.settler.queue
			assert.Empty(t, sub.settler.settle([]settlement{first}))
			assert.Empty(t, sub.settler.settle(nil), "nothing left to apply")
			st := sub.s.Stats()
			assert.EqualValues(t, 1, st.StaleSettlements)
			assert.EqualValues(t, 1, st.Acked)
			assert.Zero(t, sub.work.len(), "the refused delivery is still in work")
		})
	}
}

// The settler's drained signal closes once it has applied its last settlement and ended: in
// lease mode when the queue closes (the hand-out loop ended, no await left), in advisory mode
// when Shutdown says nothing more is queued.
func TestSettler_drainedOnceTheLastIsApplied(t *testing.T) {
	t.Parallel()
	for _, mode := range []ClaimMode{ClaimLease, ClaimAdvisoryLock} {
		t.Run(mode.String(), func(t *testing.T) {
			sub := settlerRig(t, mode)
			ds := claimAll(t, sub, 3)
			go sub.settler.run()
			queue(t, sub, opAck, ds...)
			if mode == ClaimLease {
				close(sub.handout.ended)
				go sub.settler.closeQueue(sub.handout.ended)
			} else {
				sub.settler.stopQueue()
			}
			select {
			case <-sub.settler.drained:
			case <-time.After(30 * time.Second):
				t.Fatal("the settler did not end")
			}
			assert.EqualValues(t, 3, sub.s.Stats().Acked)
			assert.Zero(t, sub.work.len())
		})
	}
}

// Shutdown's wait for the settlements handlers made (step 3) ends when each acked delivery
// has left the work set, or with ctx.
func TestSettler_S4_drainWaitsForHandlerSettlements(t *testing.T) {
	t.Parallel()
	sub := settlerRig(t, ClaimLease)
	ds := claimAll(t, sub, 2)
	ds[0].msg.Ack()

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	err := sub.settler.drain(cancelled)
	assert.True(t, errors.Is(err, context.Canceled), "an acked delivery is still to settle: %v", err)

	queue(t, sub, opAck, ds[0])
	first := <-sub.settler.queue
	assert.Empty(t, sub.settler.settle([]settlement{first}))
	assert.NoError(t, sub.settler.drain(context.Background()))
	assert.Equal(t, 1, sub.work.len(), "the delivery no handler settled stays in work")
}

// Messages that an ordered ack handed over, and that no handler will get because the
// statement failed after handing them over, are given back at once: released (counted so),
// and the group's next claim takes the first of their key again.
func TestSettler_handedOverGivenBackWhenTheAckFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	var msgs []*message.Message
	for _, p := range []string{"A1", "A2"} {
		m := message.NewMessage(watermill.NewUUID(), []byte(p))
		m.Metadata.Set(MetadataOrderKey, "A")
		msgs = append(msgs, m)
	}
	sub := settlerRigOf(t, SubscriberConfig{OrderByKey: true}, msgs...)
	first := claimAll(t, sub, 1)
	require.Equal(t, "A1", string(first[0].msg.Payload))
	// A claim with A1 held parks A2.
	cs, _, _, err := sub.mode.claim(nil, 1, offsets.DueAll)
	require.NoError(t, err)
	require.Empty(t, cs, "A2 claimed while A1 is held")

	// The ack's statement as it ran before its error: A1 settled, A2 handed over.
	token := newToken()
	done, claimed, err := sub.store.AckHandingOver(ctx, sub.s.db, sub.groupID, fenced(first), token, time.Minute, nil)
	require.NoError(t, err)
	require.True(t, done[first[0].offset])
	require.Len(t, claimed, 1)
	handed := []*delivery{sub.newDelivery(claimed[0], token, time.Now().Add(time.Minute))}
	require.Equal(t, "A2", string(handed[0].msg.Payload))

	sub.settler.giveBackHanded(handed)
	assert.EqualValues(t, 1, sub.s.Stats().Released)
	assert.Error(t, handed[0].msg.Context().Err(), "the context of a message given back ended")
	again := claimAll(t, sub, 1)
	assert.Equal(t, "A2", string(again[0].msg.Payload), "the next claim takes the message given back")
}
