package sqlbroker

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The pruner deletes the messages every group has settled, and none still claimed.
func TestPruner_deletesSettledOnly(t *testing.T) {
	t.Parallel()
	sub := settlerRig(t, ClaimLease)
	sub.cfg.Retention = time.Millisecond
	p := newPruner(sub)
	count := func() int64 {
		var n int64
		require.NoError(t, testdb.Pgx(t).QueryRow(context.Background(), "SELECT count(*) FROM "+sub.store.T.Messages).Scan(&n))
		return n
	}

	ds := claimAll(t, sub, 4)
	require.True(t, p.runOnce())
	assert.EqualValues(t, 4, count(), "claimed messages are kept")

	queue(t, sub, opAck, ds...)
	first := <-sub.settler.queue
	require.Empty(t, sub.settler.settle([]settlement{first}))
	testdb.Eventually(t, 10*time.Second, "the settled messages deleted", func() bool {
		return p.runOnce() && count() == 0
	})
}
