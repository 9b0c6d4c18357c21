package devguest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
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
