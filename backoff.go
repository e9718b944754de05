package sqlbroker

import (
	"math/rand/v2"
	"time"
)

// nackBackoff is how long a message nacked at its attempt-th delivery waits before it can be
// claimed again: NackBackoff doubled for every attempt after the first, with up to a fifth
// more at random, capped at MaxNackBackoff; 0 with NoBackoff. It is never shorter than
// NackBackoff, so a nacked message is never claimed before the configured wait.
func (c *SubscriberConfig) nackBackoff(attempt int) time.Duration {
	if c.NackBackoff <= 0 {
		return 0
	}
	d := c.NackBackoff
	for i := 1; i < attempt && d < c.MaxNackBackoff; i++ {
		d *= 2
	}
	if d >= c.MaxNackBackoff {
		return c.MaxNackBackoff
	}
	if j := int64(d / 5); j > 0 {
		d += time.Duration(rand.Int64N(j))
	}
	return min(d, c.MaxNackBackoff)
}
