package guest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The test guests (Incus containers and `unshare --net` processes) run busybox
// httpd on their loopback, serving /id: the guest's name. Fetching /id through
// a dialer proves which guest was reached.

// httpGet sends GET path over c (HTTP/1.0, so the server closes) and returns
// the trimmed body. It closes c.
func httpGet(c net.Conn, path string, timeout time.Duration) (string, error) {
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
		return "", err
	}
	if _, err := io.WriteString(c, "GET "+path+" HTTP/1.0\r\nHost: guest\r\n\r\n"); err != nil {
		return "", err
	}
	r := bufio.NewReader(c)
	status, err := r.ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("reading status line: %w", err)
	}
	if !strings.Contains(status, " 200 ") {
		return "", fmt.Errorf("unexpected status %q", strings.TrimSpace(status))
	}
	rest, err := io.ReadAll(r)
	if err != nil {
		return "", err
	}
	_, body, ok := bytes.Cut(rest, []byte("\r\n\r\n"))
	if !ok {
		return "", errors.New("no end of headers")
	}
	return strings.TrimSpace(string(body)), nil
}

// fetchID dials t with d and returns the guest's /id.
func fetchID(ctx context.Context, d Dialer, t Target) (string, error) {
	c, err := d.DialContext(ctx, t)
	if err != nil {
		return "", err
	}
	return httpGet(c, "/id", 2*time.Second)
}

// waitID polls fetchID until it returns want or the timeout passes.
func waitID(t testing.TB, d Dialer, tg Target, want string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		got, err := fetchID(ctx, d, tg)
		cancel()
		if err == nil && got == want {
			return
		}
		if err == nil {
			err = fmt.Errorf("got id %q, want %q", got, want)
		}
		last = err
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s dialer never reached %s within %v: last error: %v", d.Name(), tg, timeout, last)
}

// hostListensTCP reports whether any socket in the test process's own network
// namespace listens on TCP port (IPv4 or IPv6, any address).
func hostListensTCP(t testing.TB, port int) bool {
	t.Helper()
	return listensTCP(t, "/proc/self/net", port)
}

// listensTCP reads netDir/tcp and netDir/tcp6 for LISTEN sockets on port.
func listensTCP(t testing.TB, netDir string, port int) bool {
	t.Helper()
	want := fmt.Sprintf(":%04X", port)
	for _, f := range []string{"tcp", "tcp6"} {
		b, err := os.ReadFile(netDir + "/" + f)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 4 {
				continue
			}
			if strings.HasSuffix(fs[1], want) && fs[3] == "0A" { // 0A = TCP_LISTEN
				return true
			}
		}
	}
	return false
}

// listenersInNetns returns the "addr:port" of LISTEN sockets seen in
// netDir/tcp (IPv4 only, enough for busybox httpd bound to 127.0.0.1).
func listenersInNetns(t testing.TB, netDir string) []string {
	t.Helper()
	b, err := os.ReadFile(netDir + "/tcp")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n")[1:] {
		fs := strings.Fields(line)
		if len(fs) < 4 || fs[3] != "0A" {
			continue
		}
		a, p, _ := strings.Cut(fs[1], ":")
		ab, err := hex.DecodeString(a)
		if err != nil || len(ab) != 4 {
			continue
		}
		port, _ := strconv.ParseUint(p, 16, 16)
		ip := net.IPv4(ab[3], ab[2], ab[1], ab[0]) // little-endian on x86
		out = append(out, net.JoinHostPort(ip.String(), strconv.Itoa(int(port))))
	}
	return out
}

// interfaces lists the network interfaces seen in netDir/dev.
func interfaces(t testing.TB, netDir string) []string {
	t.Helper()
	b, err := os.ReadFile(netDir + "/dev")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n")[2:] {
		name, _, ok := strings.Cut(line, ":")
		if ok {
			out = append(out, strings.TrimSpace(name))
		}
	}
	slices.Sort(out)
	return out
}

// trap is a listener on the host's loopback; any accepted connection means
// a dialer dialled the host instead of a guest.
type trap struct {
	ln       net.Listener
	accepted chan struct{}
}

func newTrap(t testing.TB) *trap {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tr := &trap{ln: ln, accepted: make(chan struct{}, 16)}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
			tr.accepted <- struct{}{}
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return tr
}

func (tr *trap) port() int { return tr.ln.Addr().(*net.TCPAddr).Port }

func (tr *trap) assertUntouched(t testing.TB) {
	t.Helper()
	select {
	case <-tr.accepted:
		t.Fatal("a connection reached the HOST's loopback: the dialer must never dial the host")
	case <-time.After(50 * time.Millisecond):
	}
}

// durations summarises latency samples.
type durations []time.Duration

func (ds durations) pct(p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(float64(len(s)-1)*p + 0.5)
	return s[i]
}

func (ds durations) String() string {
	if len(ds) == 0 {
		return "no samples"
	}
	return fmt.Sprintf("n=%d median=%s p95=%s min=%s max=%s",
		len(ds), fmtDur(ds.pct(0.5)), fmtDur(ds.pct(0.95)), fmtDur(ds.pct(0)), fmtDur(ds.pct(1)))
}

func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.3fs", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
	default:
		return fmt.Sprintf("%.0fµs", float64(d)/float64(time.Microsecond))
	}
}

// hostDial dials the test's own loopback, to show nothing is there.
func hostDial(ctx context.Context, port int) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp4", "127.0.0.1:"+strconv.Itoa(port))
}
