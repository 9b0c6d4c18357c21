//go:build linux

package guest

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// These tests need no Incus: a guest is a busybox httpd in a network
// namespace of its own made by `unshare --net` (a network namespace this test
// run creates, with only a loopback interface).

// initialNetns is the test process's network namespace, read by the main
// thread before any test ran.
var initialNetns, _ = statNS("/proc/self/ns/net")

type nsGuest struct {
	cmd *exec.Cmd
	pid int
}

func needUnshareTools(t testing.TB) {
	t.Helper()
	requireRoot(t)
	for _, p := range []string{"/bin/busybox", "unshare"} {
		if _, err := exec.LookPath(p); err != nil {
			t.Skipf("%s not available: %v", p, err)
		}
	}
}

// freeHostPort returns a port nothing listens on in the test's own network
// namespace, so that "not reachable from the host" means something.
func freeHostPort(t testing.TB) int {
	for p := DefaultPort; p < DefaultPort+100; p++ {
		if !hostListensTCP(t, p) {
			return p
		}
	}
	t.Fatal("no free port near the default")
	return 0
}

// startNSGuest starts a process in a new network namespace that brings its
// loopback up and serves id on 127.0.0.1:port.
func startNSGuest(t testing.TB, id string, port int) *nsGuest {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "id"), []byte(id+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	script := "/bin/busybox ip link set lo up && exec /bin/busybox httpd -f -p 127.0.0.1:" + strconv.Itoa(port) + " -h " + dir
	cmd := exec.Command("unshare", "--net", "--", "/bin/busybox", "sh", "-c", script)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	g := &nsGuest{cmd: cmd, pid: cmd.Process.Pid}
	t.Cleanup(g.stop)
	host, err := statNS("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	netDir := "/proc/" + strconv.Itoa(g.pid) + "/net"
	deadline := time.Now().Add(5 * time.Second)
	for {
		ns, err := statNS("/proc/" + strconv.Itoa(g.pid) + "/ns/net")
		if err == nil && ns != host && listensTCP(t, netDir, port) {
			return g
		}
		if time.Now().After(deadline) {
			t.Fatalf("unshare guest %s did not come up (ns err %v)", id, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (g *nsGuest) stop() {
	if g.cmd.ProcessState == nil {
		g.cmd.Process.Kill()
		g.cmd.Wait()
	}
}

func TestNetnsUnshareGuest(t *testing.T) {
	needUnshareTools(t)
	port := freeHostPort(t)
	g1 := startNSGuest(t, "g1", port)
	var pid atomic.Int64
	pid.Store(int64(g1.pid))
	var lookups atomic.Int64
	d := NewNetns(func(context.Context, string) (int, error) {
		lookups.Add(1)
		return int(pid.Load()), nil
	})
	tg := Target{Instance: "g", Port: port}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	got, err := fetchID(ctx, d, tg)
	if err != nil || got != "g1" {
		t.Fatalf("fetch through netns: %q, %v", got, err)
	}
	// The guest's service is on the guest's loopback only.
	if hostListensTCP(t, port) {
		t.Fatalf("something listens on the host's port %d", port)
	}
	if c, err := hostDial(ctx, port); err == nil {
		c.Close()
		t.Fatalf("host 127.0.0.1:%d accepted a connection", port)
	}

	// Many dials, concurrently: every one reaches the guest, and no thread the
	// runtime keeps is left in the guest's namespace.
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got, err := fetchID(ctx, d, tg)
			if err == nil && got != "g1" {
				err = errors.New("wrong guest " + got)
			}
			if err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	assertThreadsInHostNetns(t)
	if n := lookups.Load(); n != 1 {
		t.Fatalf("%d lookups for one running guest, want 1 (cached)", n)
	}

	// "Restart": the process is gone, a new one with a new PID and namespace
	// takes its place. The cached PID fails with ENOENT, one new lookup finds
	// the new process, and the same DialContext succeeds.
	g1.stop()
	g2 := startNSGuest(t, "g2", port)
	pid.Store(int64(g2.pid))
	got, err = fetchID(ctx, d, tg)
	if err != nil || got != "g2" {
		t.Fatalf("after restart: %q, %v", got, err)
	}
	if n := lookups.Load(); n != 2 {
		t.Fatalf("%d lookups after a restart, want 2", n)
	}

	// A cached PID whose start time no longer matches (PID reuse) is not
	// dialled: it is looked up again.
	nd := d.(*netnsDialer)
	nd.mu.Lock()
	nd.procs["g"] = proc{pid: g2.pid, start: 1}
	nd.mu.Unlock()
	got, err = fetchID(ctx, d, tg)
	if err != nil || got != "g2" {
		t.Fatalf("after PID reuse: %q, %v", got, err)
	}
	if n := lookups.Load(); n != 3 {
		t.Fatalf("%d lookups after PID reuse, want 3", n)
	}

	// The instance stops: the PID is gone and the lookup says 0.
	g2.stop()
	pid.Store(0)
	if _, err := d.DialContext(ctx, tg); !errors.Is(err, ErrNotRunning) {
		t.Fatalf("dial of a stopped guest: %v", err)
	}
}

// A refused connection from a process that is still the instance's init is
// looked up once more (the PID might be stale) but not dialled again.
func TestNetnsRefusedSameProcess(t *testing.T) {
	needUnshareTools(t)
	g := startNSGuest(t, "quiet", DefaultPort+1) // nothing on DefaultPort
	var lookups atomic.Int64
	d := NewNetns(func(context.Context, string) (int, error) { lookups.Add(1); return g.pid, nil })
	tg := Target{Instance: "quiet", Port: DefaultPort}
	for i := 1; i <= 2; i++ {
		_, err := d.DialContext(context.Background(), tg)
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial %d: %v, want connection refused", i, err)
		}
	}
	if n := lookups.Load(); n != 2 {
		t.Fatalf("%d lookups, want 2 (first dial, then one re-check)", n)
	}
}

func TestNetnsContextDeadline(t *testing.T) {
	needUnshareTools(t)
	g := startNSGuest(t, "slow", DefaultPort)
	d := NewNetns(func(ctx context.Context, _ string) (int, error) { return g.pid, nil })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := d.DialContext(ctx, Target{Instance: "slow", Port: DefaultPort}); !errors.Is(err, context.Canceled) {
		t.Fatalf("dial with a cancelled context: %v", err)
	}
}

// assertThreadsInHostNetns runs goroutines on many OS threads and checks each
// thread is in the test's own network namespace.
func assertThreadsInHostNetns(t *testing.T) {
	t.Helper()
	host, err := statNS("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if host != initialNetns {
		t.Fatal("the main thread (/proc/self/ns/net) left the test's network namespace")
	}
	var wg sync.WaitGroup
	var bad atomic.Int64
	for range 4 * runtime.GOMAXPROCS(0) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			if ns, err := statNS("/proc/thread-self/ns/net"); err != nil || ns != host {
				bad.Add(1)
			}
			time.Sleep(time.Millisecond)
		}()
	}
	wg.Wait()
	if bad.Load() != 0 {
		t.Fatalf("%d runtime threads are outside the host network namespace", bad.Load())
	}
}

// BenchmarkNetnsDial measures one netns dial (PID cached) plus close, to a
// guest in a network namespace made by `unshare --net` (no Incus needed):
//
//	go test -run '^$' -bench Netns ./guest/
func BenchmarkNetnsDial(b *testing.B) {
	needUnshareTools(b)
	port := freeHostPort(b)
	g := startNSGuest(b, "bench", port)
	d := NewNetns(func(context.Context, string) (int, error) { return g.pid, nil })
	tg := Target{Instance: "bench", Port: port}
	ctx := context.Background()
	for b.Loop() {
		c, err := d.DialContext(ctx, tg)
		if err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
}

// BenchmarkHostLoopbackDial is the baseline: a plain dial of a listener on
// the test's own loopback, no namespace switch.
func BenchmarkHostLoopbackDial(b *testing.B) {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	ctx := context.Background()
	var d net.Dialer
	for b.Loop() {
		c, err := d.DialContext(ctx, "tcp4", ln.Addr().String())
		if err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
}
