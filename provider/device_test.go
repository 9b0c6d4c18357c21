package provider_test

import (
	"bytes"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/guest"
)

// The proxy dialer reaches a guest's daemon through a proxy device whose
// host side is a forkproxy process of the server's. LXD 5.0 can leave a
// running container with that process dead (make test's LXD lane met it:
// a graceful stop that failed, raced by a start). Here the process is
// killed outright: the next dial must find the device dead, have it
// restarted, and be relayed, not refused as booting for as long as the
// container runs.
func TestADeadDaemonDeviceIsRestarted(t *testing.T) {
	r := newRig(t, rigOptions{dialer: guest.KindProxy})
	route := r.create("env-dead-device", "t1")
	r.mustUpgrade(route).Close() // relayed through the device, which works

	inst, _, err := r.client.GetInstance(r.ctx(), route.TargetID)
	if err != nil {
		t.Fatal(err)
	}
	dev := inst.Devices[guest.ProxyDeviceName]
	socket := strings.TrimPrefix(dev["listen"], "unix:")
	if dev == nil || socket == dev["listen"] {
		t.Fatalf("the instance has no proxy device listening on a unix socket: %v", inst.Devices)
	}
	killed := killListeners(t, socket)
	if killed == 0 {
		t.Fatalf("no process of the server's listens on %s", socket)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, err := net.DialTimeout("unix", socket, time.Second)
		if err != nil && (errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT)) {
			break
		}
		if c != nil {
			c.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s still takes connections after its %d processes were killed: %v", socket, killed, err)
		}
		time.Sleep(20 * time.Millisecond)
	}

	start := time.Now()
	conn, redials, err := r.dialAsTheRuntime(route)
	if err != nil {
		t.Fatalf("a dial to a running target whose device died: %v", err)
	}
	defer conn.Close()
	initialize(t, conn)
	t.Logf("relayed %s after the device died, after %d refusals", time.Since(start).Round(time.Millisecond), redials)

	after, _, err := r.client.GetInstance(r.ctx(), route.TargetID)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := after.Devices[guest.ProxyDeviceName]["security.uid"], dev["security.uid"]; got == want {
		t.Errorf("the device's config is unchanged (security.uid %q): it was not restarted by the provider", got)
	}
}

// killListeners kills every process whose command line names socket (the
// server's forkproxy for it) and says how many it killed.
func killListeners(t *testing.T, socket string) int {
	t.Helper()
	dirs, err := filepath.Glob("/proc/[0-9]*/cmdline")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, path := range dirs {
		cmd, err := os.ReadFile(path)
		if err != nil || !bytes.Contains(cmd, []byte(socket)) {
			continue // gone since, or another process
		}
		pid, err := strconv.Atoi(filepath.Base(filepath.Dir(path)))
		if err != nil || pid == os.Getpid() {
			continue
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err == nil {
			n++
		}
	}
	return n
}
