package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/guest"
)

// socatPort is where the floor relay listens on the guest's loopback: far
// from the daemon's port and from anything the dev guest serves.
const socatPort = 17999

// socatRelay is a C byte relay (Debian's socat) running in the guest's
// network namespace, between a port of the guest's loopback and the
// daemon's. The benchmark reaches it with the same GuestDialer as its
// direct path, so its path has the relay's two loopback hops and one
// user-space copy, in C: the floor the provider's relay is held to.
type socatRelay struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// startSocat starts socat in the namespace of the target's init process
// (its PID changes with every start: call this after the last one).
func (b *bench) startSocat(ctx context.Context, path string) (*socatRelay, error) {
	if path == "" {
		return nil, nil
	}
	bin, err := exec.LookPath(path)
	if err != nil {
		return nil, fmt.Errorf("socat (the relay floor; apt-get install socat, or -socat '' to measure without it): %w", err)
	}
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	pid, err := b.incus.InitPID(lctx, b.targetID)
	if err != nil {
		return nil, fmt.Errorf("socat: the guest's init PID: %w", err)
	}
	// Both addresses with TCP_NODELAY, as the provider's relay has, and a
	// buffer as large as the provider's stream copies, so neither side of
	// the comparison is handicapped by a setting.
	args := []string{"--net=/proc/" + strconv.Itoa(pid) + "/ns/net", bin, "-b", "65536",
		fmt.Sprintf("TCP-LISTEN:%d,bind=127.0.0.1,reuseaddr,fork,nodelay", socatPort),
		fmt.Sprintf("TCP:127.0.0.1:%d,nodelay", guest.DefaultPort)}
	cmd := exec.CommandContext(ctx, "nsenter", args...)
	cmd.Stderr = os.Stderr
	// Its own process group, so that stopping it stops its forked children.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("socat: %w", err)
	}
	r := &socatRelay{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(r.done) }()
	b.socatPort = socatPort
	// Listening shortly; a dial proves it.
	for deadline := time.Now().Add(5 * time.Second); ; {
		conn, err := b.dialer.DialContext(lctx, guest.Target{Instance: b.targetID, Port: socatPort, Location: b.location})
		if err == nil {
			_ = conn.Close()
			return r, nil
		}
		select {
		case <-r.done:
			b.socatPort = 0
			return nil, errors.New("socat ended at start (see its message above)")
		default:
		}
		if time.Now().After(deadline) {
			r.stop()
			b.socatPort = 0
			return nil, fmt.Errorf("socat does not listen: %w", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *socatRelay) stop() {
	if r == nil {
		return
	}
	_ = syscall.Kill(-r.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(5 * time.Second):
		_ = syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
		<-r.done
	}
}

// dialSocat opens a WebSocket to the daemon through socat.
func (b *bench) dialSocat(ctx context.Context) (*websocket.Conn, error) {
	conn, err := b.dialer.DialContext(ctx, guest.Target{Instance: b.targetID, Port: b.socatPort, Location: b.location})
	if err != nil {
		return nil, fmt.Errorf("socat: %w", err)
	}
	return wsOver(ctx, conn)
}
