package main

import (
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
)

// newPayload returns size random bytes: incompressible, so TOAST and the wire see the real size.
func newPayload(size int) []byte {
	p := make([]byte, size)
	_, _ = rand.Read(p)
	return p
}

// newMessages builds n messages sharing payload; UUIDs are made before any timing starts.
func newMessages(n int, payload []byte) []*message.Message {
	msgs := make([]*message.Message, n)
	for i := range msgs {
		msgs[i] = message.NewMessage(watermill.NewUUID(), payload)
	}
	return msgs
}

// publishBacklog publishes n messages in calls of batch, before a scenario's timing starts.
func publishBacklog(ctx context.Context, pub message.Publisher, topic string, n, batch int, newMsg func(i int) *message.Message) error {
	for done := 0; done < n; {
		if err := ctx.Err(); err != nil {
			return context.Cause(ctx)
		}
		k := min(batch, n-done)
		msgs := make([]*message.Message, k)
		for j := range msgs {
			msgs[j] = newMsg(done + j)
		}
		if err := pub.Publish(topic, msgs...); err != nil {
			return fmt.Errorf("publish backlog (%d of %d done): %w", done, n, err)
		}
		done += k
	}
	return nil
}

// cpuTicks is the CPU time of this process and of the server backends of one contender.
type cpuTicks struct {
	self    time.Duration
	backend map[int]time.Duration // by backend pid
}

func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// clkTck is USER_HZ, the unit of utime and stime in /proc/<pid>/stat; 100 on Linux.
const clkTck = 100

// procCPU reads utime+stime of a process from /proc; false when it is gone or unreadable
// (PostgreSQL on another host).
func procCPU(pid int) (time.Duration, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, false
	}
	s := string(b)
	// The command name is in parentheses and may hold spaces; fields follow the last ')'.
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, false
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, false
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, false
	}
	return time.Duration(ut+st) * time.Second / clkTck, true
}

// snapCPU reads the CPU time of this process and of every server backend whose
// application_name is app.
func snapCPU(ctx context.Context, admin *pgxpool.Pool, app string) cpuTicks {
	t := cpuTicks{self: selfCPU(), backend: map[int]time.Duration{}}
	rows, err := admin.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1`, app)
	if err != nil {
		return t
	}
	defer rows.Close()
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) == nil {
			if d, ok := procCPU(pid); ok {
				t.backend[pid] = d
			}
		}
	}
	return t
}

// cpuUse is the CPU spent between two snapshots.
type cpuUse struct {
	client, server time.Duration
	serverKnown    bool
}

func cpuBetween(a, b cpuTicks) cpuUse {
	u := cpuUse{client: b.self - a.self, serverKnown: len(b.backend) > 0}
	for pid, d := range b.backend {
		u.server += d - a.backend[pid]
	}
	return u
}

// memSampler records the peak of HeapInuse and Sys while it runs.
type memSampler struct {
	stop chan struct{}
	done chan struct{}

	mu                 sync.Mutex
	peakHeap, peakSys  uint64
	startHeap, samples uint64
}

func startMemSampler(every time.Duration) *memSampler {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	m := &memSampler{stop: make(chan struct{}), done: make(chan struct{}), startHeap: ms.HeapInuse,
		peakHeap: ms.HeapInuse, peakSys: ms.Sys}
	go func() {
		defer close(m.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-m.stop:
				return
			case <-t.C:
			}
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			m.mu.Lock()
			m.peakHeap = max(m.peakHeap, ms.HeapInuse)
			m.peakSys = max(m.peakSys, ms.Sys)
			m.samples++
			m.mu.Unlock()
		}
	}()
	return m
}

func (m *memSampler) finish() (peakHeap, peakSys, startHeap uint64) {
	close(m.stop)
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.peakHeap, m.peakSys, m.startHeap
}

// percentile returns the p-th percentile (0..100) of sorted durations, nearest rank.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	k := int(float64(len(sorted))*p/100+0.999999) - 1
	k = max(0, min(k, len(sorted)-1))
	return sorted[k]
}

func sortDurations(d []time.Duration) { slices.Sort(d) }

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func mib(b uint64) float64 { return float64(b) / (1 << 20) }

// profilePath inserts the contender's name, and the run's when it is not "", before the
// extension of path.
func profilePath(path string, c contender, run string) string {
	ext := filepath.Ext(path)
	name := "-" + c.String()
	if run != "" {
		name += "-" + run
	}
	return strings.TrimSuffix(path, ext) + name + ext
}

// startProfile starts a CPU profile to path and returns what stops it; a failure to start is
// noted and profiling is skipped.
func startProfile(path string, b *bench) func() error {
	f, err := os.Create(path)
	if err != nil {
		b.results.note(fmt.Sprintf("CPU profile: %v", err))
		return nil
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		_ = f.Close()
		b.results.note(fmt.Sprintf("CPU profile %s: %v", path, err))
		return nil
	}
	b.logf("  CPU profile to %s", path)
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}
}
