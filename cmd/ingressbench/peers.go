package main

// The edge beside its peers (issue 29): nginx, HAProxy and Caddy, Debian's
// packages, each a reverse proxy on a loopback port of its own in front of
// the byte relay into the guest (the peers cannot enter the guest's
// network namespace), started by this process as children with a
// configuration it writes, and ended with it. Each peer gets as many
// workers (nginx worker_processes, HAProxy nbthread, Caddy GOMAXPROCS) as
// the edge's process has Ps.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// peer is one reverse proxy in the comparison.
type peer struct {
	name   string
	addr   string // its loopback listener
	status string // "" when it serves; else why not, in a word or two ("not installed", …)
	detail string // and in full
	dir    string
	cmd    *exec.Cmd
	log    *os.File
	exited chan struct{}
}

// peerNames are the peers in the order of the table.
var peerNames = []string{"nginx", "haproxy", "caddy"}

// findBinary is name's path: on PATH, or in the sbin directories a root
// shell has and a sudo one may not.
func findBinary(name string) (string, bool) {
	if p, err := exec.LookPath(name); err == nil {
		return p, true
	}
	for _, d := range []string{"/usr/sbin", "/usr/bin", "/sbin", "/usr/local/sbin", "/usr/local/bin"} {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, true
		}
	}
	return "", false
}

// freePort is a loopback port free a moment ago (a peer binds it itself).
func freePort(ctx context.Context) (string, error) {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("a free loopback port: %w", err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()
	return addr, nil
}

// startPeer starts the named peer in front of relay with workers workers,
// in a directory of its own under work. A peer that cannot serve comes
// back with its status saying why, never as an error: the table says it.
func startPeer(ctx context.Context, name, work, relay string, workers int) *peer {
	p := &peer{name: name}
	bin, ok := findBinary(name)
	if !ok {
		p.status = "not installed"
		return p
	}
	p.dir = filepath.Join(work, name)
	if err := os.MkdirAll(p.dir, 0o700); err != nil {
		p.status, p.detail = "failed", err.Error()
		return p
	}
	addr, err := freePort(ctx)
	if err != nil {
		p.status, p.detail = "failed", err.Error()
		return p
	}
	p.addr = addr
	conf, args, env := peerConfig(name, p.dir, addr, relay, workers)
	confPath := filepath.Join(p.dir, map[string]string{"nginx": "nginx.conf", "haproxy": "haproxy.cfg", "caddy": "Caddyfile"}[name])
	if err := os.WriteFile(confPath, []byte(conf), 0o600); err != nil {
		p.status, p.detail = "failed", err.Error()
		return p
	}
	for i, a := range args {
		args[i] = strings.ReplaceAll(a, "{conf}", confPath)
	}
	if p.log, err = os.Create(filepath.Join(p.dir, "output.log")); err != nil {
		p.status, p.detail = "failed", err.Error()
		return p
	}
	p.cmd = exec.CommandContext(ctx, bin, args...)
	// Ended with the run (an error, Ctrl-C): the whole group, as stop does.
	p.cmd.Cancel = func() error { return syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM) }
	p.cmd.WaitDelay = 3 * time.Second
	p.cmd.Dir = p.dir
	p.cmd.Env = append(os.Environ(), env...)
	p.cmd.Stdout, p.cmd.Stderr = p.log, p.log
	// A process group of its own: the terminal's Ctrl-C reaches this
	// process alone, which ends the group (nginx's workers with it).
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		p.status, p.detail = "failed to start", err.Error()
		return p
	}
	p.exited = make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(p.exited) }()
	if err := p.await(ctx); err != nil {
		p.status, p.detail = "failed to start", err.Error()
		p.stop()
		return p
	}
	return p
}

// peerConfig is the peer's configuration, its arguments ({conf} for the
// configuration's path) and its environment's additions.
func peerConfig(name, dir, addr, relay string, workers int) (string, []string, []string) {
	switch name {
	case "nginx":
		// Request bodies stream (no request buffering) and answers are
		// buffered in memory only (no temporary files), in 64 KiB buffers
		// (its default is 4 or 8 KiB): the shape the edge has.
		// worker_connections and the descriptor limit leave room for 1,000
		// clients and as many upstream connections.
		return fmt.Sprintf(`user root root;
worker_processes %[1]d;
worker_rlimit_nofile 20000;
pid %[2]s/nginx.pid;
error_log %[2]s/error.log warn;
events {
	worker_connections 8192;
}
http {
	access_log off;
	client_body_temp_path %[2]s/client_body;
	proxy_temp_path %[2]s/proxy;
	keepalive_timeout 120s;
	keepalive_requests 1000000;
	upstream relay {
		server %[4]s;
		keepalive 1024;
		keepalive_requests 1000000;
		keepalive_timeout 120s;
	}
	server {
		listen %[3]s backlog=4096;
		client_max_body_size 0;
		client_body_buffer_size 64k;
		location / {
			proxy_pass http://relay;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
			proxy_set_header Host $http_host;
			proxy_request_buffering off;
			proxy_max_temp_file_size 0;
			proxy_buffer_size 64k;
			proxy_buffers 8 64k;
			proxy_busy_buffers_size 128k;
		}
	}
}
`, workers, dir, addr, relay), []string{"-p", dir + "/", "-e", dir + "/error.log", "-c", "{conf}", "-g", "daemon off;"}, nil
	case "haproxy":
		return fmt.Sprintf(`global
	nbthread %[1]d
	maxconn 4000
defaults
	mode http
	option http-keep-alive
	option splice-auto
	http-reuse always
	maxconn 4000
	timeout connect 5s
	timeout client 120s
	timeout server 120s
	timeout http-keep-alive 120s
frontend edge
	bind %[2]s
	backlog 4096
	default_backend relay
backend relay
	server relay %[3]s
`, workers, addr, relay), []string{"-f", "{conf}", "-db"}, nil
	case "caddy":
		_, port, _ := net.SplitHostPort(addr)
		// No admin endpoint, no certificates, no ACME: it fetches nothing.
		// Its storage and configuration directories are the temporary one.
		return fmt.Sprintf(`{
	admin off
	auto_https off
	storage file_system %[1]s/data
	servers {
		protocols h1
	}
}
http://:%[2]s {
	bind 127.0.0.1
	reverse_proxy %[3]s {
		transport http {
			keepalive 120s
			keepalive_idle_conns 1024
			keepalive_idle_conns_per_host 1024
		}
	}
}
`, dir, port, relay), []string{"run", "--config", "{conf}", "--adapter", "caddyfile"},
			[]string{"GOMAXPROCS=" + strconv.Itoa(workers), "HOME=" + dir, "XDG_DATA_HOME=" + dir + "/data", "XDG_CONFIG_HOME=" + dir + "/config"}
	}
	panic("unknown peer " + name)
}

// await waits up to 15 s for the peer to accept on its port.
func (p *peer) await(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", p.addr)
		if err == nil {
			_ = c.Close()
			return nil
		}
		select {
		case <-p.exited:
			return fmt.Errorf("exited: %s", p.logTail())
		case <-ctx.Done():
			return fmt.Errorf("never listened on %s: %s", p.addr, p.logTail())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (p *peer) logTail() string {
	b, _ := os.ReadFile(filepath.Join(p.dir, "output.log"))
	if e, err := os.ReadFile(filepath.Join(p.dir, "error.log")); err == nil {
		b = append(b, e...)
	}
	b = bytes.TrimSpace(b)
	if len(b) > 400 {
		b = b[len(b)-400:]
	}
	return strings.ReplaceAll(string(b), "\n", " | ")
}

// stop ends the peer's process group: SIGTERM, then SIGKILL after 3 s.
func (p *peer) stop() {
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	pgid := p.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(3 * time.Second):
		_ = syscall.Kill(-pgid, syscall.SIGKILL)
		<-p.exited
	}
	// nginx's workers may outlive their master by a moment.
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	if p.log != nil {
		_ = p.log.Close()
	}
}

// pids are the processes of the peer's group (nginx's master and workers;
// HAProxy and Caddy are one process each).
func (p *peer) pids() []int {
	if p.cmd == nil || p.cmd.Process == nil {
		return nil
	}
	pgid := p.cmd.Process.Pid
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return []int{pgid}
	}
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp …; comm may hold spaces.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) >= 3 && f[2] == strconv.Itoa(pgid) {
			out = append(out, pid)
		}
	}
	return out
}

// vmRSS is the sum of the processes' resident sets in bytes.
func vmRSS(pids []int) int64 {
	var total int64
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				f := strings.Fields(rest)
				if len(f) > 0 {
					kb, _ := strconv.ParseInt(f[0], 10, 64)
					total += kb << 10
				}
			}
		}
	}
	return total
}

// raiseFileLimit lifts the soft limit on open files to the hard one: 1,000
// clients hold 1,000 descriptors in the client, and the edge and the byte
// relay two each per client in this process. Children inherit it.
func raiseFileLimit() error {
	var l syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
		return fmt.Errorf("RLIMIT_NOFILE: %w", err)
	}
	if l.Cur < l.Max {
		l.Cur = l.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &l); err != nil {
			return fmt.Errorf("raise RLIMIT_NOFILE to %d: %w", l.Max, err)
		}
	}
	if l.Cur < 5000 {
		return errors.New("RLIMIT_NOFILE is below 5,000 even at its hard limit: raise it (ulimit -Hn) for 1,000 clients")
	}
	return nil
}

// trackedListener is the byte relay's listener: it keeps the connections
// it accepted until they close, so that closeAll can end them. Between the
// turns of the large downloads and of the 1,000 clients, the peers' idle
// upstream pools (up to a connection per client, each carried by the relay
// into the guest) are closed this way, so that one turn's idle connections
// do not weigh on the next path's turn, nor pile up in the guest's app.
type trackedListener struct {
	net.Listener
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func (l *trackedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	t := &trackedConn{Conn: c, l: l}
	l.mu.Lock()
	l.conns[t] = struct{}{}
	l.mu.Unlock()
	return t, nil
}

// closeAll closes every accepted connection still open: the relay's
// copies end, and with them its connections into the guest.
func (l *trackedListener) closeAll() {
	l.mu.Lock()
	cs := make([]net.Conn, 0, len(l.conns))
	for c := range l.conns {
		cs = append(cs, c)
	}
	l.mu.Unlock()
	for _, c := range cs {
		_ = c.Close()
	}
}

type trackedConn struct {
	net.Conn
	l    *trackedListener
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.l.mu.Lock()
		delete(c.l.conns, c)
		c.l.mu.Unlock()
	})
	return c.Conn.Close()
}
