package main

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/incusfake"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// TestCheckRightsInTheProject: the rights check passes where Incus lets
// the client edit the project, changing nothing (the project's ETag is
// the same after), and names the missing right where Incus refuses it:
// the environment's to fix (Incus's trust store), exit 1.
func TestCheckRightsInTheProject(t *testing.T) {
	fake, err := incusfake.Start(incusfake.Config{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fake.Close() })
	fake.SeedProject("p", "the provider's", map[string]string{"user.kept": "1"})
	client, err := fake.Client("p")
	if err != nil {
		t.Fatal(err)
	}
	cfg := config{IncusProject: "p", IncusSocket: fake.Socket()}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, before, _ := fake.Project("p")

	var out bytes.Buffer
	k := &checker{out: &out}
	k.checkRights(ctx, client, cfg)
	if k.code != 0 || !strings.HasPrefix(out.String(), "ok      project p: 0 instances readable; its config writable") {
		t.Fatalf("exit %d:\n%s", k.code, out.String())
	}
	if config, after, _ := fake.Project("p"); after != before || config["user.kept"] != "1" {
		t.Fatalf("the check changed the project: ETag %s -> %s, config %v", before, after, config)
	}

	fake.Inject(incusfake.Fault{Kind: incusfake.Refuse, Method: http.MethodPut, Path: "/1.0/projects/p", Status: http.StatusForbidden, Message: "not authorized"})
	out.Reset()
	k = &checker{out: &out}
	k.checkRights(ctx, client, cfg)
	if k.code != exitFailed || !strings.Contains(out.String(), "FAILED  INCUS_PROJECT=\"p\": this client may not edit its config") {
		t.Fatalf("a refused edit: exit %d:\n%s", k.code, out.String())
	}
}

// TestCheckWithoutServing: `incus-provider check` against the real Incus
// reports each part and exits 0 for a configuration that holds; a listener
// address already taken is the environment's (exit 1), a refused setting
// the configuration's (exit 2); and nothing is left listening or created.
func TestCheckWithoutServing(t *testing.T) {
	client := incustest.Client(t)
	good, err := filepath.Abs("../../deploy/templates.dev.yaml")
	if err != nil {
		t.Fatal(err)
	}
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	free := freePort(t)
	base := []string{"PROVIDER_TEMPLATES=" + good, "INCUS_SOCKET=" + incustest.Socket(), "INCUS_PROJECT=" + client.Project(),
		"PROVIDER_METRICS_LISTEN=off", "PROVIDER_INGRESS_LISTEN=off"}

	r := runBinary(t, append(base, "PROVIDER_LISTEN="+free), "check")
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("exit %d, stderr %q:\n%s", r.code, r.stderr, r.stdout)
	}
	for _, want := range []string{"ok      settings: controller ws://" + free + "/control", "ok      incus: INCUS_SOCKET=", "ok      project " + client.Project() + ": ",
		"ok      templates: 3 from " + good, "ok      guest dialer: ", "ok      PROVIDER_LISTEN=" + free + ": free", "the configuration holds"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("the report lacks %q:\n%s", want, r.stdout)
		}
	}
	if c, err := net.DialTimeout("tcp", free, time.Second); err == nil {
		_ = c.Close()
		t.Errorf("something listens on %s after the check", free)
	}
	if list, err := client.ListInstances(t.Context()); err != nil || len(list) != 0 {
		t.Errorf("the check left %d instances in the project (%v)", len(list), err)
	}

	r = runBinary(t, append(base, "PROVIDER_LISTEN="+taken.Addr().String()), "check")
	if r.code != exitFailed || !strings.Contains(r.stdout, "FAILED  PROVIDER_LISTEN=\""+taken.Addr().String()+"\" cannot be bound") ||
		!strings.Contains(r.stdout, "ok      templates: 3") {
		t.Errorf("a taken address: exit %d:\n%s", r.code, r.stdout)
	}

	r = runBinary(t, append(base, "PROVIDER_LISTEN=0.0.0.0:1", "PROVIDER_GRACEFUL_STOP=0s"), "check")
	if r.code != exitBadSetting || strings.Count(r.stdout, "FAILED  ") != 2 || !strings.Contains(r.stdout, "skipped Incus") {
		t.Errorf("refused settings: exit %d:\n%s", r.code, r.stdout)
	}

	// The warm memory ceiling: dev-small's pool of 2 at 256 MiB fits 1 GiB,
	// not 256 MiB; a pool without memoryBytes cannot be counted.
	r = runBinary(t, append(base, "PROVIDER_LISTEN="+free, "PROVIDER_WARM_MEMORY_MAX=1GiB"), "check")
	if r.code != 0 {
		t.Errorf("a ceiling the pools fit: exit %d:\n%s", r.code, r.stdout)
	}
	r = runBinary(t, append(base, "PROVIDER_LISTEN="+free, "PROVIDER_WARM_MEMORY_MAX=256MiB"), "check")
	if r.code != exitBadSetting || !strings.Contains(r.stdout, `template "dev-small"'s minimum pool (warm 2 of 268435456 bytes) holds more than PROVIDER_WARM_MEMORY_MAX (256MiB)`) {
		t.Errorf("a ceiling below a minimum pool: exit %d:\n%s", r.code, r.stdout)
	}
	uncounted := filepath.Join(t.TempDir(), "templates.yaml")
	if err := os.WriteFile(uncounted, []byte("templates:\n  - templateId: nomem\n    displayName: no memory stated\n    powerStates: [running]\n    imageAlias: "+
		incustest.DefaultImage+"\n    warm: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r = runBinary(t, append(base, "PROVIDER_LISTEN="+free, "PROVIDER_WARM_MEMORY_MAX=1GiB", "PROVIDER_TEMPLATES="+uncounted), "check")
	if r.code != exitBadSetting || !strings.Contains(r.stdout, `template "nomem" keeps a warm pool and states no resources.memoryBytes`) {
		t.Errorf("a pool the ceiling cannot count: exit %d:\n%s", r.code, r.stdout)
	}

	r = runBinary(t, append(base, "PROVIDER_LISTEN="+free, "INCUS_PROJECT=ops-no-such-project"), "check")
	if r.code != exitBadSetting || !strings.Contains(r.stdout, "no project") || !strings.Contains(r.stdout, "skipped the rights") {
		t.Errorf("a missing project: exit %d:\n%s", r.code, r.stdout)
	}
	r = runBinary(t, []string{"PROVIDER_TEMPLATES=" + good, "INCUS_SOCKET=/nonexistent/incus.sock", "PROVIDER_LISTEN=" + free,
		"PROVIDER_METRICS_LISTEN=off", "PROVIDER_INGRESS_LISTEN=off"}, "check")
	if r.code != exitFailed || !strings.Contains(r.stdout, "FAILED  incus is not reachable") || !strings.Contains(r.stdout, "ok      PROVIDER_LISTEN=") {
		t.Errorf("no Incus: exit %d:\n%s", r.code, r.stdout)
	}
}
