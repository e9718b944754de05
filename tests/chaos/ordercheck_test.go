package chaos

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	sqlbroker "github.com/sqlbroker/watermill-sqlbroker"
	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The order check of a group ordered by key. Its consumers record, for every handling (one
// delivery of a message to a handler), a "start" row when the handler begins, and a "done" row
// (acked) or a "failed" row (nacked, panicked, timed out) when it ends; the rows' times are the
// server's, when it ran each insert, so a recorded span lies within the handler's real one.
// Per key, in the group's order (the messages' xid, then offset), it counts as an order
// violation:
//
//   - a handling of a message that started before the handling of the message before it whose
//     ack was applied had ended. The next message of a key is claimed only after that ack
//     committed, which comes after its "done" row: no fault explains this one. The handling
//     whose ack was applied is the one of the message's latest delivery (highest attempt) that
//     recorded "done": a delivery is claimed again only when the one before it was not settled.
//     For a message acked in the transaction that writes its "done" row, that row exists
//     exactly when the ack was applied, and a second one is counted apart (acked twice).
//   - a handling that ran beside another handling of its key, unless one of the two was not
//     the applied one and is explained as the duplicate check explains the handling before a
//     duplicate: its process was killed, frozen past its lease, stopped under a table lock, or
//     recorded for that offset a lost claim, or a refused settlement or one not applied,
//     itself explained. At-least-once: a process that held a message through a freeze longer
//     than its lease runs its handler on when it wakes, while another consumer handled the
//     message again and the key moved on; its ack is then refused.

// keyedMessage is one message with an order key, in the group's order.
type keyedMessage struct {
	Off   int64
	UUID  string
	Key   string
	InTx  bool // acked in the transaction that records it
	Index int  // its place among its key's messages
}

// handling is one delivery of a message to a handler, as its consumer recorded it.
type handling struct {
	Consumer string
	Attempt  int
	Off      int64
	UUID     string
	Start    time.Time
	End      time.Time // when it recorded "done" or "failed"; for a killed process, the kill
	EndKnown bool      // End was recorded or is the kill; otherwise the handling never ended
	Killed   bool      // its process was killed before it recorded its end
	Done     bool
	Dones    int // "done" rows of this delivery
}

func (h handling) String() string {
	end := "never ended"
	if h.Killed {
		end = "killed " + h.End.Format("15:04:05.000")
	} else if h.EndKnown {
		what := "failed"
		if h.Done {
			what = "done"
		}
		end = what + " " + h.End.Format("15:04:05.000")
	}
	return fmt.Sprintf("%s attempt %d: started %s, %s", h.Consumer, h.Attempt, h.Start.Format("15:04:05.000"), end)
}

// orderVerdict is the outcome of the order check.
type orderVerdict struct {
	keys, messages, handlings int
	startedEarly              int // handlings started before the one before them was acked
	overlaps                  int // handlings beside another of their key
	unexplainedOverlaps       int
	ackedTwice                int // messages acked in a transaction with more than one "done" row
	notHandled                int // keyed messages with no handling that recorded "done"
	maxInHandlers             int // handlings of the group in handlers at once (recorded spans)
	byWhy                     map[string]int
	unexplained               []string
}

// violations counts every order violation.
func (v orderVerdict) violations() int {
	return v.startedEarly + v.unexplainedOverlaps + v.ackedTwice
}

// readOrdered reads the group's keyed messages in its order, and the handlings of its results
// table; a handling that never recorded its end takes its end from a kill of its process.
func readOrdered(t *testing.T, messages, results string, faults []fault) ([]keyedMessage, []handling) {
	ctx := context.Background()
	db := testdb.Pgx(t)
	rows, err := db.Query(ctx, `SELECT "offset", uuid, metadata->>$1, metadata ? $2 FROM `+messages+
		` WHERE metadata ? $1 ORDER BY xid, "offset"`, sqlbroker.MetadataOrderKey, metaAckInTx)
	require.NoError(t, err)
	var msgs []keyedMessage
	for rows.Next() {
		var m keyedMessage
		require.NoError(t, rows.Scan(&m.Off, &m.UUID, &m.Key, &m.InTx))
		msgs = append(msgs, m)
	}
	rows.Close()
	require.NoError(t, rows.Err())

	type id struct {
		consumer string
		attempt  int
		off      int64
	}
	byID := map[id]*handling{}
	var ids []id
	for _, r := range readResults(t, results, "") {
		k := id{r.Consumer, r.Attempt, r.Off}
		h := byID[k]
		if h == nil {
			h = &handling{Consumer: r.Consumer, Attempt: r.Attempt, Off: r.Off, UUID: r.UUID}
			byID[k] = h
			ids = append(ids, k)
		}
		switch r.Kind {
		case "start":
			if h.Start.IsZero() || r.At.Before(h.Start) {
				h.Start = r.At
			}
		case "done", "failed":
			if r.Kind == "done" {
				h.Done = true
				h.Dones++
			}
			if !h.EndKnown || r.At.Before(h.End) {
				h.End, h.EndKnown = r.At, true
			}
		}
	}
	var hs []handling
	for _, k := range ids {
		h := byID[k]
		if h.Start.IsZero() {
			h.Start = h.End // no start recorded: the insert failed and so did the handling
		}
		if !h.EndKnown {
			for _, f := range faults {
				if f.Kind == faultKill && hits(f, h.Consumer) && !f.Start.Before(h.Start.Add(-time.Second)) {
					h.End, h.EndKnown, h.Killed = f.Start, true, true
					break
				}
			}
		}
		hs = append(hs, *h)
	}
	return msgs, hs
}

// checkOrder runs the order check on msgs (in the group's order) and their handlings; it
// explains a handling that was not the applied one with c, and tells its stories from results
// (none when results is empty: unit tests).
func (c *checker) checkOrder(t *testing.T, msgs []keyedMessage, hs []handling, results string) orderVerdict {
	v := orderVerdict{byWhy: map[string]int{}}
	byOff := map[int64][]handling{}
	for _, h := range hs {
		byOff[h.Off] = append(byOff[h.Off], h)
	}
	byKey := map[string][]keyedMessage{}
	var keys []string
	for _, m := range msgs {
		if _, ok := byKey[m.Key]; !ok {
			keys = append(keys, m.Key)
		}
		m.Index = len(byKey[m.Key])
		byKey[m.Key] = append(byKey[m.Key], m)
	}
	v.keys, v.messages = len(keys), len(msgs)
	// applied returns the handling of m whose ack was applied.
	applied := func(m keyedMessage) (handling, bool) {
		var best handling
		found := false
		for _, h := range byOff[m.Off] {
			if h.Done && (!found || h.Attempt > best.Attempt) {
				best, found = h, true
			}
		}
		return best, found
	}
	story := func(what string, offs ...int64) string {
		var b strings.Builder
		b.WriteString(what + "\n")
		for _, off := range offs {
			for _, h := range byOff[off] {
				fmt.Fprintf(&b, "  offset %d: %s\n", off, h)
			}
		}
		if results != "" {
			for _, off := range offs {
				b.WriteString(c.story(t, "  history", off, results))
			}
		}
		return b.String()
	}
	for _, k := range keys {
		ms := byKey[k]
		var keyHs []handling
		appliedOf := map[int64]handling{}
		for _, m := range ms {
			a, ok := applied(m)
			if ok {
				appliedOf[m.Off] = a
			} else {
				v.notHandled++
			}
			dones := 0
			for _, h := range byOff[m.Off] {
				dones += h.Dones
			}
			if m.InTx && dones > 1 {
				v.ackedTwice++
				v.unexplained = append(v.unexplained, story(fmt.Sprintf("key %s: message %d (offset %d), acked in its handler's transaction, acked %d times", k, m.Index, m.Off, dones), m.Off))
			}
			keyHs = append(keyHs, byOff[m.Off]...)
		}
		v.handlings += len(keyHs)
		// Each message's handlings start after the applied handling of the one before ended.
		for i := 1; i < len(ms); i++ {
			prev, ok := appliedOf[ms[i-1].Off]
			if !ok {
				continue // counted as not handled
			}
			for _, h := range byOff[ms[i].Off] {
				if h.Start.Before(prev.End) {
					v.startedEarly++
					v.unexplained = append(v.unexplained, story(fmt.Sprintf("key %s: message %d (offset %d) started by %s at %s, before message %d (offset %d) was acked: its applied handling by %s ended at %s",
						k, i, ms[i].Off, h.Consumer, h.Start.Format("15:04:05.000"), i-1, ms[i-1].Off, prev.Consumer, prev.End.Format("15:04:05.000")), ms[i-1].Off, ms[i].Off))
				}
			}
		}
		// No handling beside another of its key, unless one of them was not applied and is
		// explained.
		sort.Slice(keyHs, func(i, j int) bool { return keyHs[i].Start.Before(keyHs[j].Start) })
		for i := range keyHs {
			for j := i + 1; j < len(keyHs); j++ {
				a, b := keyHs[i], keyHs[j]
				if a.EndKnown && !b.Start.Before(a.End) {
					break // the later ones start later still
				}
				v.overlaps++
				why, ok := "", false
				for _, h := range []handling{a, b} {
					if ap, isApplied := appliedOf[h.Off]; isApplied && ap.Consumer == h.Consumer && ap.Attempt == h.Attempt {
						continue
					}
					if why, ok = c.explainHandling(h); ok {
						break
					}
				}
				if ok {
					v.byWhy["order overlap: "+why]++
					continue
				}
				v.unexplainedOverlaps++
				v.unexplained = append(v.unexplained, story(fmt.Sprintf("key %s: offset %d handled by %s beside offset %d handled by %s", k, a.Off, a.Consumer, b.Off, b.Consumer), a.Off, b.Off))
			}
		}
	}
	v.maxInHandlers = maxAtOnce(hs)
	return v
}

// explainHandling explains a handling that was not the applied one of its message, as the
// duplicate check explains the handling before a duplicate.
func (c *checker) explainHandling(h handling) (string, bool) {
	at := h.Start
	if h.EndKnown {
		at = h.End
	}
	r := resultRow{UUID: h.UUID, Consumer: h.Consumer, Attempt: h.Attempt, Kind: "done", At: at, Off: h.Off}
	if why, ok := c.duplicateBefore(r); ok {
		return why, true
	}
	r.At = h.Start
	return c.duplicateBefore(r)
}

// maxAtOnce returns the most handlings whose recorded spans overlap at one moment.
func maxAtOnce(hs []handling) int {
	type edge struct {
		at time.Time
		d  int
	}
	var es []edge
	for _, h := range hs {
		if !h.EndKnown || h.End.Before(h.Start) {
			continue
		}
		es = append(es, edge{h.Start, 1}, edge{h.End, -1})
	}
	sort.Slice(es, func(i, j int) bool {
		if !es[i].at.Equal(es[j].at) {
			return es[i].at.Before(es[j].at)
		}
		return es[i].d < es[j].d // an end before a start at the same instant
	})
	n, most := 0, 0
	for _, e := range es {
		n += e.d
		most = max(most, n)
	}
	return most
}
