package guest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestNewKinds(t *testing.T) {
	lookup := func(context.Context, string) (int, error) { return 0, nil }
	dir := filepath.Join(t.TempDir(), "socks")

	p, err := New(KindProxy, Options{SocketDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if p.Name() != "proxy" {
		t.Fatalf("Name() = %q", p.Name())
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Fatalf("socket dir not created 0700: %v %v", fi, err)
	}

	if os.Geteuid() == 0 {
		n, err := New(KindNetns, Options{Lookup: lookup})
		if err != nil {
			t.Fatal(err)
		}
		if n.Name() != "netns" {
			t.Fatalf("Name() = %q", n.Name())
		}
	}
	if _, err := New(KindNetns, Options{}); err == nil {
		t.Fatal("netns without lookup accepted")
	}
	if _, err := New(KindExec, Options{}); err == nil {
		t.Fatal("exec without Incus's exec accepted")
	}
	if _, err := New(KindMember, Options{Lookup: lookup, Exec: noExec}); err == nil {
		t.Fatal("member without a member name accepted")
	}
	if x, err := New(KindExec, Options{Exec: noExec}); err != nil || x.Name() != KindExec {
		t.Fatalf("exec: %v, %v", x, err)
	}

	for _, kind := range []string{"", "network", "NETNS", "vsock"} {
		_, err := New(kind, Options{Lookup: lookup, SocketDir: dir})
		if err == nil {
			t.Fatalf("kind %q accepted", kind)
		}
		for _, allowed := range Kinds {
			if !strings.Contains(err.Error(), allowed) {
				t.Fatalf("error for kind %q does not name %q: %v", kind, allowed, err)
			}
		}
	}
	if DefaultKind != KindNetns && DefaultKind != KindProxy {
		t.Fatalf("DefaultKind %q is not a kind", DefaultKind)
	}
}

func TestProxySocketDir(t *testing.T) {
	base := t.TempDir()
	if _, err := New(KindProxy, Options{SocketDir: "relative/dir"}); err == nil {
		t.Fatal("relative socket dir accepted")
	}
	if _, err := New(KindProxy, Options{}); err == nil {
		t.Fatal("empty socket dir accepted")
	}
	open := filepath.Join(base, "open")
	if err := os.Mkdir(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, err := New(KindProxy, Options{SocketDir: open}); err == nil {
		t.Fatal("world-writable socket dir accepted")
	}
	// NewProxy cannot fail; the problem surfaces at dial time.
	d := NewProxy(open)
	if _, err := d.DialContext(context.Background(), Target{Instance: "c1", Port: DefaultPort}); err == nil || !strings.Contains(err.Error(), "0777") {
		t.Fatalf("dial with a bad socket dir: %v", err)
	}
	file := filepath.Join(base, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := New(KindProxy, Options{SocketDir: file}); err == nil {
		t.Fatal("socket dir that is a file accepted")
	}
	long := "/tmp/" + strings.Repeat("x", 100)
	d = NewProxy(long)
	defer os.Remove(long)
	if _, err := d.DialContext(context.Background(), Target{Instance: "c1", Port: DefaultPort}); err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("dial with an over-long socket path: %v", err)
	}
}

func TestProxyDevices(t *testing.T) {
	dir := t.TempDir()
	d := NewProxy(dir)
	devs := d.Devices(Target{Instance: "lightspeed-abc", Port: 19091})
	if len(devs) != 1 {
		t.Fatalf("devices: %v", devs)
	}
	dev := devs[ProxyDeviceName]
	want := map[string]string{
		"type":    "proxy",
		"bind":    "host",
		"listen":  "unix:" + filepath.Join(dir, "lightspeed-abc.sock"),
		"connect": "tcp:127.0.0.1:19091",
		"mode":    "0600",
		"uid":     strconv.Itoa(os.Getuid()),
		"gid":     strconv.Itoa(os.Getgid()),
	}
	if len(dev) != len(want) {
		t.Fatalf("device %v, want %v", dev, want)
	}
	for k, v := range want {
		if dev[k] != v {
			t.Fatalf("device[%q] = %q, want %q", k, dev[k], v)
		}
	}
	// Each call returns a fresh map the caller may modify.
	dev["mode"] = "0666"
	if d.Devices(Target{Instance: "lightspeed-abc", Port: 19091})[ProxyDeviceName]["mode"] != "0600" {
		t.Fatal("Devices returned shared state")
	}
	if NewNetns(nil).Devices(Target{Instance: "x", Port: 1}) != nil {
		t.Fatal("netns needs no devices")
	}
}

func TestProxyDialNothingListening(t *testing.T) {
	d := NewProxy(t.TempDir())
	_, err := d.DialContext(context.Background(), Target{Instance: "absent", Port: DefaultPort})
	if err == nil || !strings.Contains(err.Error(), ProxyDeviceName) || !errors.Is(err, ErrDeviceDown) {
		t.Fatalf("dial without a socket: %v", err)
	}
}

// The restarted proxy device means the same to the guest (security.uid 0
// is the default) and differs to the server, back and forth; a dialer with
// no device, or an instance without it, has nothing to restart.
func TestProxyRestartedDevice(t *testing.T) {
	d := NewProxy(t.TempDir())
	devs := d.Devices(Target{Instance: "c1", Port: DefaultPort})
	devs["root"] = map[string]string{"type": "disk", "path": "/"}
	name, once, ok := RestartedDevice(d, devs)
	if !ok || name != ProxyDeviceName || once["security.uid"] != "0" || len(once) != len(devs[name])+1 {
		t.Fatalf("first restart: %q %v %v", name, once, ok)
	}
	if _, set := devs[name]["security.uid"]; set {
		t.Fatal("the instance's own map was changed")
	}
	devs[name] = once
	_, twice, _ := RestartedDevice(d, devs)
	if _, set := twice["security.uid"]; set || len(twice) != len(once)-1 {
		t.Fatalf("second restart: %v", twice)
	}
	if _, _, ok := RestartedDevice(NewNetns(nil), devs); ok {
		t.Fatal("netns reaches daemons through no device")
	}
	if _, _, ok := RestartedDevice(d, map[string]map[string]string{"root": devs["root"]}); ok {
		t.Fatal("an instance without the device has one to restart")
	}
}

func TestTargetValidation(t *testing.T) {
	for _, d := range []Dialer{NewProxy(t.TempDir()), NewNetns(func(context.Context, string) (int, error) {
		t.Fatal("lookup called for an invalid target")
		return 0, nil
	})} {
		for _, tg := range []Target{{Instance: "", Port: 1}, {Instance: "a/b", Port: 1}, {Instance: "..", Port: 1}, {Instance: "ok", Port: 0}, {Instance: "ok", Port: 65536}, {Instance: "ok", Port: -1}} {
			if _, err := d.DialContext(context.Background(), tg); err == nil {
				t.Fatalf("%s: target %+v accepted", d.Name(), tg)
			}
		}
	}
}

func TestParseStartTime(t *testing.T) {
	// Field 2 may contain spaces and parentheses.
	line := "4242 (we ird) (name)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 200 18446744073709551615\n"
	got, err := parseStartTime([]byte(line))
	if err != nil || got != 987654 {
		t.Fatalf("parseStartTime = %d, %v", got, err)
	}
	if _, err := parseStartTime([]byte("1 (x) S 1 2")); err == nil {
		t.Fatal("short stat accepted")
	}
	if _, err := procStartTime(os.Getpid()); err != nil {
		t.Fatal(err)
	}
}

func requireRoot(t testing.TB) {
	t.Helper()
	if err := netnsSupported(); err != nil {
		t.Skipf("netns dialer unavailable here: %v", err)
	}
}

// A lookup that yields a host process (here the test itself) must never lead
// to a dial of the host's loopback.
func TestNetnsRefusesHostNamespace(t *testing.T) {
	requireRoot(t)
	tr := newTrap(t)
	calls := 0
	d := NewNetns(func(context.Context, string) (int, error) { calls++; return os.Getpid(), nil })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err := d.DialContext(ctx, Target{Instance: "impostor", Port: tr.port()})
	if err == nil || !strings.Contains(err.Error(), "own network namespace") {
		t.Fatalf("dial of a host PID: %v", err)
	}
	tr.assertUntouched(t)
	// The refused PID is not cached: the next dial looks it up anew, and
	// refuses again.
	if _, err := d.DialContext(ctx, Target{Instance: "impostor", Port: tr.port()}); err == nil {
		t.Fatal("second dial of a host PID succeeded")
	}
	tr.assertUntouched(t)
	if calls != 2 {
		t.Fatalf("lookup called %d times, want 2 (no caching of a refused PID)", calls)
	}
}

func TestNetnsNotRunning(t *testing.T) {
	requireRoot(t)
	for _, pid := range []int{0, -1} {
		d := NewNetns(func(context.Context, string) (int, error) { return pid, nil })
		_, err := d.DialContext(context.Background(), Target{Instance: "stopped", Port: DefaultPort})
		if !errors.Is(err, ErrNotRunning) {
			t.Fatalf("pid %d: err = %v, want ErrNotRunning", pid, err)
		}
	}
	boom := errors.New("incus unreachable")
	d := NewNetns(func(context.Context, string) (int, error) { return 0, boom })
	if _, err := d.DialContext(context.Background(), Target{Instance: "x", Port: DefaultPort}); !errors.Is(err, boom) {
		t.Fatalf("lookup error not wrapped: %v", err)
	}
}
