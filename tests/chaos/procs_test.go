package chaos

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// proc is one consumer process.
type proc struct {
	id      string
	logPath string
	cmd     *exec.Cmd
	ready   chan struct{} // closed when its Router runs
	done    chan struct{} // closed when it has exited and its output is read
	killed  bool          // ended by SIGKILL
	frozen  bool          // stopped with SIGSTOP for longer than a lease, then continued
	revived bool          // exited by itself (its Router could not run) and was started again
	stopped bool          // stopped with SIGTERM in the middle of the run, then started again
	exitErr error
}

// fault is one fault the test injected, for the history check: its kind, the processes it hit
// (none: every process, such as a table lock) and when.
type fault struct {
	Kind       string // see the fault* constants
	Procs      []string
	Start, End time.Time
}

const (
	faultKill      = "kill"      // SIGKILL
	faultFreeze    = "freeze"    // SIGSTOP for longer than the lease, then SIGCONT
	faultTerminate = "terminate" // pg_terminate_backend of library connections of Procs
	faultTableLock = "tablelock" // LOCK TABLE of the topic's tables, held by the test
	faultAlter     = "alter"     // ALTER TABLE queued behind a long transaction, and what queued behind it
	faultStopLock  = "stoplock"  // a clean stop (SIGTERM) of Procs while the test holds a table lock
	faultRestart   = "restart"   // PostgreSQL restarted
	faultWriteLock = "writelock" // SQLite: a process frozen inside a write transaction holds the file's write lock
)

// history keeps the faults of a run and the events every consumer process printed.
type history struct {
	mu     sync.Mutex
	faults []fault
	events []event
}

func (h *history) add(f fault) {
	h.mu.Lock()
	h.faults = append(h.faults, f)
	h.mu.Unlock()
}

func (h *history) addEvent(e event) {
	h.mu.Lock()
	h.events = append(h.events, e)
	h.mu.Unlock()
}

func (h *history) snapshot() ([]fault, []event) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]fault(nil), h.faults...), append([]event(nil), h.events...)
}

// fleet starts, kills and stops the consumer processes of one scenario, and keeps the figures
// they print.
type fleet struct {
	t       *testing.T
	name    string // the first letter of its process ids: "c1g3"
	hist    *history
	dir     string
	base    consumerConfig
	urlFor  func(slot, gen int) string // the library URL of a process (driver and application_name)
	maxConn func(slot int) int

	mu      sync.Mutex
	slots   []*proc
	gens    []int
	all     []*proc
	last    map[string]consumerReport // last CHAOS-STATS or CHAOS-FINAL of each process
	final   map[string]bool
	killedN int
}

func newFleet(t *testing.T, name string, hist *history, n int, base consumerConfig, urlFor func(slot, gen int) string, maxConn func(int) int) *fleet {
	f := &fleet{t: t, name: name, hist: hist, dir: t.TempDir(), base: base, urlFor: urlFor, maxConn: maxConn,
		slots: make([]*proc, n), gens: make([]int, n), last: map[string]consumerReport{}, final: map[string]bool{}}
	t.Cleanup(f.killAll)
	for i := range n {
		f.start(i)
	}
	for i := range n {
		f.waitReady(i)
	}
	return f
}

// start starts the next generation of slot i.
func (f *fleet) start(i int) *proc {
	f.mu.Lock()
	f.gens[i]++
	gen := f.gens[i]
	f.mu.Unlock()
	cfg := f.base
	cfg.ID = fmt.Sprintf("%s%dg%d", f.name, i, gen)
	cfg.URL = f.urlFor(i, gen)
	cfg.MaxConns = f.maxConn(i)
	b, err := json.Marshal(cfg)
	if err != nil {
		f.t.Fatal(err)
	}
	p := &proc{id: cfg.ID, logPath: filepath.Join(f.dir, cfg.ID+".log"), ready: make(chan struct{}), done: make(chan struct{})}
	logFile, err := os.Create(p.logPath)
	if err != nil {
		f.t.Fatal(err)
	}
	p.cmd = exec.Command(os.Args[0], "-test.run=^$")
	p.cmd.Env = append(os.Environ(), envConsumer+"="+string(b))
	p.cmd.Stderr = logFile
	stdout, err := p.cmd.StdoutPipe()
	if err != nil {
		f.t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		f.t.Fatal(err)
	}
	go func() {
		defer close(p.done)
		defer logFile.Close()
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		readyOnce := sync.Once{}
		for sc.Scan() {
			line := sc.Text()
			kind, rest, _ := strings.Cut(line, " ")
			switch kind {
			case "CHAOS-READY":
				readyOnce.Do(func() { close(p.ready) })
			case "CHAOS-EVENT":
				var e event
				if json.Unmarshal([]byte(rest), &e) == nil {
					f.hist.addEvent(e)
				}
			case "CHAOS-STATS", "CHAOS-FINAL":
				var r consumerReport
				if json.Unmarshal([]byte(rest), &r) == nil {
					f.mu.Lock()
					f.last[r.ID] = r
					if kind == "CHAOS-FINAL" {
						f.final[r.ID] = true
					}
					f.mu.Unlock()
				}
			}
		}
		p.exitErr = p.cmd.Wait()
	}()
	f.mu.Lock()
	f.slots[i] = p
	f.all = append(f.all, p)
	f.mu.Unlock()
	return p
}

func (f *fleet) waitReady(i int) {
	f.mu.Lock()
	p := f.slots[i]
	f.mu.Unlock()
	select {
	case <-p.ready:
	case <-p.done:
		f.t.Fatalf("consumer %s exited before it ran: %v\n%s", p.id, p.exitErr, tail(p.logPath, 30))
	case <-time.After(30 * time.Second):
		f.t.Fatalf("consumer %s not running after 30s\n%s", p.id, tail(p.logPath, 30))
	}
}

// kill ends slot i's process with SIGKILL and waits for it to be gone.
func (f *fleet) kill(i int) *proc {
	f.mu.Lock()
	p := f.slots[i]
	p.killed = true
	f.killedN++
	f.mu.Unlock()
	at := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	f.hist.add(fault{Kind: faultKill, Procs: []string{p.id}, Start: at, End: at})
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		f.t.Fatalf("consumer %s still there 30s after SIGKILL", p.id)
	}
	return p
}

// freeze stops slot i's process with SIGSTOP for d, then continues it: a stall (a long GC
// pause, a frozen VM) longer than the lease, after which the process's late settlements are
// refused as stale (L3) and its message contexts cancelled (L4).
func (f *fleet) freeze(i int, d time.Duration) {
	f.mu.Lock()
	p := f.slots[i]
	p.frozen = true
	f.mu.Unlock()
	start := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGSTOP)
	time.Sleep(d) // the length of the stall
	end := time.Now()
	_ = p.cmd.Process.Signal(syscall.SIGCONT)
	f.hist.add(fault{Kind: faultFreeze, Procs: []string{p.id}, Start: start, End: end})
}

// stop stops slot i's process cleanly (SIGTERM: the Router and its hook shut the broker down)
// and waits until it has exited and printed its final report; the caller starts the slot again.
func (f *fleet) stop(i int) *proc {
	f.mu.Lock()
	p := f.slots[i]
	p.stopped = true
	f.mu.Unlock()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		if p.exitErr != nil {
			f.t.Errorf("consumer %s: %v\n%s", p.id, p.exitErr, tail(p.logPath, 40))
		}
	case <-time.After(30 * time.Second):
		f.t.Errorf("consumer %s did not stop within 30s of SIGTERM\n%s", p.id, tail(p.logPath, 40))
	}
	return p
}

// ids returns the ids of the running processes.
func (f *fleet) ids() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ids []string
	for _, p := range f.slots {
		ids = append(ids, p.id)
	}
	return ids
}

// revive starts again, as a supervisor would, every process that exited by itself: a consumer
// whose Subscribe failed (its connection was terminated while it started) ends with
// exitRunFailed. Any other exit fails the test.
func (f *fleet) revive() int {
	n := 0
	for i := range f.slots {
		f.mu.Lock()
		p := f.slots[i]
		f.mu.Unlock()
		select {
		case <-p.done:
		default:
			continue
		}
		if p.killed {
			continue
		}
		var exit *exec.ExitError
		if !errors.As(p.exitErr, &exit) || exit.ExitCode() != exitRunFailed {
			f.t.Errorf("consumer %s exited: %v\n%s", p.id, p.exitErr, tail(p.logPath, 40))
		}
		f.mu.Lock()
		p.revived = true
		f.mu.Unlock()
		f.start(i)
		n++
	}
	return n
}

// slotOf returns the slot of the process instance id ("c1g3" -> 1).
func (f *fleet) slotOf(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, p := range f.slots {
		if p != nil && p.id == id {
			return i
		}
	}
	return -1
}

// stopAll stops every running process with SIGTERM (a clean shutdown through the Router and
// its hook) and waits for them; a process that does not exit in time fails the test.
func (f *fleet) stopAll() {
	f.mu.Lock()
	running := append([]*proc(nil), f.slots...)
	f.mu.Unlock()
	for _, p := range running {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	for _, p := range running {
		select {
		case <-p.done:
			if p.exitErr != nil {
				f.t.Errorf("consumer %s: %v\n%s", p.id, p.exitErr, tail(p.logPath, 40))
			}
		case <-time.After(30 * time.Second):
			f.t.Errorf("consumer %s did not stop within 30s of SIGTERM\n%s", p.id, tail(p.logPath, 40))
		}
	}
}

// killAll kills whatever still runs (t.Cleanup), so no process outlives the test.
func (f *fleet) killAll() {
	f.mu.Lock()
	all := append([]*proc(nil), f.all...)
	f.mu.Unlock()
	for _, p := range all {
		select {
		case <-p.done:
			continue
		default:
		}
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			f.t.Errorf("consumer %s could not be killed", p.id)
		}
	}
}

// reports returns the last figures of every process, and whether each exited cleanly.
func (f *fleet) reports() (map[string]consumerReport, map[string]bool, []*proc) {
	f.mu.Lock()
	defer f.mu.Unlock()
	last := make(map[string]consumerReport, len(f.last))
	for k, v := range f.last {
		last[k] = v
	}
	final := make(map[string]bool, len(f.final))
	for k, v := range f.final {
		final[k] = v
	}
	return last, final, append([]*proc(nil), f.all...)
}

// logPaths returns the log file of every process the fleets started, by process id.
func logPaths(fleets ...*fleet) map[string]string {
	paths := map[string]string{}
	for _, f := range fleets {
		_, _, procs := f.reports()
		for _, p := range procs {
			paths[p.id] = p.logPath
		}
	}
	return paths
}

// tail returns the last n lines of a file.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return "--- " + filepath.Base(path) + "\n" + strings.Join(lines, "\n")
}
