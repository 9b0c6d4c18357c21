package devguest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

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
	go pr.drain(outR, eof)
	if p.TimeoutMs != nil {
		timeout := time.Duration(*p.TimeoutMs) * time.Millisecond
		// Under the process's lock: a short timeout fires, and its stop
		// adds its own timer to the list, before this append is done.
		pr.mu.Lock()
		pr.timers = append(pr.timers, time.AfterFunc(timeout, func() {
			pr.mu.Lock()
			defer pr.mu.Unlock()
			if !pr.rootDone {
				pr.stopLocked("timeout", d.terminationGrace)
			}
		}))
		pr.mu.Unlock()
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
