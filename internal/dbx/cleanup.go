package dbx

import (
	"context"
	"time"
)

// CleanupTimeout bounds cleanup statements (rollback, unlock, release) that run after the
// caller's context may already be cancelled.
const CleanupTimeout = 5 * time.Second

// CleanupContext returns a context that keeps ctx's values but not its cancellation, bounded by
// CleanupTimeout: cleanup SQL must run even when the work it cleans up after was cancelled.
func CleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), CleanupTimeout)
}
