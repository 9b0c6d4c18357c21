package guest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// ProxyDeviceName is the name of the Incus proxy device the proxy dialer
// needs on every instance.
const ProxyDeviceName = "lightspeed-daemon"

// maxUnixPath is the longest path a unix socket address can hold on Linux
// (sun_path is 108 bytes including the terminating NUL).
const maxUnixPath = 107

type proxyDialer struct {
	dir    string
	dirErr error // why the socket directory is unusable, reported by DialContext
	uid    int
	gid    int
}

// NewProxy returns a Dialer that reaches the guest daemon through an Incus
// proxy device listening on <socketDir>/<instance>.sock on the host. The
// directory is created (mode 0700) if missing. A problem with it is reported
// by every DialContext; New reports it at once.
func NewProxy(socketDir string) Dialer {
	p := &proxyDialer{uid: os.Getuid(), gid: os.Getgid()}
	p.dir, p.dirErr = prepareSocketDir(socketDir)
	return p
}

func newProxy(socketDir string) (*proxyDialer, error) {
	p := NewProxy(socketDir).(*proxyDialer)
	if p.dirErr != nil {
		return nil, p.dirErr
	}
	return p, nil
}

// prepareSocketDir makes sure dir exists, is a directory, and nobody but its
// owner can create or replace sockets in it (a planted socket would receive
// the provider's traffic to a guest).
func prepareSocketDir(dir string) (string, error) {
	if dir == "" {
		return "", errors.New("guest: the proxy dialer needs a socket directory")
	}
	if !filepath.IsAbs(dir) {
		return dir, fmt.Errorf("guest: proxy socket directory %q is not an absolute path (Incus needs one)", dir)
	}
	dir = filepath.Clean(dir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return dir, fmt.Errorf("guest: proxy socket directory: %w", err)
	}
	fi, err := os.Stat(dir)
	if err != nil {
		return dir, fmt.Errorf("guest: proxy socket directory: %w", err)
	}
	if !fi.IsDir() {
		return dir, fmt.Errorf("guest: proxy socket directory %q is not a directory", dir)
	}
	if fi.Mode().Perm()&0o022 != 0 {
		return dir, fmt.Errorf("guest: proxy socket directory %q has mode %04o: others could replace the guests' sockets; use a directory writable only by its owner (0700)", dir, fi.Mode().Perm())
	}
	return dir, nil
}

func (p *proxyDialer) Name() string { return KindProxy }

// socketPath is where the device of the instance listens.
func (p *proxyDialer) socketPath(instance string) string {
	return filepath.Join(p.dir, instance+".sock")
}

// Devices returns the proxy device: a unix socket on the host, owned by the
// provider's uid/gid with mode 0600, connected to the daemon's port on the
// guest's loopback. bind=host means the listening side is on the host and the
// connecting side inside the guest, so the guest needs no network at all.
func (p *proxyDialer) Devices(t Target) map[string]map[string]string {
	return map[string]map[string]string{
		ProxyDeviceName: {
			"type":    "proxy",
			"bind":    "host",
			"listen":  "unix:" + p.socketPath(t.Instance),
			"connect": "tcp:127.0.0.1:" + strconv.Itoa(t.Port),
			"mode":    "0600",
			"uid":     strconv.Itoa(p.uid),
			"gid":     strconv.Itoa(p.gid),
		},
	}
}

// restartedDevice is the proxy device's config with security.uid toggled
// between unset and "0", its default: the same device to the guest, a
// changed one to the server, which stops and starts it. LXD 5.0 can leave a
// running container's proxy dead after a graceful stop that failed raced a
// start (make test's LXD lane met it under load: the old forkproxy still
// alive for the container's previous init, nothing listening on the
// socket, for as long as the container ran). Incus takes the key too.
func (p *proxyDialer) restartedDevice(devices map[string]map[string]string) (string, map[string]string, bool) {
	config, ok := devices[ProxyDeviceName]
	if !ok {
		return "", nil, false
	}
	out := make(map[string]string, len(config)+1)
	for k, v := range config {
		out[k] = v
	}
	if _, set := out["security.uid"]; set {
		delete(out, "security.uid")
	} else {
		out["security.uid"] = "0"
	}
	return ProxyDeviceName, out, true
}

// Forget is a no-op: the proxy dialer keeps no per-instance state. A socket
// file left behind by a stopped instance is replaced by Incus at the next
// start and is harmless until then (dialing it is refused).
func (p *proxyDialer) Forget(string) {}

// Removed deletes the socket file of a deleted instance: neither Incus nor
// LXD removes it (seen with LXD 5.0.2), and a long-lived provider would
// otherwise collect one per target it ever closed. Only a socket is
// removed, never another kind of file that happens to have the name.
func (p *proxyDialer) Removed(instance string) {
	if p.dirErr != nil || (Target{Instance: instance, Port: 1}).validate() != nil {
		return
	}
	path := p.socketPath(instance)
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSocket != 0 {
		_ = os.Remove(path)
	}
}

func (p *proxyDialer) DialContext(ctx context.Context, t Target) (net.Conn, error) {
	if err := t.validate(); err != nil {
		return nil, err
	}
	if p.dirErr != nil {
		return nil, p.dirErr
	}
	path := p.socketPath(t.Instance)
	if len(path) > maxUnixPath {
		return nil, fmt.Errorf("guest: proxy dial %s: socket path %q is longer than %d bytes; use a shorter socket directory", t, path, maxUnixPath)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
			return nil, fmt.Errorf("guest: proxy dial %s: nothing listens on %s (instance stopped, or created without the %q device): %w: %w", t, path, ProxyDeviceName, ErrDeviceDown, err)
		}
		return nil, fmt.Errorf("guest: proxy dial %s: %w", t, err)
	}
	return c, nil
}
