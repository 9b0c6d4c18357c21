//go:build linux

package guest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// Integration tests against the real incusd on this machine. Setup uses the
// incus CLI (project, image) and the REST API on the unix socket (instances,
// state, PIDs). Everything lives in a project of its own, lsdial-t-<pid>,
// removed at the end of the run; projects left by killed runs (their pid no
// longer alive) are removed at the start of the next.
//
//	INCUS_PROVIDER_REQUIRE_INCUS=1  fail instead of skip when incusd is unreachable
//	GUESTDIAL_TEST_IMAGE            image alias (default guestdial-test); built
//	                                from /bin/busybox and imported if missing,
//	                                and then deleted at the end of the run
//	INCUS_SOCKET                    default /var/lib/incus/unix.socket

const testProjectPrefix = "lsdial-t-"

func TestMain(m *testing.M) {
	code := m.Run()
	if fix != nil {
		fix.teardown()
	}
	os.Exit(code)
}

func incusSocket() string {
	if s := os.Getenv("INCUS_SOCKET"); s != "" {
		return s
	}
	return "/var/lib/incus/unix.socket"
}

func testImage() string {
	if s := os.Getenv("GUESTDIAL_TEST_IMAGE"); s != "" {
		return s
	}
	return "guestdial-test"
}

// incusAPI is a minimal client of the Incus REST API, for the tests.
type incusAPI struct {
	hc      *http.Client
	project string
}

func newIncusAPI(socket, project string) *incusAPI {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
	}
	return &incusAPI{hc: &http.Client{Transport: tr}, project: project}
}

type incusResponse struct {
	Type       string          `json:"type"`
	StatusCode int             `json:"status_code"`
	Error      string          `json:"error"`
	Operation  string          `json:"operation"`
	Metadata   json.RawMessage `json:"metadata"`
}

// do calls the API; for async responses it waits for the operation.
func (a *incusAPI) do(ctx context.Context, method, path string, body, out any) error {
	u := "http://incus" + path
	if a.project != "" {
		sep := "?"
		if strings.Contains(path, "?") {
			sep = "&"
		}
		u += sep + "project=" + url.QueryEscape(a.project)
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, rd)
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := a.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var r incusResponse
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return fmt.Errorf("%s %s: %w", method, path, err)
	}
	if r.Type == "error" {
		return fmt.Errorf("%s %s: %s", method, path, r.Error)
	}
	if r.Type == "async" {
		var op struct {
			Status string `json:"status"`
			Err    string `json:"err"`
		}
		if err := a.do(ctx, http.MethodGet, r.Operation+"/wait?timeout=120", nil, &op); err != nil {
			return err
		}
		if op.Status != "Success" {
			return fmt.Errorf("%s %s: operation %s: %s", method, path, op.Status, op.Err)
		}
		return nil
	}
	if out != nil {
		return json.Unmarshal(r.Metadata, out)
	}
	return nil
}

// pid is a PIDLookup.
func (a *incusAPI) pid(ctx context.Context, name string) (int, error) {
	var st struct {
		PID int `json:"pid"`
	}
	if err := a.do(ctx, http.MethodGet, "/1.0/instances/"+url.PathEscape(name)+"/state", nil, &st); err != nil {
		return 0, err
	}
	return st.PID, nil
}

func (a *incusAPI) state(ctx context.Context, name, action string, force bool) error {
	body := map[string]any{"action": action, "timeout": 30, "force": force}
	return a.do(ctx, http.MethodPut, "/1.0/instances/"+url.PathEscape(name)+"/state", body, nil)
}

func (a *incusAPI) create(ctx context.Context, name, alias string, devices map[string]map[string]string, start bool) error {
	body := map[string]any{
		"name":    name,
		"type":    "container",
		"source":  map[string]any{"type": "image", "alias": alias},
		"devices": devices,
		"start":   start,
	}
	return a.do(ctx, http.MethodPost, "/1.0/instances", body, nil)
}

func (a *incusAPI) remove(ctx context.Context, name string) error {
	_ = a.state(ctx, name, "stop", true)
	return a.do(ctx, http.MethodDelete, "/1.0/instances/"+url.PathEscape(name), nil, nil)
}

func (a *incusAPI) instances(ctx context.Context) ([]string, error) {
	var urls []string
	if err := a.do(ctx, http.MethodGet, "/1.0/instances", nil, &urls); err != nil {
		return nil, err
	}
	for i, u := range urls {
		urls[i] = u[strings.LastIndexByte(u, '/')+1:]
	}
	return urls, nil
}

// incusFixture is the per-run Incus setup shared by the integration tests.
type incusFixture struct {
	api           *incusAPI
	project       string
	image         string
	importedImage bool
	sockDir       string
	err           error
}

var (
	fix     *incusFixture
	fixOnce sync.Once
)

func incusCLI(args ...string) (string, error) {
	out, err := exec.Command("incus", args...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("incus %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

// needIncus returns the shared fixture, or skips (fails, with
// INCUS_PROVIDER_REQUIRE_INCUS=1) when incusd cannot be reached.
func needIncus(t *testing.T) *incusFixture {
	t.Helper()
	api := newIncusAPI(incusSocket(), "")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var server struct {
		APIVersion string `json:"api_version"`
	}
	if err := api.do(ctx, http.MethodGet, "/1.0", nil, &server); err != nil {
		msg := fmt.Sprintf("incusd unreachable at %s: %v", incusSocket(), err)
		if os.Getenv("INCUS_PROVIDER_REQUIRE_INCUS") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg + " (set INCUS_PROVIDER_REQUIRE_INCUS=1 to fail instead)")
	}
	if err := netnsSupported(); err != nil {
		t.Fatalf("incusd is reachable but the netns dialer cannot work in this process: %v", err)
	}
	if _, err := exec.LookPath("incus"); err != nil {
		t.Fatalf("incusd is reachable but the incus CLI is missing: %v", err)
	}
	fixOnce.Do(func() { fix = setupIncus() })
	if fix.err != nil {
		t.Fatal(fix.err)
	}
	return fix
}

func setupIncus() *incusFixture {
	f := &incusFixture{project: testProjectPrefix + strconv.Itoa(os.Getpid()), image: testImage()}
	sweepStaleProjects()
	if _, err := incusCLI("project", "create", f.project,
		"-c", "features.images=false", "-c", "features.profiles=false"); err != nil {
		f.err = err
		return f
	}
	f.api = newIncusAPI(incusSocket(), f.project)
	dir, err := os.MkdirTemp("", "lsdial-")
	if err != nil {
		f.err = err
		return f
	}
	f.sockDir = dir
	if _, err := incusCLI("image", "info", f.image); err != nil {
		if err := importTestImage(f.image); err != nil {
			if _, ierr := incusCLI("image", "info", f.image); ierr != nil {
				f.err = fmt.Errorf("image %q is missing and could not be built: %w", f.image, err)
				return f
			}
			// Another run imported it meanwhile; it is that run's to delete.
		} else {
			f.importedImage = true
		}
	}
	return f
}

func (f *incusFixture) teardown() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if f.api != nil {
		names, _ := f.api.instances(ctx)
		for _, n := range names {
			if err := f.api.remove(ctx, n); err != nil {
				fmt.Fprintf(os.Stderr, "guest tests: removing instance %s: %v\n", n, err)
			}
		}
	}
	if _, err := incusCLI("project", "delete", f.project); err != nil && !strings.Contains(err.Error(), "not found") {
		fmt.Fprintf(os.Stderr, "guest tests: %v\n", err)
	}
	if f.importedImage {
		if _, err := incusCLI("image", "delete", f.image); err != nil {
			fmt.Fprintf(os.Stderr, "guest tests: %v\n", err)
		}
	}
	if f.sockDir != "" {
		os.RemoveAll(f.sockDir)
	}
}

// sweepStaleProjects removes test projects whose run (pid in the name) has
// ended: a run killed before its teardown leaves one behind.
func sweepStaleProjects() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var projects []string
	if err := newIncusAPI(incusSocket(), "").do(ctx, http.MethodGet, "/1.0/projects", nil, &projects); err != nil {
		return
	}
	for _, p := range projects {
		name := p[strings.LastIndexByte(p, '/')+1:]
		pidStr, ok := strings.CutPrefix(name, testProjectPrefix)
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(pidStr)
		if err != nil || pid == os.Getpid() {
			continue
		}
		if err := syscall.Kill(pid, 0); err == nil || errors.Is(err, syscall.EPERM) {
			continue // that run is still going
		}
		api := newIncusAPI(incusSocket(), name)
		names, _ := api.instances(ctx)
		for _, n := range names {
			_ = api.remove(ctx, n)
		}
		_, _ = incusCLI("project", "delete", name)
	}
}

// guestInit is the test image's /sbin/init: loopback up, then busybox httpd
// on the guest's loopback serving /id (the hostname, i.e. the instance
// name); SIGPWR (incus stop) ends it.
var guestInit = `#!/bin/busybox sh
/bin/busybox ip link set lo up
/bin/busybox mkdir -p /www
/bin/busybox hostname > /www/id
/bin/busybox httpd -f -p 127.0.0.1:` + strconv.Itoa(DefaultPort) + ` -h /www &
trap 'exit 0' PWR TERM INT
while :; do /bin/busybox sleep 3600 & wait $!; done
`

// importTestImage builds a busybox container image from the host's
// /bin/busybox and imports it under alias.
func importTestImage(alias string) error {
	bb, err := os.ReadFile("/bin/busybox")
	if err != nil {
		return fmt.Errorf("need a static /bin/busybox to build the test image: %w", err)
	}
	var buf bytes.Buffer
	gz := gzip.NewWriter(&buf)
	tw := tar.NewWriter(gz)
	now := time.Now()
	add := func(name string, mode int64, body []byte) error {
		h := &tar.Header{Name: name, Mode: mode, ModTime: now, Typeflag: tar.TypeReg, Size: int64(len(body))}
		if strings.HasSuffix(name, "/") {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err := tw.Write(body)
		return err
	}
	meta := fmt.Sprintf("architecture: x86_64\ncreation_date: %d\nproperties:\n  description: guest dialer test (busybox httpd on loopback)\n  os: busybox\n  release: \"1\"\n", now.Unix())
	if err := add("metadata.yaml", 0o644, []byte(meta)); err != nil {
		return err
	}
	for _, d := range []string{"", "bin", "sbin", "etc", "proc", "sys", "dev", "tmp", "root", "run", "var", "www"} {
		if err := add(strings.TrimSuffix("rootfs/"+d, "/")+"/", 0o755, nil); err != nil {
			return err
		}
	}
	if err := add("rootfs/bin/busybox", 0o755, bb); err != nil {
		return err
	}
	if err := add("rootfs/sbin/init", 0o755, []byte(guestInit)); err != nil {
		return err
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := gz.Close(); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "guestdial-image-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	file := filepath.Join(dir, "guest.tar.gz")
	if err := os.WriteFile(file, buf.Bytes(), 0o600); err != nil {
		return err
	}
	_, err = incusCLI("image", "import", file, "--alias", alias)
	return err
}

// newInstance creates (and optionally starts) an instance with the devices
// the given dialers need; it is removed when the test ends.
func (f *incusFixture) newInstance(t *testing.T, name string, start bool, dialers ...Dialer) Target {
	t.Helper()
	tg := Target{Instance: name, Port: DefaultPort}
	devices := map[string]map[string]string{}
	for _, d := range dialers {
		for k, v := range d.Devices(tg) {
			devices[k] = v
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := f.api.create(ctx, name, f.image, devices, start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := f.api.remove(ctx, name); err != nil {
			t.Errorf("removing %s: %v", name, err)
		}
	})
	return tg
}

func (f *incusFixture) dialers(t *testing.T) (netns, proxy Dialer) {
	t.Helper()
	n, err := New(KindNetns, Options{Lookup: f.api.pid})
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(KindProxy, Options{SocketDir: f.sockDir})
	if err != nil {
		t.Fatal(err)
	}
	return n, p
}

func (f *incusFixture) setState(t *testing.T, name, action string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := f.api.state(ctx, name, action, true); err != nil {
		t.Fatal(err)
	}
}

func (f *incusFixture) pidOf(t *testing.T, name string) int {
	t.Helper()
	pid, err := f.api.pid(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// Both dialers reach the daemon port on the guest's own loopback, the guest
// has no interface but lo, and nothing of the guest is reachable on the host.
func TestIncusDialersReachGuestLoopback(t *testing.T) {
	f := needIncus(t)
	netns, proxy := f.dialers(t)
	tg := f.newInstance(t, "gd-reach", true, proxy)

	waitID(t, proxy, tg, tg.Instance, 30*time.Second)
	waitID(t, netns, tg, tg.Instance, 30*time.Second)

	pid := f.pidOf(t, tg.Instance)
	guestNet := "/proc/" + strconv.Itoa(pid) + "/net"
	if ifs := interfaces(t, guestNet); len(ifs) != 1 || ifs[0] != "lo" {
		t.Fatalf("guest interfaces %v, want only lo", ifs)
	}
	if ls := listenersInNetns(t, guestNet); len(ls) != 1 || ls[0] != "127.0.0.1:"+strconv.Itoa(DefaultPort) {
		t.Fatalf("guest listeners %v, want only 127.0.0.1:%d", ls, DefaultPort)
	}
	if hostListensTCP(t, DefaultPort) {
		t.Logf("note: something on the host listens on port %d; checking it is not the guest", DefaultPort)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if c, err := hostDial(ctx, DefaultPort); err == nil {
			if id, _ := httpGet(c, "/id", time.Second); id == tg.Instance {
				t.Fatal("the guest's daemon answers on the host's loopback")
			}
		}
		cancel()
	} else {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if c, err := hostDial(ctx, DefaultPort); err == nil {
			c.Close()
			t.Fatalf("the host's 127.0.0.1:%d accepted a connection", DefaultPort)
		}
		cancel()
	}
	// The proxy's host end is a unix socket only the provider can open.
	sock := filepath.Join(f.sockDir, tg.Instance+".sock")
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("%s: mode %v, want a socket with 0600", sock, fi.Mode())
	}
	// The netns dialer's socket lives in the guest: its local end is the
	// guest's loopback, and it shows up in the guest's socket table only.
	c, err := netns.DialContext(context.Background(), tg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if la := c.LocalAddr().(*net.TCPAddr); !la.IP.Equal(net.IPv4(127, 0, 0, 1)) {
		t.Fatalf("local address %v", la)
	}
	local, remote := c.LocalAddr().(*net.TCPAddr).Port, c.RemoteAddr().(*net.TCPAddr).Port
	if hostHasConn(t, "/proc/self/net", local, remote) {
		t.Fatal("the netns connection is visible in the host's namespace")
	}
	if !hostHasConn(t, guestNet, local, remote) {
		t.Fatal("the netns connection is not in the guest's namespace")
	}
}

// hostHasConn reports whether netDir/tcp holds the connection from
// 127.0.0.1:local to 127.0.0.1:remote. Both ends are matched: ports are
// per namespace, so a host socket of any other connection may hold the
// same local port by chance (CI met one among the host's many loopback
// sockets, and the test failed for it).
func hostHasConn(t *testing.T, netDir string, local, remote int) bool {
	t.Helper()
	b, err := os.ReadFile(netDir + "/tcp")
	if err != nil {
		t.Fatal(err)
	}
	// /proc/net/tcp writes an IPv4 address as the hex of its bytes in
	// host order: 127.0.0.1 is 0100007F on this little-endian machine.
	wantLocal, wantRemote := fmt.Sprintf("0100007F:%04X", local), fmt.Sprintf("0100007F:%04X", remote)
	for _, line := range strings.Split(string(b), "\n")[1:] {
		if fs := strings.Fields(line); len(fs) > 2 && fs[1] == wantLocal && fs[2] == wantRemote {
			return true
		}
	}
	return false
}

// A stopped instance is refused with ErrNotRunning, both with a PID cached
// from when it ran and with a fresh dialer, and nothing is dialled on the
// host (a trap listens on the host's loopback at the target port).
func TestIncusNetnsRefusesStoppedInstance(t *testing.T) {
	f := needIncus(t)
	netns, proxy := f.dialers(t)
	tg := f.newInstance(t, "gd-stopped", true, proxy)
	waitID(t, netns, tg, tg.Instance, 30*time.Second)
	oldPID := f.pidOf(t, tg.Instance)

	f.setState(t, tg.Instance, "stop")
	tr := newTrap(t)
	trapTarget := Target{Instance: tg.Instance, Port: tr.port()}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, d := range []Dialer{netns, NewNetns(f.api.pid)} {
		for _, target := range []Target{tg, trapTarget} {
			_, err := d.DialContext(ctx, target)
			if !errors.Is(err, ErrNotRunning) {
				t.Fatalf("dial %s of a stopped instance: %v, want ErrNotRunning", target, err)
			}
			t.Logf("stopped instance: %v", err)
		}
	}
	tr.assertUntouched(t)
	if _, ok := netns.(*netnsDialer).cached(tg.Instance); ok {
		t.Fatal("a stopped instance's PID stays cached")
	}
	if _, err := os.Stat("/proc/" + strconv.Itoa(oldPID)); err == nil {
		t.Logf("note: PID %d was reused by another process", oldPID)
	}
	// The proxy's socket file outlives the instance; dialing it is refused.
	if _, err := proxy.DialContext(ctx, tg); err == nil {
		t.Fatal("proxy dial of a stopped instance succeeded")
	} else {
		t.Logf("stopped instance, proxy: %v", err)
	}
}

// After a restart the cached PID is stale; the netns dialer notices, looks the
// PID up again and reaches the new init, without the caller calling Forget.
func TestIncusNetnsRecoversAfterRestart(t *testing.T) {
	f := needIncus(t)
	var lookups atomic.Int64
	netns := NewNetns(func(ctx context.Context, name string) (int, error) {
		lookups.Add(1)
		return f.api.pid(ctx, name)
	})
	tg := f.newInstance(t, "gd-restart", true)
	waitID(t, netns, tg, tg.Instance, 30*time.Second)
	pid1 := f.pidOf(t, tg.Instance)
	if p, _ := netns.(*netnsDialer).cached(tg.Instance); p.pid != pid1 {
		t.Fatalf("cached PID %d, instance PID %d", p.pid, pid1)
	}

	f.setState(t, tg.Instance, "restart")
	pid2 := f.pidOf(t, tg.Instance)
	if pid2 <= 0 || pid2 == pid1 {
		t.Fatalf("PID after restart: %d (before %d)", pid2, pid1)
	}
	// The first dial after the restart must not go anywhere near the old PID's
	// namespace; it may fail only because the new guest is still booting.
	before := lookups.Load()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	_, err := fetchID(ctx, netns, tg)
	cancel()
	if err != nil {
		t.Logf("first dial after restart (guest still booting?): %v", err)
		if isStale(err) {
			t.Fatalf("stale PID error survived the retry: %v", err)
		}
	} else {
		t.Logf("first dial after restart succeeded after %d PID lookup(s)", lookups.Load()-before)
	}
	if n := lookups.Load() - before; n != 1 {
		t.Fatalf("first dial after restart made %d PID lookups, want exactly 1", n)
	}
	waitID(t, netns, tg, tg.Instance, 30*time.Second)
	if p, _ := netns.(*netnsDialer).cached(tg.Instance); p.pid != pid2 {
		t.Fatalf("cached PID %d after restart, instance PID %d", p.pid, pid2)
	}
}

// A frozen guest: the kernel completes the TCP handshake into the listen
// backlog, so both dialers succeed, but nothing answers until the guest is
// unfrozen. This is why readiness needs a protocol exchange.
func TestIncusFrozenGuestAcceptsButDoesNotAnswer(t *testing.T) {
	f := needIncus(t)
	netns, proxy := f.dialers(t)
	tg := f.newInstance(t, "gd-frozen", true, proxy)
	waitID(t, netns, tg, tg.Instance, 30*time.Second)
	waitID(t, proxy, tg, tg.Instance, 30*time.Second)

	f.setState(t, tg.Instance, "freeze")
	unfrozen := false
	defer func() {
		if !unfrozen {
			f.setState(t, tg.Instance, "unfreeze")
		}
	}()
	type pending struct {
		name string
		c    net.Conn
	}
	var ps []pending
	for _, d := range []Dialer{netns, proxy} {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c, err := d.DialContext(ctx, tg)
		cancel()
		if err != nil {
			t.Fatalf("%s dial of a frozen guest failed (%v); the package doc says it succeeds", d.Name(), err)
		}
		if _, err := io.WriteString(c, "GET /id HTTP/1.0\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
		n, err := c.Read(make([]byte, 1))
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("%s: a frozen guest answered: n=%d err=%v", d.Name(), n, err)
		}
		ps = append(ps, pending{d.Name(), c})
	}
	f.setState(t, tg.Instance, "unfreeze")
	unfrozen = true
	for _, p := range ps {
		p.c.SetReadDeadline(time.Now().Add(5 * time.Second))
		b, err := io.ReadAll(p.c)
		p.c.Close()
		if err != nil || !bytes.Contains(b, []byte(tg.Instance)) {
			t.Logf("%s: request sent while frozen, after unfreeze: %q, %v", p.name, b, err)
		} else {
			t.Logf("%s: request sent while frozen was answered after unfreeze", p.name)
		}
	}
}
