package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/lightspeed-dev/incus-provider/internal/devguest"
	"github.com/lightspeed-dev/incus-provider/internal/envd"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// TestGuestImageEndToEnd builds the guest image with deploy/guest/build-image.sh,
// launches it in a throwaway Incus project, reaches the daemon from the host
// through a proxy device (a host unix socket to the guest's loopback), and
// times a graceful stop and a start. It needs a running incusd and root, and
// runs only when LSENVD_DEV_E2E=1. Everything it creates is removed.
func TestGuestImageEndToEnd(t *testing.T) {
	if os.Getenv("LSENVD_DEV_E2E") != "1" {
		t.Skip("set LSENVD_DEV_E2E=1 to build the guest image and run it in Incus")
	}
	if _, err := exec.LookPath("incus"); err != nil {
		t.Skip("no incus command")
	}
	var suffix [3]byte
	_, _ = rand.Read(suffix[:])
	project := "lsenvd-e2e-" + hex.EncodeToString(suffix[:])
	alias := project
	instance := "guest"

	incus := func(args ...string) (string, error) {
		out, err := exec.Command("incus", append([]string{"--project", project}, args...)...).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	timed := func(what string, args ...string) time.Duration {
		t.Helper()
		start := time.Now()
		if out, err := incus(args...); err != nil {
			t.Fatalf("incus %s: %v: %s", strings.Join(args, " "), err, out)
		}
		d := time.Since(start)
		t.Logf("%s: %v", what, d.Round(time.Millisecond))
		return d
	}

	if out, err := exec.Command("incus", "project", "create", project, "-c", "features.images=false", "-c", "features.profiles=false").CombinedOutput(); err != nil {
		t.Fatalf("create project: %v: %s", err, out)
	}
	var fingerprint string
	t.Cleanup(func() {
		_, _ = incus("delete", "--force", instance)
		if fingerprint != "" {
			_, _ = incus("image", "delete", fingerprint)
		}
		if out, err := exec.Command("incus", "project", "delete", project).CombinedOutput(); err != nil {
			t.Errorf("delete project %s: %v: %s", project, err, out)
		}
	})

	build := func() string {
		t.Helper()
		start := time.Now()
		cmd := exec.Command("../../deploy/guest/build-image.sh")
		cmd.Env = append(os.Environ(), "GUEST_IMAGE_ALIAS="+alias, "INCUS_PROJECT="+project)
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("build-image.sh: %v\n%s", err, stderr.String())
		}
		fields := strings.Fields(string(out))
		if len(fields) != 2 || fields[0] != alias || len(fields[1]) != 64 || strings.Count(string(out), "\n") != 1 {
			t.Fatalf("build-image.sh printed %q", out)
		}
		t.Logf("build-image.sh: %v", time.Since(start).Round(time.Millisecond))
		return fields[1]
	}
	fingerprint = build()
	if again := build(); again != fingerprint {
		t.Fatalf("an unchanged re-run imported a new image %s", again)
	}

	timed("incus launch", "launch", alias, instance)
	sock := filepath.Join(t.TempDir(), "envd.sock")
	timed("add proxy device", "config", "device", "add", instance, "envd", "proxy",
		"listen=unix:"+sock, "connect=tcp:127.0.0.1:19091", "bind=host")

	dialGuest := func() net.Conn {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			conn, err := net.Dial("unix", sock)
			if err == nil {
				return conn
			}
			if time.Now().After(deadline) {
				t.Fatalf("the proxy socket never answered: %v", err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// handshake retries until the daemon behind the proxy answers.
	handshake := func() (*envd.Session, time.Duration) {
		t.Helper()
		start := time.Now()
		for {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			s, err := envd.Handshake(ctx, dialGuest(), envd.ClientInfo{Name: "lsenvd-dev-e2e"})
			cancel()
			if err == nil {
				return s, time.Since(start)
			}
			if time.Since(start) > 10*time.Second {
				t.Fatalf("handshake: %v", err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	s, took := handshake()
	first := s.Initialized()
	t.Logf("handshake through the proxy: %v; serverInfo %+v, instance %s", took.Round(time.Millisecond), first.ServerInfo, first.DaemonInstanceID)
	t.Logf("initialize: %s", initializeJSON(first))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	idle, err := s.GetIdle(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("env/getIdle: %+v", idle)

	// A process and a file, over a plain JSON-RPC client on a second connection.
	rpc := rawClient(t, dialGuest())
	var started devguest.ProcessStartResult
	if err := rpc.Call(ctx, "process/start", map[string]any{"processId": "e2e", "argv": []string{"sh", "-c", "echo hello from $(uname -s); exit 4"}}, &started); err != nil {
		t.Fatal(err)
	}
	var read devguest.ProcessReadResult
	if err := rpc.Call(ctx, "process/read", map[string]any{"processId": "e2e", "maxBytes": 4096, "waitMs": 10000, "returnOn": "exit"}, &read); err != nil {
		t.Fatal(err)
	}
	if read.State != "exited" || read.Exit == nil || read.Exit.Code == nil || *read.Exit.Code != 4 || len(read.Chunks) != 1 {
		t.Fatalf("process/read %+v", read)
	}
	out, _ := base64.StdEncoding.DecodeString(read.Chunks[0].Data)
	if string(out) != "hello from Linux\n" {
		t.Fatalf("output %q", out)
	}
	var written devguest.WriteFileResult
	if err := rpc.Call(ctx, "fs/writeFile", map[string]any{"path": "/root/e2e.txt", "data": base64.StdEncoding.EncodeToString([]byte("e2e"))}, &written); err != nil {
		t.Fatal(err)
	}
	if out, err := incus("exec", instance, "--", "cat", "/root/e2e.txt"); err != nil || out != "e2e" {
		t.Fatalf("the guest holds %q (%v)", out, err)
	}
	if idle2, err := s.GetIdle(ctx); err != nil || idle2.IdleForMs > idle.IdleForMs+5000 || idle2.Counts["retainedProcessCount"] != 1 {
		t.Fatalf("env/getIdle after use: %+v %v", idle2, err)
	}
	// Orphans are reaped by init: a background child of an exited shell leaves no zombie.
	if out, err := incus("exec", instance, "--", "sh", "-c", "(sleep 0.1 &); sleep 0.5; ps -o stat | grep -c '^Z' || true"); err != nil || out != "0" {
		t.Fatalf("zombies in the guest: %q (%v)", out, err)
	}

	stop := timed("incus stop (graceful)", "stop", instance)
	select {
	case <-s.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the session did not end when the guest stopped")
	}
	_ = rpc.Close()
	_ = s.Close()
	if log, err := incus("console", instance, "--show-log"); err == nil {
		if !strings.Contains(log, "init: SIGPWR: stopping") || !strings.Contains(log, "lsenvd-dev: stopped") {
			t.Errorf("the console log does not show a SIGPWR stop:\n%s", log)
		}
	}
	if stop > 5*time.Second {
		t.Errorf("a graceful stop took %v: init did not handle SIGPWR", stop)
	}

	timed("incus start", "start", instance)
	s2, took := handshake()
	defer s2.Close()
	t.Logf("daemon answering after start: %v", took.Round(time.Millisecond))
	if s2.Initialized().DaemonInstanceID == first.DaemonInstanceID {
		t.Fatal("the daemonInstanceId survived a restart")
	}
	// The init restarts a daemon that dies.
	if out, err := incus("exec", instance, "--", "sh", "-c", "kill -9 $(pidof lsenvd-dev)"); err != nil {
		t.Fatalf("kill the daemon: %v %s", err, out)
	}
	select {
	case <-s2.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the session outlived the daemon")
	}
	s3, took := handshake()
	defer s3.Close()
	t.Logf("daemon back after kill -9: %v", took.Round(time.Millisecond))
	timed("incus stop (graceful, second)", "stop", instance)
}

func rawClient(t *testing.T, conn net.Conn) *jsonrpc.Client {
	t.Helper()
	dialer := websocket.Dialer{NetDialContext: func(context.Context, string, string) (net.Conn, error) { return conn, nil }}
	ws, _, err := dialer.Dial("ws://guest/", nil)
	if err != nil {
		t.Fatal(err)
	}
	c := jsonrpc.NewClient(ws)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Call(ctx, "initialize", map[string]any{"protocolVersion": 5, "clientInfo": map[string]any{"name": "lsenvd-dev-e2e"}}, nil); err != nil {
		t.Fatal(err)
	}
	return c
}

func initializeJSON(r envd.InitializeResult) string {
	var b strings.Builder
	b.WriteString("{")
	first := true
	for _, k := range []string{"protocolVersion", "plane", "serverInfo", "daemonInstanceId", "capabilities", "limits", "defaultCwd", "homeDirectory", "platform"} {
		if v, ok := r.Members[k]; ok {
			if !first {
				b.WriteString(",")
			}
			first = false
			b.WriteString(`"` + k + `":` + string(v))
		}
	}
	b.WriteString("}")
	return b.String()
}
