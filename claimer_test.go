package sqlbroker

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/sqlbroker/watermill-sqlbroker/internal/offsets"
)

// The claim loop looks at the leases that ran out (the walk of the group's held claims, whose
// dead versions a held snapshot keeps) once per idle poll interval, on its own due times, after a
// failed claim and while such looks take claims back; a short claim is followed by the look
// at the claims given back only, whose cost does not grow with the claims settled. The first
// look reads every claim; later ones read the leases that ran out recently.
func TestDueState_shortClaimsLookAtGivenBackOnly(t *testing.T) {
	const poll = time.Second
	c := &claimer{}
	st := dueState{all: true}
	t0 := time.Unix(1_000_000, 0)
	fresh := []offsets.Claimed{{Offset: 1, Attempts: 1}}
	again := []offsets.Claimed{{Offset: 1, Attempts: 2, Again: true}}

	steps := []struct {
		name    string            // what came before the claim
		at      time.Duration     // since t0
		own     time.Duration     // a due time of the subscription's own, since t0 (0: none)
		claimed []offsets.Claimed // the claim's outcome: what it took of n, or err
		n       int
		err     error
		want    offsets.Due // what the claim looks at
	}{
		{name: "first claim", claimed: fresh, n: 10, want: offsets.DueAll},
		{name: "after a short claim", at: 10 * time.Millisecond, claimed: fresh, n: 1, want: offsets.DueGivenBack},
		{name: "after a full claim", at: 20 * time.Millisecond, claimed: fresh, n: 10, want: offsets.DueNone},
		{name: "after a short claim again", at: 30 * time.Millisecond, claimed: again, n: 1, want: offsets.DueGivenBack},
		{name: "after claims given back were taken again", at: 40 * time.Millisecond, claimed: again, n: 1, want: offsets.DueGivenBack},
		{name: "the poll interval passed", at: poll, claimed: again, n: 1, want: offsets.DueRecent},
		{name: "after a look filled with claims taken again", at: poll + 10*time.Millisecond, claimed: again, n: 2, want: offsets.DueRecent},
		{name: "after a look short of claims taken again", at: poll + 15*time.Millisecond, claimed: fresh, n: 1, want: offsets.DueGivenBack},
		{name: "an own due time came", at: poll + 30*time.Millisecond, own: poll + 20*time.Millisecond, n: 1, err: errors.New("refused"), want: offsets.DueRecent},
		{name: "after a failure", at: poll + 40*time.Millisecond, claimed: fresh, n: 1, want: offsets.DueRecent},
		{name: "after a look that took new messages only", at: poll + 50*time.Millisecond, claimed: fresh, n: 1, want: offsets.DueNone},
	}
	for _, s := range steps {
		if s.own != 0 {
			c.dueAt.add(t0.Add(s.own).UnixNano())
		}
		now := t0.Add(s.at)
		got, _ := c.wantDue(&st, now)
		if got != s.want {
			t.Fatalf("%s: the claim looks at %v, want %v", s.name, got, s.want)
		}
		cs := s.claimed
		if s.err != nil {
			cs = nil
		}
		st.claimed(got, now, poll, cs, s.n, s.err)
	}
}

// A look at the leases that ran out reads the recent ones only while the subscription's
// looks leave no gap in time: the last one that left nothing behind began less than half
// the window ago. A gap, a failed or filled look at every claim, and the periodic look at
// every claim make it read every claim.
func TestDueState_recentLooksLeaveNoGap(t *testing.T) {
	const poll = time.Second
	t0 := time.Unix(1_000_000, 0)
	fresh := []offsets.Claimed{{Offset: 1, Attempts: 1}}
	again := []offsets.Claimed{{Offset: 1, Attempts: 2, Again: true}}
	c := &claimer{}
	st := dueState{all: true}
	look := func(name string, at time.Duration, cs []offsets.Claimed, n int, err error, want offsets.Due) {
		t.Helper()
		now := t0.Add(at)
		got, _ := c.wantDue(&st, now)
		if got != want {
			t.Fatalf("%s: the claim looks at %v, want %v", name, got, want)
		}
		st.claimed(got, now, poll, cs, n, err)
	}
	look("first claim", 0, fresh, 10, nil, offsets.DueAll)
	for i := 1; i < fullLookPolls; i++ {
		look(fmt.Sprintf("look %d, a poll interval after the one before", i), time.Duration(i)*poll, fresh, 10, nil, offsets.DueRecent)
	}
	at := fullLookPolls * poll
	look("the periodic look at every claim", at, fresh, 10, nil, offsets.DueAll)
	at += poll
	look("a poll interval later", at, again, 1, nil, offsets.DueRecent)
	at += poll
	look("after a recent look filled with claims taken again", at, again, 1, nil, offsets.DueRecent)
	at += offsets.RecentWindow / 2
	look("half the window after the last look that left nothing behind", at, again, 1, nil, offsets.DueAll)
	at += 10 * time.Millisecond
	look("after a look at every claim filled with claims taken again", at, nil, 1, errors.New("cancelled"), offsets.DueAll)
	at += 10 * time.Millisecond
	look("after a look at every claim that failed", at, fresh, 10, nil, offsets.DueAll)
	at += poll
	look("a poll interval after a look at every claim that left nothing behind", at, fresh, 10, nil, offsets.DueRecent)
}
