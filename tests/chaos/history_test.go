package chaos

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sqlbroker/watermill-sqlbroker/internal/testdb"
)

// The history check: every refused settlement, every lost claim and every duplicate handling
// is explained by something that really happened, or the run fails with the offsets and the
// history of each. What may explain what:
//
//   - a duplicate: the process that handled the message before was killed or frozen past its
//     lease afterwards, stopped cleanly while the test held a table lock (its settlement could
//     not be applied before its shutdown's deadline), or it recorded, for that offset, a lost
//     claim, a refused settlement or a settlement not applied, itself explained; or the
//     process that handled it next recorded, for that offset, a lost claim, a refused
//     settlement or a settlement not applied, itself explained (it held the message through a
//     freeze past its lease, say, and its handler ran on after the process woke up, while
//     another consumer had handled the message meanwhile). The two handlings are taken in the
//     order of their deliveries, by attempt: a killed consumer's record of its handling may be
//     written after the next delivery's;
//   - a refused settlement: a lost claim of that offset in that process, itself explained (for
//     a refusal that says its claim was lost before, the process's latest loss of that offset,
//     which may precede the handler of a later delivery of the same offset); the
//     process frozen past its lease; a lease-mode lease that ran out under a table lock (or, on
//     SQLite, the file's write lock held by a frozen process) held longer than the lease; an advisory-mode settlement after the process's own shutdown
//     released its lock;
//   - a lost claim: the process frozen past its lease; in lease mode, a table lock (on SQLite,
//     the write lock of a frozen process) held longer than the lease; in advisory mode, the failure of the lock connection, explained only by
//     the test terminating a backend of that process (or restarting the server) just before: a
//     lock connection the library closed by itself is a defect.

// resultRow is one handling recorded by a consumer.
type resultRow struct {
	UUID     string
	Consumer string
	Attempt  int
	Kind     string
	At       time.Time
	Off      int64
}

// leaseOf gives the lease settings of a process (by its fleet).
type leaseOf func(proc string) (ttl, renew time.Duration, advisory bool)

type checker struct {
	faults []fault
	events []event
	lease  leaseOf
	logs   map[string]string // the log file of each process, by its id; a story prints what they said
}

// verdict is the outcome of the check for one fleet's results.
type verdict struct {
	refusals, losses, duplicates int
	lockConns, lockConnsAlone    int            // lock connections that failed; of them, not explained by a fault
	byWhy                        map[string]int // explained refusals, losses and duplicates, by reason
	unexplained                  []string       // each with its history
	unexplainedRefusals          int
	unexplainedLosses            int
	unexplainedDuplicates        int
}

func ts(n int64) time.Time { return time.Unix(0, n) }

func hits(f fault, proc string) bool { return len(f.Procs) == 0 || slices.Contains(f.Procs, proc) }

func isLockWindow(kind string) bool {
	return kind == faultTableLock || kind == faultAlter || kind == faultStopLock || kind == faultWriteLock
}

// frozen: a freeze of proc longer than the lease that ended while the delivery that began at
// began was in work, at most a lease before at. A delivery the process already held when it
// was stopped (handed out, its handler not yet scheduled) logs its beginning only once the
// process runs again: one that began within a second after the freeze and was lost sooner than
// a whole lease after it had its lease from before the freeze (a claim made after the freeze
// holds a whole lease), so the freeze explains it too.
func (c *checker) frozen(proc string, began, at time.Time) (string, bool) {
	ttl, _, _ := c.lease(proc)
	for _, f := range c.faults {
		heldThrough := began.Before(f.End) ||
			(began.Before(f.End.Add(time.Second)) && at.Sub(began) < ttl)
		if f.Kind == faultFreeze && hits(f, proc) && f.End.Sub(f.Start) >= ttl && heldThrough &&
			!at.Before(f.Start) && at.Before(f.End.Add(ttl+2*time.Second)) {
			return fmt.Sprintf("frozen for %s (lease %s)", f.End.Sub(f.Start).Round(time.Millisecond), ttl), true
		}
	}
	return "", false
}

// lockReachSlack is how late an extension may reach the server: one due just before the
// test's lock began, but sent after it (a loaded machine under the race detector runs the
// extender's tick, or hands it a connection, a few hundred milliseconds late) and queued on
// the server behind the lock, is not the extension that held the lease. A run in CI lost a
// lease 1.246 s after a 7.5 s table lock began, with a lease of 2 s renewed every 500 ms: its
// extension due 250 ms before the lock reached the server after the lock.
const lockReachSlack = 500 * time.Millisecond

// underLock: lease mode, a table lock held longer than the lease (less the renew interval)
// while the delivery was in work, and at within it or a lease after.
//
// A lease runs out a lease after its last extension (or its claim) that the server applied.
// Extensions run every renew interval, so the last one applied before the lock began at most
// a renew interval (and lockReachSlack) before it: a lease lost sooner than a lease, less
// that, after the lock began was lost without the lock having held it back. The bound is
// taken from the lock's start, not the handler's: a claim waits for a free handler, its lease
// extended meanwhile, so the handler may begin well after the lease's last extension.
func (c *checker) underLock(proc string, began, at time.Time) (string, bool) {
	ttl, renew, advisory := c.lease(proc)
	if advisory {
		return "", false
	}
	for _, f := range c.faults {
		if isLockWindow(f.Kind) && f.End.Sub(f.Start) >= ttl-renew && began.Before(f.End) &&
			at.Sub(f.Start) >= ttl-renew-lockReachSlack &&
			!at.Before(f.Start) && at.Before(f.End.Add(ttl+2*time.Second)) {
			return fmt.Sprintf("lease ran out under a %s of %s (lease %s)", f.Kind, f.End.Sub(f.Start).Round(time.Millisecond), ttl), true
		}
	}
	return "", false
}

func (c *checker) restarted(at time.Time) (string, bool) {
	for _, f := range c.faults {
		if f.Kind == faultRestart && !at.Before(f.Start) && at.Before(f.End.Add(10*time.Second)) {
			return "PostgreSQL restarted", true
		}
	}
	return "", false
}

// lockConn explains the failure of a lock connection.
func (c *checker) lockConn(e event) (string, bool) {
	at := ts(e.At)
	for _, f := range c.faults {
		if f.Kind == faultTerminate && hits(f, e.Proc) && !at.Before(f.Start.Add(-100*time.Millisecond)) && at.Before(f.End.Add(3*time.Second)) {
			return "its backend terminated by the test", true
		}
	}
	return c.restarted(at)
}

// loss explains a lost claim.
func (c *checker) loss(e event) (string, bool) {
	began, at := ts(e.Began), ts(e.At)
	if why, ok := c.frozen(e.Proc, began, at); ok {
		return why, true
	}
	if e.Kind == evLeaseLost {
		if why, ok := c.underLock(e.Proc, began, at); ok {
			return why, true
		}
	}
	if e.Kind == evLockLost {
		for _, lc := range c.events {
			if lc.Proc == e.Proc && lc.Kind == evLockConn && lc.At <= e.At && e.At-lc.At <= int64(time.Second) {
				if why, ok := c.lockConn(lc); ok {
					return "lock connection failed, " + why, true
				}
				return "", false
			}
		}
	}
	return c.restarted(at)
}

// lossOf finds the lost claim of e's delivery (same process and offset, after its handler
// began; the log line may come just after the refusal that read it).
//
// A refusal that says its claim was lost before (LostBefore) belongs to a delivery whose loss
// the process logged, but not necessarily to the delivery whose handler began last: a
// subscription takes a message again once its own claim of it ran out, and the new delivery's
// handler may begin before the old delivery's settlement is refused (a nack queued behind a
// table lock, refused once the lock went). Its loss is then the process's latest for the
// offset before the refusal (a later delivery's loss comes after the later delivery began, and
// the later delivery began after the earlier one was lost), or, the log line coming just
// after the refusal that read it, the first one after.
func (c *checker) lossOf(e event) (event, bool) {
	var latest, next event
	for _, l := range c.events {
		if l.Proc != e.Proc || l.Offset != e.Offset || (l.Kind != evLeaseLost && l.Kind != evLockLost) {
			continue
		}
		if !e.LostBefore {
			if l.At >= e.Began && l.At <= e.At+int64(time.Second) {
				return l, true
			}
			continue
		}
		switch {
		case l.At <= e.At && e.At-l.At <= int64(30*time.Second) && l.At > latest.At:
			latest = l
		case l.At > e.At && l.At <= e.At+int64(time.Second) && (next.At == 0 || l.At < next.At):
			next = l
		}
	}
	if latest.At != 0 {
		return latest, true
	}
	return next, next.At != 0
}

func (c *checker) shutdownBefore(proc string, at int64) bool {
	for _, e := range c.events {
		if e.Proc == proc && e.Kind == evShutdown && e.At <= at {
			return true
		}
	}
	return false
}

// refusal explains a refused settlement (or one not applied).
func (c *checker) refusal(e event) (string, bool) {
	if e.Closed && c.shutdownBefore(e.Proc, e.At) {
		return "refused after its own shutdown released the lock", true
	}
	if e.Kind == evNotApplied && c.shutdownBefore(e.Proc, e.At) {
		return "failed while its subscriber shut down", true
	}
	if l, ok := c.lossOf(e); ok {
		if why, ok := c.loss(l); ok {
			return "claim lost before: " + why, true
		}
		return "", false
	}
	began, at := ts(e.Began), ts(e.At)
	if why, ok := c.frozen(e.Proc, began, at); ok {
		return why, true
	}
	if why, ok := c.underLock(e.Proc, began, at); ok {
		return why, true
	}
	if why, ok := c.lockTerminated(e.Proc, began, at); ok {
		return why, true
	}
	return c.restarted(at)
}

// lockTerminated: advisory mode, the test terminated the process's backends, its lock
// connection's among them, while it held the message (from its claim, at most claimAhead
// before its handler began, to the refusal at at). The lock went with the session and another
// consumer could take the message; a refusal that comes before the process noticed the
// connection's failure logs no lost lock for it.
func (c *checker) lockTerminated(proc string, began, at time.Time) (string, bool) {
	if _, _, advisory := c.lease(proc); !advisory {
		return "", false
	}
	const claimAhead = 10 * time.Second
	for _, f := range c.faults {
		if f.Kind == faultTerminate && hits(f, proc) && !f.Start.Before(began.Add(-claimAhead)) && !f.Start.After(at) {
			return "lock connection's backend terminated by the test while it held the message", true
		}
	}
	return "", false
}

// duplicate explains the handling next of a message handled before by prev: by a fault of
// either handling.
func (c *checker) duplicate(prev, next resultRow) (string, bool) {
	if why, ok := c.duplicateBefore(prev); ok {
		return why, true
	}
	if why, ok := c.handlingFault(next); ok {
		return "the later handling's " + why, true
	}
	return "", false
}

// duplicateBefore explains a duplicate by what happened to the handling before it, prev.
func (c *checker) duplicateBefore(prev resultRow) (string, bool) {
	for _, f := range c.faults {
		if f.Kind == faultKill && hits(f, prev.Consumer) && !f.Start.Before(prev.At.Add(-time.Second)) && f.Start.Before(prev.At.Add(10*time.Second)) {
			return "killed before its ack applied", true
		}
	}
	ttl, _, _ := c.lease(prev.Consumer)
	for _, f := range c.faults {
		if f.Kind == faultFreeze && hits(f, prev.Consumer) && f.End.Sub(f.Start) >= ttl && !f.End.Before(prev.At) &&
			f.Start.Before(prev.At.Add(10*time.Second)) {
			return "frozen past its lease before its ack applied", true
		}
		if f.Kind == faultStopLock && hits(f, prev.Consumer) && !f.End.Before(prev.At) {
			return "stopped while the test held a table lock: its ack not applied by its shutdown's deadline", true
		}
	}
	return c.handlingFault(prev)
}

// handlingFault explains a handling by a lost claim, a refused settlement or a settlement not
// applied that its process recorded for its offset, for the delivery it handled (its handler
// began before the handling was recorded, at most 10 s before), itself explained.
func (c *checker) handlingFault(r resultRow) (string, bool) {
	for _, e := range c.events {
		if e.Proc != r.Consumer || e.Offset != r.Off || ts(e.Began).After(r.At) || ts(e.Began).Before(r.At.Add(-10*time.Second)) || e.At < e.Began {
			continue
		}
		switch e.Kind {
		case evLeaseLost, evLockLost:
			if why, ok := c.loss(e); ok {
				return "claim lost: " + why, true
			}
		case evRefused, evNotApplied:
			if why, ok := c.refusal(e); ok {
				return "settlement " + e.Kind + ": " + why, true
			}
		}
	}
	return "", false
}

// check runs the history check on the events of the processes whose ids start with name and on
// their results table.
func (c *checker) check(t *testing.T, name, results string) verdict {
	v := verdict{byWhy: map[string]int{}}
	mine := func(proc string) bool { return strings.HasPrefix(proc, name) }
	for _, e := range c.events {
		if !mine(e.Proc) {
			continue
		}
		switch e.Kind {
		case evRefused, evNotApplied:
			v.refusals++
			if why, ok := c.refusal(e); ok {
				v.byWhy[e.Kind+": "+why]++
			} else {
				v.unexplainedRefusals++
				v.unexplained = append(v.unexplained, c.story(t, fmt.Sprintf("unexplained %s %s", e.Kind, e.Op), e.Offset, results))
			}
		case evLockConn:
			// A lock connection that failed without a fault loses no claim when it held no
			// lock; one that held locks shows as lost claims, which must be explained.
			v.lockConns++
			if _, ok := c.lockConn(e); !ok {
				v.lockConnsAlone++
			}
		case evLeaseLost, evLockLost:
			v.losses++
			if why, ok := c.loss(e); ok {
				v.byWhy[e.Kind+": "+why]++
			} else {
				v.unexplainedLosses++
				v.unexplained = append(v.unexplained, c.story(t, "unexplained "+e.Kind, e.Offset, results))
			}
		}
	}
	rows := readResults(t, results, "WHERE kind = 'done' AND uuid IN (SELECT uuid FROM "+results+" WHERE kind = 'done' GROUP BY uuid HAVING count(*) > 1)")
	byUUID := map[string][]resultRow{}
	var order []string
	for _, r := range rows {
		if _, ok := byUUID[r.UUID]; !ok {
			order = append(order, r.UUID)
		}
		byUUID[r.UUID] = append(byUUID[r.UUID], r)
	}
	for _, u := range order {
		rs := byUUID[u]
		orderHandlings(rs)
		for i := 1; i < len(rs); i++ {
			v.duplicates++
			if why, ok := c.duplicate(rs[i-1], rs[i]); ok {
				v.byWhy["duplicate: "+why]++
			} else {
				v.unexplainedDuplicates++
				v.unexplained = append(v.unexplained, c.story(t, "unexplained duplicate of "+rs[i-1].Consumer+"'s handling by "+rs[i].Consumer, rs[i-1].Off, results))
			}
		}
	}
	return v
}

// orderHandlings puts the handlings of one message in the order of their deliveries: by
// attempt (every claim of a handled delivery counts one more), then by when they were recorded.
// The time of a handling is when the database ran its insert, which may come after its
// process was killed (the statement was on its way) and after the next delivery's handling:
// ordered by that time, a handling whose consumer was killed before its ack applied would be
// taken for the later one, and its kill would explain nothing.
func orderHandlings(rs []resultRow) {
	sort.SliceStable(rs, func(i, j int) bool {
		if rs[i].Attempt != rs[j].Attempt {
			return rs[i].Attempt < rs[j].Attempt
		}
		return rs[i].At.Before(rs[j].At)
	})
}

// story is the history of one offset: its handlings, the events of every process about it, and
// the faults around them.
func (c *checker) story(t *testing.T, what string, off int64, results string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: offset %d\n", what, off)
	var from, to time.Time
	for _, r := range readResults(t, results, fmt.Sprintf("WHERE off = %d", off)) {
		fmt.Fprintf(&b, "  %s handled by %s attempt %d: %s\n", r.At.Format("15:04:05.000"), r.Consumer, r.Attempt, r.Kind)
		if from.IsZero() || r.At.Before(from) {
			from = r.At
		}
		if r.At.After(to) {
			to = r.At
		}
	}
	for _, e := range c.events {
		if e.Offset == off && e.Kind != evShutdown {
			fmt.Fprintf(&b, "  %s %s: %s %s (handler began %s, lost before %t, closed %t) %s\n", ts(e.At).Format("15:04:05.000"), e.Proc, e.Kind, e.Op,
				ts(e.Began).Format("15:04:05.000"), e.LostBefore, e.Closed, e.Err)
			if from.IsZero() || ts(e.At).Before(from) {
				from = ts(e.At)
			}
			if ts(e.At).After(to) {
				to = ts(e.At)
			}
		}
	}
	for _, f := range c.faults {
		if f.End.After(from.Add(-10*time.Second)) && f.Start.Before(to.Add(10*time.Second)) {
			fmt.Fprintf(&b, "  fault %s %v %s .. %s\n", f.Kind, f.Procs, f.Start.Format("15:04:05.000"), f.End.Format("15:04:05.000"))
		}
	}
	for _, e := range c.events {
		if e.Kind == evLockConn && ts(e.At).After(from.Add(-10*time.Second)) && ts(e.At).Before(to.Add(10*time.Second)) {
			fmt.Fprintf(&b, "  %s %s: lock connection failed: %s\n", ts(e.At).Format("15:04:05.000"), e.Proc, e.Err)
		}
	}
	seen := map[string]bool{}
	for _, e := range c.events {
		if e.Offset != off || seen[e.Proc] || c.logs[e.Proc] == "" {
			continue
		}
		seen[e.Proc] = true
		b.WriteString(logAround(c.logs[e.Proc], e.Proc, from.Add(-3*time.Second), to.Add(time.Second), 30))
	}
	return b.String()
}

// logAround returns the lines of a process's log (watermill's standard logger: each line
// stamped to the microsecond) between from and to, at Info level or above, at most n of them:
// what the library said of the claims and statements around an unexplained event (an
// extension that failed, and why).
func logAround(path, proc string, from, to time.Time, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("  log of %s: %v\n", proc, err)
	}
	var b strings.Builder
	count := 0
	for _, line := range strings.Split(string(data), "\n") {
		rest, ok := strings.CutPrefix(line, "[watermill] ")
		if !ok || len(rest) < 26 || strings.Contains(rest, "level=DEBUG") || strings.Contains(rest, "level=TRACE") {
			continue
		}
		at, err := time.ParseInLocation("2006/01/02 15:04:05.000000", rest[:26], time.Local)
		if err != nil || at.Before(from) || at.After(to) {
			continue
		}
		if count == n {
			fmt.Fprintf(&b, "  log %s: more lines left out\n", proc)
			break
		}
		count++
		fmt.Fprintf(&b, "  log %s %s\n", proc, rest[11:])
	}
	return b.String()
}

func readResults(t *testing.T, results, where string) []resultRow {
	rows, err := testdb.Pgx(t).Query(context.Background(), "SELECT uuid, consumer, attempt, kind, at, off FROM "+results+" "+where+" ORDER BY at")
	require.NoError(t, err)
	defer rows.Close()
	var out []resultRow
	for rows.Next() {
		var r resultRow
		require.NoError(t, rows.Scan(&r.UUID, &r.Consumer, &r.Attempt, &r.Kind, &r.At, &r.Off))
		out = append(out, r)
	}
	require.NoError(t, rows.Err())
	return out
}

// fmtWhy lists the explained counts, most frequent first.
func fmtWhy(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool { return m[keys[i]] > m[keys[j]] || m[keys[i]] == m[keys[j]] && keys[i] < keys[j] })
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "    %5d  %s\n", m[k], k)
	}
	return b.String()
}
