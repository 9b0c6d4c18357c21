package devguest

import (
	"context"
	"encoding/json"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

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
