package incus

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestMeasureExec takes an exec stream (the exec GuestDialer's dial) apart
// on the cluster rig of deploy/dev/incus-cluster-up.sh, the way a provider
// on its first member dials a guest on another member, and on its own. It
// runs only with INCUS_EXEC_MEASURE=1:
//
//	INCUS_EXEC_MEASURE=1 go test -count=1 -v -run MeasureExec ./incus/
//
// INCUS_EXEC_MEASURE_N (default 40) rounds. For each round and guest: the
// POST, each of the four websocket dials one after the other (and a bare
// TLS connect to the same endpoint, which every dial starts with), the
// four through dialExecStreams as ExecStream dials them, and then the time
// from the stream being ready to the first byte of the daemon's WebSocket
// answer (nc starting in the guest, connecting, the daemon answering).
// Then exec into a frozen guest while it is being unfrozen, as a wake from
// paused probes it. (It cannot use internal/incustest: that package imports
// this one.)
func TestMeasureExec(t *testing.T) {
	if os.Getenv("INCUS_EXEC_MEASURE") != "1" {
		t.Skip("set INCUS_EXEC_MEASURE=1 to measure on the cluster rig (about a minute)")
	}
	rounds := 40
	if n, err := strconv.Atoi(os.Getenv("INCUS_EXEC_MEASURE_N")); err == nil && n > 0 {
		rounds = n
	}
	rig := readRig(t)
	root, err := New(rig)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(root.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	project := "lsc-" + hexOf(4)
	if err := root.CreateProject(ctx, project, map[string]string{"features.images": "false", "features.profiles": "false"}); err != nil {
		t.Fatal(err)
	}
	c := root.WithProject(project)
	t.Cleanup(func() { dropProject(t, root, project) })

	members := rigMembers(t)
	first, last := members[0], members[len(members)-1]
	guests := map[string]string{}
	for _, m := range []string{first, last} {
		name := "lsc-xm-" + hexOf(3) + "-" + m
		op, err := c.CreateInstance(ctx, InstancesPost{Name: name, Source: InstanceSource{Type: "image", Alias: "lightspeed-dev-guest"}, Start: true, Target: m})
		if err == nil {
			_, err = c.Wait(ctx, op)
		}
		if err != nil {
			t.Fatalf("launch on %s: %v", m, err)
		}
		guests[m] = name
	}
	// The client as a provider on the first member holds it: every URL,
	// the first preferred. A client of the last member's URL alone shows
	// what going straight to the holding member would save.
	direct := rig
	direct.URLs = []string{rig.URLs[len(rig.URLs)-1]}
	direct.Project = project
	dc, err := New(direct)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(dc.Close)

	cases := []struct {
		label string
		c     *Client
		guest string
	}{
		{"guest on " + first + " (the provider's member) via " + first, c, guests[first]},
		{"guest on " + last + " via " + first + " (the provider's path)", c, guests[last]},
		{"guest on " + last + " via " + last + " (straight to its member)", dc, guests[last]},
	}
	for _, k := range cases { // the daemon must listen before anything is timed
		waitAnswer(t, ctx, k.c, k.guest)
	}
	type sample struct {
		post, tls, seq, streams, answer, total []time.Duration
		ws                                     [len(execFDs)][]time.Duration
	}
	res := make([]sample, len(cases))
	for range rounds {
		for i, k := range cases {
			s := &res[i]
			// One after the other, as ExecStream dialled them before.
			t0 := time.Now()
			op, secrets, err := k.c.startExec(ctx, k.guest, []string{"nc", "127.0.0.1", "19091"})
			if err != nil {
				t.Fatal(err)
			}
			s.post = append(s.post, time.Since(t0))
			t1 := time.Now()
			raw, err := k.c.DialOperation(ctx, op)
			if err != nil {
				t.Fatal(err)
			}
			s.tls = append(s.tls, time.Since(t1))
			_ = raw.Close()
			var ws execStreams
			t2 := time.Now()
			for j, fd := range execFDs {
				tj := time.Now()
				conn, err := k.c.dialOperationWebsocket(ctx, op, secrets[fd], execBufferSizes[j].read, execBufferSizes[j].write)
				if err != nil {
					t.Fatal(err)
				}
				ws[j] = conn
				s.ws[j] = append(s.ws[j], time.Since(tj))
			}
			s.seq = append(s.seq, time.Since(t2))
			x := newExecConn(k.guest, ws)
			if _, err := firstByte(x); err != nil {
				t.Fatal(err)
			}
			_ = x.Close()

			// As ExecStream dials them now.
			t0 = time.Now()
			op, secrets, err = k.c.startExec(ctx, k.guest, []string{"nc", "127.0.0.1", "19091"})
			if err != nil {
				t.Fatal(err)
			}
			t2 = time.Now()
			ws, err = k.c.dialExecStreams(ctx, op, secrets)
			if err != nil {
				t.Fatal(err)
			}
			s.streams = append(s.streams, time.Since(t2))
			x = newExecConn(k.guest, ws)
			t3 := time.Now()
			if _, err := firstByte(x); err != nil {
				t.Fatal(err)
			}
			s.answer = append(s.answer, time.Since(t3))
			s.total = append(s.total, time.Since(t0))
			_ = x.Close()
		}
	}
	for i, k := range cases {
		s := res[i]
		t.Logf("%s, %d rounds, p50 / p95:", k.label, rounds)
		t.Logf("  POST /exec (operation and secrets)            %s", pq(s.post))
		t.Logf("  bare TCP+TLS connect to that endpoint         %s", pq(s.tls))
		t.Logf("  websocket control / 0 / 1 / 2, one by one     %s | %s | %s | %s", pq(s.ws[0]), pq(s.ws[1]), pq(s.ws[2]), pq(s.ws[3]))
		t.Logf("  the four one after the other                  %s", pq(s.seq))
		t.Logf("  the four through dialExecStreams              %s", pq(s.streams))
		t.Logf("  stream ready -> first byte of the daemon      %s", pq(s.answer))
		t.Logf("  ExecStream + first byte (a dial's cost)       %s", pq(s.total))
	}

	// A wake from paused: the unfreeze and the probe's exec at once. Incus
	// refuses an exec into a frozen instance, so the exec is asked again
	// (at once) until it is taken.
	for _, k := range cases[1:2] {
		var unfrozen, ready, answered []time.Duration
		var refused []int
		for range min(rounds, 10) {
			setState(t, ctx, c, k.guest, "freeze")
			t0 := time.Now()
			done := make(chan error, 1)
			var took time.Duration
			go func() {
				op, err := c.UpdateInstanceState(ctx, k.guest, InstanceStatePut{Action: "unfreeze"})
				if err == nil {
					_, err = c.Wait(ctx, op)
				}
				took = time.Since(t0)
				done <- err
			}()
			n := 0
			var x *ExecConn
			var err error
			for time.Since(t0) < 10*time.Second {
				if x, err = k.c.ExecStream(ctx, k.guest, []string{"nc", "127.0.0.1", "19091"}); err == nil {
					break
				}
				n++
			}
			if err == nil {
				ready = append(ready, time.Since(t0))
				if _, err = firstByte(x); err == nil {
					answered = append(answered, time.Since(t0))
				}
				_ = x.Close()
			}
			if uerr := <-done; uerr != nil {
				t.Fatalf("unfreeze: %v", uerr)
			}
			if err != nil {
				t.Fatalf("exec while unfreezing: %v", err)
			}
			unfrozen = append(unfrozen, took)
			refused = append(refused, n)
		}
		t.Logf("%s, unfreeze and exec at once, p50 / p95 from the unfreeze request:", k.label)
		t.Logf("  unfreeze operation done                       %s", pq(unfrozen))
		t.Logf("  ExecStream taken (execs refused before: %v)   %s", refused, pq(ready))
		t.Logf("  first byte of the daemon                      %s", pq(answered))
	}
}

// firstByte sends a WebSocket upgrade to the daemon and waits for the
// first byte of its answer.
func firstByte(x *ExecConn) (time.Duration, error) {
	start := time.Now()
	_ = x.SetDeadline(time.Now().Add(10 * time.Second))
	req := "GET / HTTP/1.1\r\nHost: guest\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" +
		"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
	if _, err := io.WriteString(x, req); err != nil {
		return 0, fmt.Errorf("write the upgrade: %w", err)
	}
	var b [1]byte
	if _, err := io.ReadFull(x, b[:]); err != nil {
		return 0, fmt.Errorf("read the answer: %w", err)
	}
	return time.Since(start), nil
}

func waitAnswer(t *testing.T, ctx context.Context, c *Client, guest string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		x, err := c.ExecStream(ctx, guest, []string{"nc", "127.0.0.1", "19091"})
		if err == nil {
			_, err = firstByte(x)
			_ = x.Close()
		}
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the daemon in %s does not answer: %v", guest, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func setState(t *testing.T, ctx context.Context, c *Client, name, action string) {
	t.Helper()
	op, err := c.UpdateInstanceState(ctx, name, InstanceStatePut{Action: StateAction(action), Timeout: -1})
	if err == nil {
		_, err = c.Wait(ctx, op)
	}
	if err != nil {
		t.Fatalf("%s %s: %v", action, name, err)
	}
}

func pq(d []time.Duration) string {
	if len(d) == 0 {
		return "-"
	}
	s := slices.Clone(d)
	slices.Sort(s)
	at := func(p float64) time.Duration { return s[min(len(s)-1, int(p*float64(len(s))))] }
	return fmt.Sprintf("%5.1f / %5.1f ms", float64(at(0.5))/1e6, float64(at(0.95))/1e6)
}

func hexOf(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// rigFile is the cluster rig's settings (internal/incustest reads the same).
func rigFile() string {
	if p := os.Getenv("INCUS_PROVIDER_TEST_CLUSTER_ENV"); p != "" {
		return p
	}
	return "/run/incus-provider-dev/cluster/cluster.env"
}

func rigVars(t *testing.T) map[string]string {
	t.Helper()
	raw, err := os.ReadFile(rigFile())
	if err != nil {
		t.Fatalf("no cluster rig (deploy/dev/incus-cluster-up.sh): %v", err)
	}
	vars := map[string]string{}
	for _, line := range strings.Split(string(raw), "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok {
			vars[k] = v
		}
	}
	return vars
}

func readRig(t *testing.T) Config {
	t.Helper()
	v := rigVars(t)
	return Config{URLs: strings.Split(v["INCUS_URL"], ","), ClientCert: v["INCUS_CLIENT_CERT"], ClientKey: v["INCUS_CLIENT_KEY"],
		ServerCert: v["INCUS_SERVER_CERT"], CallTimeout: 30 * time.Second}
}

func rigMembers(t *testing.T) []string {
	t.Helper()
	m := strings.Split(rigVars(t)["INCUS_CLUSTER_MEMBERS"], ",")
	if len(m) < 2 {
		t.Fatalf("%s lists %d members", rigFile(), len(m))
	}
	return m
}

// dropProject force-stops and deletes the project's instances, then the
// project, going round again for up to three minutes: other tests on the
// shared rig kill and restart members, and a member that is down holds its
// instances until it is back.
func dropProject(t *testing.T, root *Client, project string) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := root.WithProject(project)
	var err error
	for ctx.Err() == nil {
		insts, lerr := c.ListInstances(ctx)
		for _, inst := range insts {
			if inst.StatusCode != StatusStopped {
				if op, err := c.UpdateInstanceState(ctx, inst.Name, InstanceStatePut{Action: "stop", Force: true}); err == nil {
					_, _ = c.Wait(ctx, op)
				}
			}
			if op, err := c.DeleteInstance(ctx, inst.Name); err == nil {
				_, _ = c.Wait(ctx, op)
			}
		}
		if err = root.DeleteProject(ctx, project); err == nil || errors.Is(err, ErrNotFound) {
			return
		}
		err = errors.Join(lerr, err)
		t.Logf("cleanup: project %s not deleted yet: %v", project, err)
		select {
		case <-ctx.Done():
		case <-time.After(2 * time.Second):
		}
	}
	t.Errorf("cleanup: project %s left behind: %v", project, err)
}
