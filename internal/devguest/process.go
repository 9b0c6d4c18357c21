package devguest

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// settleTimeout is how long, after a root process exits, the daemon waits
// for its output pipe to reach end-of-file before it reports the process
// exited. Descendants that keep the pipe open (a service started in the
// background) do not hold the exit back longer; their later output is still
// appended to the stream.
const settleTimeout = 200 * time.Millisecond

// leftoverPoll is how often a group whose root exited is checked for live members.
const leftoverPoll = 250 * time.Millisecond

// Most leftover processes listed in one report, and most bytes of one command.
const (
	maxLeftoversListed = 64
	maxCommandBytes    = 1024
)

// proc is one process handle: a root started in its own process group, its
// combined output stream, and its state.
type proc struct {
	id   string
	pgid int // the root's pid; the root leads its own group

	mu        sync.Mutex
	outStart  uint64 // stream offset of out[0]
	out       []byte
	outLimit  int
	outEOF    bool
	changed   chan struct{} // closed and replaced whenever output or state changes
	exited    bool          // the root exited and its output settled
	exit      *ProcessExit
	stoppedBy string
	leftovers *Leftovers
	rootDone  bool // the root has been reaped
	groupLive bool // after rootDone: members of the group live on
	cursor    uint64
	stdin     *inputQueue
	timers    []*time.Timer
}

func (p *proc) end() uint64 { return p.outStart + uint64(len(p.out)) }

// notifyLocked wakes every waiter; p.mu is held.
func (p *proc) notifyLocked() {
	close(p.changed)
	p.changed = make(chan struct{})
}

func (p *proc) appendOutput(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.out = append(p.out, b...)
	if len(p.out) > p.outLimit {
		// Drop down to three quarters of the limit, so the copy is amortised.
		drop := len(p.out) - p.outLimit*3/4
		n := copy(p.out, p.out[drop:])
		p.out = p.out[:n]
		p.outStart += uint64(drop)
	}
	p.notifyLocked()
}

// alive says whether anything of the process's group may still run.
func (p *proc) aliveLocked() bool { return !p.rootDone || p.groupLive }

func (p *proc) signalLocked(sig syscall.Signal) {
	if p.aliveLocked() {
		_ = unix.Kill(-p.pgid, sig)
	}
}

// stopLocked terminates the group: SIGTERM (and SIGCONT, so a stopped member
// sees it), then SIGKILL after grace if anything of it still runs.
func (p *proc) stopLocked(by string, grace time.Duration) {
	if !p.rootDone && p.stoppedBy == "" {
		p.stoppedBy = by
	}
	if grace <= 0 {
		p.signalLocked(syscall.SIGKILL)
		return
	}
	p.signalLocked(syscall.SIGTERM)
	p.signalLocked(syscall.SIGCONT)
	p.timers = append(p.timers, time.AfterFunc(grace, func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.signalLocked(syscall.SIGKILL)
	}))
}

// procTable holds the daemon's process handles.
type procTable struct {
	mu       sync.Mutex
	byID     map[string]*proc
	order    []string            // start order, for eviction
	expired  map[string]struct{} // evicted ids, answered notFound (expired)
	expOrder []string
	limit    int
}

const maxExpiredRemembered = 4096

func (t *procTable) lookup(id string) (*proc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if p, ok := t.byID[id]; ok {
		return p, nil
	}
	if _, ok := t.expired[id]; ok {
		return nil, jsonrpc.WithReason(jsonrpc.KindNotFound, "expired", "The process %s was evicted to make room for newer ones; its output is gone.", id)
	}
	return nil, jsonrpc.Errorf(jsonrpc.KindNotFound, "No process %s is known to this daemon instance.", id)
}

// reserve makes room for a new handle, evicting the oldest exited one when full.
func (t *procTable) reserveLocked(id string) error {
	if _, ok := t.byID[id]; ok {
		return jsonrpc.Errorf(jsonrpc.KindAlreadyExists, "A process %s already exists; choose another processId.", id)
	}
	if len(t.byID) < t.limit {
		return nil
	}
	for i, old := range t.order {
		p := t.byID[old]
		p.mu.Lock()
		exited := p.exited
		p.mu.Unlock()
		if !exited {
			continue
		}
		delete(t.byID, old)
		t.order = append(t.order[:i:i], t.order[i+1:]...)
		t.expired[old] = struct{}{}
		t.expOrder = append(t.expOrder, old)
		if len(t.expOrder) > maxExpiredRemembered {
			delete(t.expired, t.expOrder[0])
			t.expOrder = t.expOrder[1:]
		}
		return nil
	}
	e := jsonrpc.WithReason(jsonrpc.KindBusy, "capacityExhausted", "All %d process handles belong to running processes; wait for one to exit.", t.limit)
	retry := uint64(1000)
	e.RetryAfterMs = &retry
	return e
}

func (t *procTable) counts() (retained int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.byID)
}

func (t *procTable) all() []*proc {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*proc, 0, len(t.byID))
	for _, p := range t.byID {
		out = append(out, p)
	}
	return out
}

func (d *Daemon) processStart(_ context.Context, raw json.RawMessage) (any, error) {
	var p ProcessStartParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if p.Pty != nil {
		return nil, jsonrpc.CapabilityUnavailable("processPty", "This daemon has no terminals (process.pty is not advertised); start the process without pty.")
	}
	if len(p.Argv) == 0 || p.Argv[0] == "" {
		return nil, jsonrpc.InvalidParams("argv", "The member argv must name a program: at least one element, the first not empty.")
	}
	for i, a := range p.Argv {
		if strings.IndexByte(a, 0) >= 0 {
			return nil, jsonrpc.InvalidParams(fmt.Sprintf("argv[%d]", i), "The member argv[%d] must not contain NUL.", i)
		}
	}
	for k, v := range p.Env {
		field := "env." + k
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return nil, jsonrpc.InvalidParams(field, "An environment variable's name must be non-empty, without = or NUL.")
		}
		if strings.IndexByte(v, 0) >= 0 {
			return nil, jsonrpc.InvalidParams(field, "The value of %s must not contain NUL.", k)
		}
	}
	if p.TimeoutMs != nil && *p.TimeoutMs == 0 {
		return nil, jsonrpc.InvalidParams("timeoutMs", "The member timeoutMs must be at least 1 when present.")
	}
	cwd := d.defaultCwd
	if p.Cwd != "" {
		if e := checkPath("cwd", p.Cwd); e != nil {
			return nil, e
		}
		cwd = p.Cwd
	}
	if fi, err := os.Stat(cwd); err != nil {
		return nil, fsError(cwd, err)
	} else if !fi.IsDir() {
		return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "notDirectory", "The cwd %s is not a directory.", cwd)
	}
	env := mergeEnv(d.baseEnv, p.Env)
	program, err := lookProgram(p.Argv[0], env, cwd)
	if err != nil {
		return nil, jsonrpc.Errorf(jsonrpc.KindProcessFailed, "Cannot start %q: %v.", p.Argv[0], err)
	}

	t := &d.procs
	t.mu.Lock()
	defer t.mu.Unlock()
	if d.isShuttingDown() {
		return nil, jsonrpc.Unavailable(1000, "The daemon is shutting down.")
	}
	if err := t.reserveLocked(p.ProcessID); err != nil {
		return nil, err
	}

	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("output pipe: %w", err)
	}
	cmd := &exec.Cmd{
		Path:        program,
		Args:        p.Argv,
		Env:         env,
		Dir:         cwd,
		Stdout:      outW,
		Stderr:      outW,
		SysProcAttr: &syscall.SysProcAttr{Setpgid: true},
	}
	var inR, inW *os.File
	if p.Stdin == StdinPipe {
		if inR, inW, err = os.Pipe(); err != nil {
			closePipes(outR, outW)
			return nil, fmt.Errorf("input pipe: %w", err)
		}
		cmd.Stdin = inR
	}
	if err := cmd.Start(); err != nil {
		closePipes(outR, outW, inR, inW)
		return nil, jsonrpc.Errorf(jsonrpc.KindProcessFailed, "Cannot start %q: %v.", p.Argv[0], err)
	}
	// The child holds its own copies of these ends now.
	closePipes(outW, inR)
	pr := &proc{
		id:       p.ProcessID,
		pgid:     cmd.Process.Pid,
		outLimit: int(d.limits.Process.MaxRetainedOutputBytes),
		changed:  make(chan struct{}),
	}
	if inW != nil {
		pr.stdin = newInputQueue(inW, d.limits.Process.MaxPendingInputBytes)
	}
	t.byID[p.ProcessID] = pr
	t.order = append(t.order, p.ProcessID)
	d.idle.rootStarted()

	eof := make(chan struct{})
	go func() {
		defer close(eof)
		defer closePipes(outR)
		buf := make([]byte, 32<<10)
		for {
			n, err := outR.Read(buf)
			if n > 0 {
				pr.appendOutput(buf[:n])
			}
			if err != nil {
				break
			}
		}
		pr.mu.Lock()
		pr.outEOF = true
		pr.notifyLocked()
		pr.mu.Unlock()
	}()
	if p.TimeoutMs != nil {
		timeout := time.Duration(*p.TimeoutMs) * time.Millisecond
		pr.timers = append(pr.timers, time.AfterFunc(timeout, func() {
			pr.mu.Lock()
			defer pr.mu.Unlock()
			if !pr.rootDone {
				pr.stopLocked("timeout", d.terminationGrace)
			}
		}))
	}
	go d.supervise(pr, cmd, eof)
	return ProcessStartResult{Pid: uint32(cmd.Process.Pid)}, nil
}

// closePipes closes the pipe ends given, skipping nil ones. Closing a pipe
// end has nothing to flush, so its error is deliberately ignored.
func closePipes(files ...*os.File) {
	for _, f := range files {
		if f != nil {
			_ = f.Close()
		}
	}
}

// supervise reaps the root, lets its output settle, and follows a group
// that outlives it.
func (d *Daemon) supervise(pr *proc, cmd *exec.Cmd, eof <-chan struct{}) {
	_ = cmd.Wait()
	exit := exitOf(cmd.ProcessState)
	pr.mu.Lock()
	pr.rootDone = true
	pr.groupLive = true // until checked below; keeps signals reaching the group
	if pr.stdin != nil {
		pr.stdin.rootExited()
	}
	pr.mu.Unlock()

	select {
	case <-eof:
	case <-time.After(settleTimeout):
	}
	live := groupAlive(pr.pgid)
	var report *Leftovers
	if live {
		report = listGroup(pr.pgid)
	}
	// The idle clock learns of the exit before any reader can see it, so a
	// client that reads "exited" and then asks env/getIdle never finds the
	// process still counted as running.
	d.idle.rootEnded(live)
	pr.mu.Lock()
	pr.exited = true
	pr.exit = exit
	pr.groupLive = live
	pr.leftovers = report
	pr.notifyLocked()
	pr.mu.Unlock()
	if !live {
		pr.stopTimers()
		return
	}
	tick := time.NewTicker(leftoverPoll)
	defer tick.Stop()
	for range tick.C {
		if groupAlive(pr.pgid) {
			continue
		}
		pr.mu.Lock()
		pr.groupLive = false
		pr.notifyLocked()
		pr.mu.Unlock()
		pr.stopTimers()
		d.idle.leftoverEnded()
		return
	}
}

func (p *proc) stopTimers() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, t := range p.timers {
		t.Stop()
	}
	p.timers = nil
}

func exitOf(ps *os.ProcessState) *ProcessExit {
	if ps == nil {
		return nil // the wait itself failed: the daemon cannot say how the root ended
	}
	ws, ok := ps.Sys().(syscall.WaitStatus)
	switch {
	case ok && ws.Signaled():
		name := unix.SignalName(ws.Signal())
		if name == "" {
			name = fmt.Sprintf("SIG%d", int(ws.Signal()))
		}
		return &ProcessExit{Kind: "signal", Signal: name, CoreDumped: ws.CoreDump()}
	default:
		code := int32(ps.ExitCode())
		return &ProcessExit{Kind: "code", Code: &code}
	}
}

// groupAlive says whether any process is left in the group.
func groupAlive(pgid int) bool {
	err := unix.Kill(-pgid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}

// listGroup reports the live members of a group from /proc.
func listGroup(pgid int) *Leftovers {
	report := &Leftovers{Disposition: "kept"}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid := 0
		if _, err := fmt.Sscanf(e.Name(), "%d", &pid); err != nil || pid <= 0 {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp …; comm may hold spaces and parentheses.
		rparen := strings.LastIndexByte(string(stat), ')')
		if rparen < 0 {
			continue
		}
		var state byte
		var ppid, pgrp int
		if _, err := fmt.Sscanf(string(stat[rparen+1:]), " %c %d %d", &state, &ppid, &pgrp); err != nil || pgrp != pgid || state == 'Z' {
			continue
		}
		if len(report.Processes) >= maxLeftoversListed {
			report.OmittedCount++
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		command := strings.TrimRight(strings.ReplaceAll(string(cmdline), "\x00", " "), " ")
		report.Processes = append(report.Processes, LeftoverProcess{Pid: uint32(pid), Command: cutText(command, maxCommandBytes)})
	}
	return report
}

// cutText cuts s to at most n bytes at a rune boundary, dropping control characters.
func cutText(s string, n int) string {
	s = strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return -1
		}
		return r
	}, strings.ToValidUTF8(s, "?"))
	if len(s) <= n {
		return s
	}
	for n > 0 && (s[n]&0xC0) == 0x80 {
		n--
	}
	return s[:n]
}

func mergeEnv(base []string, extra map[string]string) []string {
	if len(extra) == 0 {
		return base
	}
	out := make([]string, 0, len(base)+len(extra))
	for _, kv := range base {
		k, _, _ := strings.Cut(kv, "=")
		if _, overridden := extra[k]; !overridden {
			out = append(out, kv)
		}
	}
	for k, v := range extra {
		out = append(out, k+"="+v)
	}
	return out
}

// lookProgram finds argv[0] the way a shell would: a name with a slash is a
// path (relative to cwd), any other name is searched in the command's PATH.
func lookProgram(name string, env []string, cwd string) (string, error) {
	if strings.Contains(name, "/") {
		if !filepath.IsAbs(name) {
			name = filepath.Join(cwd, name)
		}
		return name, nil
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" || !filepath.IsAbs(dir) {
			continue
		}
		candidate := filepath.Join(dir, name)
		if fi, err := os.Stat(candidate); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
			return candidate, nil
		}
	}
	return "", fmt.Errorf("no executable %s on PATH", name)
}

func (d *Daemon) processRead(ctx context.Context, raw json.RawMessage) (any, error) {
	var p ProcessReadParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	if p.After != nil && p.TailBytes != nil {
		return nil, jsonrpc.InvalidParams("tailBytes", "The members after and tailBytes exclude each other; send at most one.")
	}
	if p.MaxBytes == 0 {
		return nil, jsonrpc.InvalidParams("maxBytes", "The member maxBytes must be at least 1.")
	}
	if ceiling := d.limits.Process.MaxReadBytes; p.MaxBytes > ceiling {
		return nil, ceilingError("maxBytes", ceiling, p.MaxBytes)
	}
	if ceiling := d.limits.MaxWaitMs; p.WaitMs > ceiling {
		return nil, ceilingError("waitMs", ceiling, p.WaitMs)
	}
	returnOn := p.ReturnOn
	if returnOn == "" {
		returnOn = ReturnOnAnyOutput
	}
	pr, err := d.procs.lookup(p.ProcessID)
	if err != nil {
		return nil, err
	}

	pr.mu.Lock()
	locked := true
	defer func() {
		if locked {
			pr.mu.Unlock()
		}
	}()
	end := pr.end()
	if p.Ack != nil {
		if *p.Ack > end {
			return nil, jsonrpc.InvalidParams("ack", "The member ack is %d, beyond the end of the output (%d).", *p.Ack, end)
		}
		pr.cursor = max(pr.cursor, *p.Ack)
	}
	var pos uint64
	cursorRead := false
	switch {
	case p.After != nil:
		if *p.After > end {
			return nil, jsonrpc.InvalidParams("after", "The member after is %d, beyond the end of the output (%d).", *p.After, end)
		}
		pos = *p.After
	case p.TailBytes != nil:
		pos = end - min(*p.TailBytes, end)
	default:
		pos = pr.cursor
		cursorRead = true
	}

	ready := func() bool {
		if pr.exited {
			return true
		}
		switch returnOn {
		case ReturnOnAnyOutput:
			return pr.end() > pos
		case ReturnOnWindow:
			return pr.end() >= pos+p.MaxBytes
		}
		return false
	}
	if !ready() && p.WaitMs > 0 {
		timer := time.NewTimer(time.Duration(p.WaitMs) * time.Millisecond)
		defer timer.Stop()
	wait:
		for !ready() {
			ch := pr.changed
			pr.mu.Unlock()
			locked = false
			select {
			case <-ch:
			case <-timer.C:
				pr.mu.Lock()
				locked = true
				break wait
			case <-ctx.Done():
				return nil, jsonrpc.WithReason(jsonrpc.KindAborted, "cancelled", "The read was cancelled; the output cursor did not move.")
			}
			pr.mu.Lock()
			locked = true
		}
	}
	res := pr.pageLocked(pos, p.MaxBytes)
	if cursorRead && res.Next > pr.cursor {
		// The shared server offers no hook for "the reply was written", so the
		// cursor moves when the answer is handed to it.
		pr.cursor = res.Next
	}
	return res, nil
}

func (p *proc) pageLocked(pos, maxBytes uint64) ProcessReadResult {
	res := ProcessReadResult{End: p.end(), State: "running"}
	cur := pos
	if cur < p.outStart {
		res.Gaps = []OutputGap{{Offset: cur, SizeBytes: p.outStart - cur, Reason: "overflow"}}
		cur = p.outStart
	}
	if cur < res.End {
		n := min(maxBytes, res.End-cur)
		from := cur - p.outStart
		res.Chunks = []OutputChunk{{Offset: cur, Data: base64.StdEncoding.EncodeToString(p.out[from : from+n])}}
		cur += n
	}
	res.Next = cur
	if p.exited {
		res.State = "exited"
		res.Exit = p.exit
		res.StoppedBy = p.stoppedBy
		res.Leftovers = p.leftovers
	}
	return res
}

func (d *Daemon) processWrite(_ context.Context, raw json.RawMessage) (any, error) {
	var p ProcessWriteParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	data, err := base64.StdEncoding.Strict().DecodeString(p.Data)
	if err != nil {
		return nil, jsonrpc.InvalidParams("data", "The member data must be padded standard base64: %v.", err)
	}
	if ceiling := d.limits.Process.MaxPendingInputBytes; uint64(len(data)) > ceiling {
		return nil, ceilingError("data", ceiling, uint64(len(data)))
	}
	pr, err := d.procs.lookup(p.ProcessID)
	if err != nil {
		return nil, err
	}
	pr.mu.Lock()
	q := pr.stdin
	pr.mu.Unlock()
	if q == nil {
		return nil, jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "inputClosed", "The process %s was started without a stdin pipe (stdin: pipe).", p.ProcessID)
	}
	if err := q.enqueue(data, p.Close); err != nil {
		return nil, err
	}
	return Empty{}, nil
}

func (d *Daemon) processTerminate(_ context.Context, raw json.RawMessage) (any, error) {
	var p ProcessTerminateParams
	if err := jsonrpc.DecodeParams(raw, &p); err != nil {
		return nil, err
	}
	pr, err := d.procs.lookup(p.ProcessID)
	if err != nil {
		return nil, err
	}
	pr.mu.Lock()
	defer pr.mu.Unlock()
	switch p.Mode {
	case TerminateInterrupt:
		pr.signalLocked(syscall.SIGINT)
	case TerminateGraceful:
		pr.stopLocked("terminate", d.terminationGrace)
	case TerminateKill:
		pr.stopLocked("kill", 0)
	}
	return Empty{}, nil
}

// inputQueue feeds a process's stdin pipe from process/write without ever
// blocking a request: bytes are queued (up to a bound) and written by one
// goroutine.
type inputQueue struct {
	mu       sync.Mutex
	w        *os.File
	pending  [][]byte
	bytes    uint64
	limit    uint64
	closing  bool // close requested: after the queue drains
	closed   bool // the pipe is closed or broken
	wake     chan struct{}
	finished chan struct{}
}

func newInputQueue(w *os.File, limit uint64) *inputQueue {
	q := &inputQueue{w: w, limit: limit, wake: make(chan struct{}, 1), finished: make(chan struct{})}
	go q.run()
	return q
}

func (q *inputQueue) enqueue(data []byte, closeAfter bool) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.closing || q.closed {
		return jsonrpc.WithReason(jsonrpc.KindFailedPrecondition, "inputClosed", "The process's input is closed.")
	}
	if q.bytes+uint64(len(data)) > q.limit {
		e := jsonrpc.WithReason(jsonrpc.KindBusy, "capacityExhausted", "%d bytes of input are still queued; wait until the process reads them.", q.bytes)
		retry := uint64(100)
		e.RetryAfterMs = &retry
		return e
	}
	if len(data) > 0 {
		q.pending = append(q.pending, data)
		q.bytes += uint64(len(data))
	}
	if closeAfter {
		q.closing = true
	}
	select {
	case q.wake <- struct{}{}:
	default:
	}
	return nil
}

func (q *inputQueue) run() {
	defer close(q.finished)
	for range q.wake {
		for {
			q.mu.Lock()
			if len(q.pending) == 0 {
				done := q.closing || q.closed
				if done {
					q.closed = true
					q.mu.Unlock()
					_ = q.w.Close()
					return
				}
				q.mu.Unlock()
				break
			}
			chunk := q.pending[0]
			q.mu.Unlock()
			_, err := q.w.Write(chunk)
			q.mu.Lock()
			q.pending = q.pending[1:]
			q.bytes -= uint64(len(chunk))
			if err != nil {
				q.closed = true
				q.pending, q.bytes = nil, 0
			}
			q.mu.Unlock()
		}
	}
}

// rootExited closes the input once the root is gone: nobody is left to read
// what the daemon would queue.
func (q *inputQueue) rootExited() {
	q.mu.Lock()
	q.closing = true
	q.mu.Unlock()
	select {
	case q.wake <- struct{}{}:
	default:
	}
	// A writer blocked on a full pipe whose reader lives on in a descendant
	// would keep the queue open; a deadline unblocks it.
	_ = q.w.SetWriteDeadline(time.Now().Add(time.Second))
}
