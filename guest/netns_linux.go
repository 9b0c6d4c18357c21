//go:build linux

package guest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"
)

// nsID identifies a namespace: the device and inode of its nsfs file.
type nsID struct{ dev, ino uint64 }

// proc identifies a process across PID reuse: its PID and its start time in
// clock ticks after boot (field 22 of /proc/PID/stat).
type proc struct {
	pid   int
	start uint64
}

type netnsDialer struct {
	lookup  PIDLookup
	host    nsID  // the provider's own network namespace
	hostErr error // why host could not be determined; fails every dial

	mu    sync.Mutex
	procs map[string]proc // instance -> its init process, as last looked up
}

// NewNetns returns a Dialer that opens each connection from inside the
// instance's network namespace, to 127.0.0.1:PORT there. lookup returns the
// instance's init PID; it is called on the first dial of an instance and again
// when the cached PID has gone stale. Missing privileges are reported by
// DialContext; New checks them up front.
func NewNetns(lookup PIDLookup) Dialer {
	d := &netnsDialer{lookup: lookup, procs: make(map[string]proc)}
	d.host, d.hostErr = statNS("/proc/self/ns/net")
	if d.hostErr != nil {
		d.hostErr = fmt.Errorf("guest: netns dialer: cannot identify the provider's network namespace: %w", d.hostErr)
	}
	return d
}

func (d *netnsDialer) Name() string { return KindNetns }

// Devices returns nil: entering the namespace needs nothing on the instance.
func (d *netnsDialer) Devices(Target) map[string]map[string]string { return nil }

func (d *netnsDialer) Forget(instance string) {
	d.mu.Lock()
	delete(d.procs, instance)
	d.mu.Unlock()
}

func (d *netnsDialer) cached(instance string) (proc, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, ok := d.procs[instance]
	return p, ok
}

// drop forgets the instance's process if it is still p (a concurrent dial may
// already have stored a newer one).
func (d *netnsDialer) drop(instance string, p proc) {
	d.mu.Lock()
	if d.procs[instance] == p {
		delete(d.procs, instance)
	}
	d.mu.Unlock()
}

// refresh asks the lookup for the instance's init PID and caches it with its
// start time.
func (d *netnsDialer) refresh(ctx context.Context, t Target) (proc, error) {
	if d.lookup == nil {
		return proc{}, fmt.Errorf("guest: netns dial %s: no PID lookup configured", t)
	}
	pid, err := d.lookup(ctx, t.Instance)
	if err != nil {
		d.Forget(t.Instance)
		return proc{}, fmt.Errorf("guest: netns dial %s: PID lookup: %w", t, err)
	}
	if pid <= 0 {
		d.Forget(t.Instance)
		return proc{}, fmt.Errorf("guest: netns dial %s: %w (Incus reports no init process)", t, ErrNotRunning)
	}
	start, err := procStartTime(pid)
	if err != nil {
		d.Forget(t.Instance)
		if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
			return proc{}, fmt.Errorf("guest: netns dial %s: init PID %d reported by Incus does not exist here (the instance has just stopped, or the provider runs in another PID namespace than incusd): %w", t, pid, err)
		}
		return proc{}, fmt.Errorf("guest: netns dial %s: %w", t, err)
	}
	p := proc{pid: pid, start: start}
	d.mu.Lock()
	d.procs[t.Instance] = p
	d.mu.Unlock()
	return p, nil
}

// staleError marks a failure caused by the cached process no longer being
// the instance's init (or never having been): looking the PID up again may
// help.
type staleError struct{ err error }

func (e *staleError) Error() string { return e.err.Error() }
func (e *staleError) Unwrap() error { return e.err }

func isStale(err error) bool {
	var s *staleError
	return errors.As(err, &s)
}

// DialContext connects to 127.0.0.1:t.Port inside the instance's network
// namespace. A cached PID that fails in a way suggesting it is stale is looked
// up once more, and the dial retried once with the new process.
func (d *netnsDialer) DialContext(ctx context.Context, t Target) (net.Conn, error) {
	if err := t.validate(); err != nil {
		return nil, err
	}
	if d.hostErr != nil {
		return nil, d.hostErr
	}
	p, wasCached := d.cached(t.Instance)
	if !wasCached {
		var err error
		if p, err = d.refresh(ctx, t); err != nil {
			return nil, err
		}
	}
	c, err := d.dialProc(ctx, t, p)
	if err == nil {
		return c, nil
	}
	if isStale(err) {
		d.drop(t.Instance, p)
	}
	// Only a cached lookup can be out of date, and only a stale process or
	// a refused connection says it may be.
	retryable := isStale(err) || errors.Is(err, syscall.ECONNREFUSED)
	if !wasCached || ctx.Err() != nil || !retryable {
		return nil, err
	}
	fresh, lerr := d.refresh(ctx, t)
	if lerr != nil {
		return nil, lerr
	}
	if fresh == p && !isStale(err) {
		// Same process as before: the refusal is genuine (the daemon does not
		// listen yet, or any more); another attempt would only repeat it.
		return nil, err
	}
	c, err = d.dialProc(ctx, t, fresh)
	if err != nil && isStale(err) {
		d.drop(t.Instance, fresh)
	}
	return c, err
}

// dialProc dials 127.0.0.1:port in the network namespace of process p,
// after making sure p is still the process that was looked up and that its
// namespace is not the provider's own.
func (d *netnsDialer) dialProc(ctx context.Context, t Target, p proc) (net.Conn, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("guest: netns dial %s: %w", t, err)
	}
	path := "/proc/" + strconv.Itoa(p.pid) + "/ns/net"
	// Open first, then check the start time: if the process still has the
	// start time it had at lookup, it existed all along, so the descriptor
	// opened before the check is its namespace.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		err = &os.PathError{Op: "open", Path: path, Err: err}
		switch {
		case errors.Is(err, syscall.ENOENT), errors.Is(err, syscall.ESRCH):
			return nil, &staleError{fmt.Errorf("guest: netns dial %s: init PID %d is gone: %w", t, p.pid, err)}
		case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
			return nil, fmt.Errorf("guest: netns dial %s: %w (the netns dialer needs root: CAP_SYS_PTRACE and CAP_SYS_ADMIN)", t, err)
		}
		return nil, fmt.Errorf("guest: netns dial %s: %w", t, err)
	}
	handedOff := false
	defer func() {
		if !handedOff {
			// A read-only namespace descriptor: nothing is lost if its
			// close fails.
			_ = unix.Close(fd)
		}
	}()
	start, err := procStartTime(p.pid)
	if err != nil {
		return nil, &staleError{fmt.Errorf("guest: netns dial %s: init PID %d is gone: %w", t, p.pid, err)}
	}
	if start != p.start {
		return nil, &staleError{fmt.Errorf("guest: netns dial %s: PID %d is no longer the instance's init (start time changed)", t, p.pid)}
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("guest: netns dial %s: fstat %s: %w", t, path, err)
	}
	target := nsID{dev: st.Dev, ino: st.Ino}
	if target == d.host {
		return nil, &staleError{fmt.Errorf("guest: netns dial %s: refusing to dial: PID %d is in the provider's own network namespace, not a guest's", t, p.pid)}
	}

	type result struct {
		c   net.Conn
		err error
	}
	ch := make(chan result, 1)
	handedOff = true
	go onDisposableThread(func() {
		c, err := dialInNamespace(ctx, fd, d.host, target, t.Port)
		ch <- result{c, err}
	})
	select {
	case r := <-ch:
		if r.err != nil {
			return nil, fmt.Errorf("guest: netns dial %s (PID %d): %w", t, p.pid, r.err)
		}
		return r.c, nil
	case <-ctx.Done():
		go func() {
			if r := <-ch; r.c != nil {
				r.c.Close()
			}
		}()
		return nil, fmt.Errorf("guest: netns dial %s: %w", t, ctx.Err())
	}
}

// onDisposableThread is a goroutine body that runs fn on an OS thread that
// is locked to it and terminated when fn returns: the goroutine never calls
// runtime.UnlockOSThread, and a locked goroutine that exits takes its thread
// with it, so no other goroutine ever runs on a thread fn may have moved into
// a guest's namespace.
//
// The main thread is the exception: the runtime cannot terminate it and
// parks it instead, and /proc/self/ns/net shows its namespace, so it must
// never be moved. If the goroutine lands on it, the goroutine keeps it busy
// (locked, so nothing else can be scheduled there) while fn runs on another
// goroutine, then releases it unchanged.
func onDisposableThread(fn func()) {
	runtime.LockOSThread()
	if unix.Gettid() == unix.Getpid() {
		done := make(chan struct{})
		go func() {
			onDisposableThread(fn)
			close(done)
		}()
		<-done
		runtime.UnlockOSThread()
		return
	}
	fn()
}

// dialInNamespace runs on a locked OS thread that is discarded afterwards. It
// moves the thread into the namespace nsfd (expected to be target) and dials
// the guest's loopback there; the socket keeps that namespace for life.
func dialInNamespace(ctx context.Context, nsfd int, host, target nsID, port int) (net.Conn, error) {
	// A read-only namespace descriptor: nothing is lost if its close fails.
	defer func() { _ = unix.Close(nsfd) }()
	cur, err := statNS("/proc/thread-self/ns/net")
	if err != nil {
		return nil, err
	}
	if cur != host {
		return nil, errors.New("refusing to dial: this OS thread was not in the provider's network namespace before setns")
	}
	if err := unix.Setns(nsfd, unix.CLONE_NEWNET); err != nil {
		return nil, fmt.Errorf("setns: %w (the netns dialer needs CAP_SYS_ADMIN)", err)
	}
	if cur, err = statNS("/proc/thread-self/ns/net"); err != nil {
		return nil, err
	}
	if cur != target {
		return nil, errors.New("refusing to dial: setns did not move the thread into the guest's network namespace")
	}
	// "tcp4" with a literal address: no name resolution and no IP stack
	// probing, both of which could otherwise run on this thread and cache
	// results from the guest's namespace process-wide.
	var nd net.Dialer
	c, err := nd.DialContext(ctx, "tcp4", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		if errors.Is(err, syscall.ENETUNREACH) {
			return nil, fmt.Errorf("%w (the guest's loopback is down: its init must run `ip link set lo up`)", err)
		}
		return nil, err
	}
	return c, nil
}

func statNS(path string) (nsID, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return nsID{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	return nsID{dev: st.Dev, ino: st.Ino}, nil
}

// procStartTime returns field 22 (starttime) of /proc/PID/stat.
func procStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	return parseStartTime(b)
}

// parseStartTime extracts starttime from the contents of /proc/PID/stat. The
// command name (field 2) is in parentheses and may itself contain spaces and
// parentheses, so fields are counted from the last ')'.
func parseStartTime(stat []byte) (uint64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("malformed /proc/PID/stat")
	}
	fields := bytes.Fields(stat[i+1:])
	const idx = 22 - 3 // fields[0] is field 3 (state)
	if len(fields) <= idx {
		return 0, errors.New("malformed /proc/PID/stat: too few fields")
	}
	v, err := strconv.ParseUint(string(fields[idx]), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("malformed /proc/PID/stat: starttime: %w", err)
	}
	return v, nil
}

// netnsSupported reports why the netns dialer cannot work in this process:
// it needs CAP_SYS_ADMIN and CAP_SYS_PTRACE in the initial user namespace.
func netnsSupported() error {
	if _, err := statNS("/proc/self/ns/net"); err != nil {
		return err
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	has := func(c uint) bool { return data[c/32].Effective&(1<<(c%32)) != 0 }
	if !has(unix.CAP_SYS_ADMIN) || !has(unix.CAP_SYS_PTRACE) {
		return errors.New("the provider lacks CAP_SYS_ADMIN or CAP_SYS_PTRACE (run it as root)")
	}
	m, err := os.ReadFile("/proc/self/uid_map")
	if err != nil {
		return err
	}
	if f := bytes.Fields(m); len(f) != 3 || string(f[0]) != "0" || string(f[1]) != "0" || string(f[2]) != "4294967295" {
		return errors.New("the provider runs in a user namespace; it must run in the host's initial user namespace")
	}
	return nil
}
