package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/idle/idletest"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// The fakes' process is this binary again, told so by its environment: the
// fake daemons and the fake Incus then cost nothing in the measured
// process, which holds only what a provider at this scale holds.
const (
	envFakesDir     = "IDLEBENCH_FAKES_DIR"
	envFakesTargets = "IDLEBENCH_FAKES_TARGETS"
)

// maxPreamble bounds the line naming the instance a dial is for.
const maxPreamble = 256

func benchNames(n int) []string {
	names := make([]string, n)
	for i := range names {
		names[i] = targets.Name(controller.Owner{UniverseID: "u-bench", EnvironmentID: fmt.Sprintf("env-%06d", i)})
	}
	return names
}

// runFakes is the fakes' process: a fleet of fake daemons behind one unix
// socket (each dial names its instance in a first line) and a fake Incus on
// another, until its standard input closes (the benchmark ended or died).
func runFakes(dir string, n int) error {
	if err := raiseFileLimit(uint64(n + 4096)); err != nil {
		return err
	}
	names := benchNames(n)
	fleet := idletest.NewFleet(idletest.Options{})
	defer fleet.Close()
	for _, name := range names {
		fleet.Add(name)
	}
	fake, err := serveFakeIncus(filepath.Join(dir, "incus.sock"), names)
	if err != nil {
		return err
	}
	defer func() { _ = fake.Close() }()
	var lc net.ListenConfig
	ln, err := lc.Listen(context.Background(), "unix", filepath.Join(dir, "daemons.sock"))
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
		_ = ln.Close()
	}()
	fmt.Printf("ready %d\n", fake.ListBytes)
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go func() {
			name, err := readPreamble(conn)
			if err != nil {
				_ = conn.Close()
				return
			}
			_ = fleet.ServeConn(ctx, name, conn)
		}()
	}
}

// readPreamble reads the instance's name, byte by byte so that nothing of
// the WebSocket handshake behind it is consumed.
func readPreamble(conn net.Conn) (string, error) {
	_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer func() { _ = conn.SetReadDeadline(time.Time{}) }()
	var b strings.Builder
	one := make([]byte, 1)
	for b.Len() < maxPreamble {
		if _, err := io.ReadFull(conn, one); err != nil {
			return "", err
		}
		if one[0] == '\n' {
			return b.String(), nil
		}
		b.WriteByte(one[0])
	}
	return "", errors.New("preamble too long")
}

// fakesProc is the running fakes' process, seen from the benchmark.
type fakesProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	dir   string
	size  int // bytes of the fake Incus's listing
}

func startFakes(ctx context.Context, dir string, n int) (*fakesProc, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, self)
	cmd.Env = append(os.Environ(), envFakesDir+"="+dir, envFakesTargets+"="+strconv.Itoa(n))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &fakesProc{cmd: cmd, stdin: stdin, dir: dir}
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(out).ReadString('\n')
		line <- s
		_, _ = io.Copy(io.Discard, out)
	}()
	select {
	case s := <-line:
		if _, err := fmt.Sscanf(s, "ready %d", &p.size); err != nil {
			p.stop()
			return nil, fmt.Errorf("the fakes' process did not start: %q", s)
		}
	case <-time.After(2 * time.Minute):
		p.stop()
		return nil, errors.New("the fakes' process was not ready within 2 minutes")
	}
	return p, nil
}

// cpu is the fakes' process's CPU time so far (user + system), from
// /proc/<pid>/stat.
func (p *fakesProc) cpu() time.Duration {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
	if err != nil {
		return 0
	}
	// Fields after the command name, which is in parentheses.
	s := string(raw)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(fields) < 13 {
		return 0
	}
	ut, _ := strconv.ParseInt(fields[11], 10, 64)
	st, _ := strconv.ParseInt(fields[12], 10, 64)
	return time.Duration(ut+st) * time.Second / 100 // clock ticks: USER_HZ is 100 on Linux
}

// rss is the fakes' process's peak RSS.
func (p *fakesProc) rss() string { return peakRSSOf(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid)) }

func (p *fakesProc) stop() {
	_ = p.stdin.Close()
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

// remoteFleet dials the fakes' process's daemons: the benchmark's
// GuestDialer, a unix socket and a line naming the instance.
type remoteFleet struct {
	socket string
	dials  atomic.Int64
}

func (r *remoteFleet) Name() string                                      { return "fake" }
func (r *remoteFleet) Devices(guest.Target) map[string]map[string]string { return nil }
func (r *remoteFleet) Forget(string)                                     {}

func (r *remoteFleet) DialContext(ctx context.Context, t guest.Target) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", r.socket)
	if err != nil {
		return nil, err
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetWriteDeadline(dl)
	}
	if _, err := conn.Write([]byte(t.Instance + "\n")); err != nil {
		_ = conn.Close()
		return nil, err
	}
	_ = conn.SetWriteDeadline(time.Time{})
	r.dials.Add(1)
	return conn, nil
}
