//go:build imagetest

package provider_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/routes"
)

// EnvDebianImage names the image alias of deploy/guest/build-debian-image.sh
// for this test, which `make test-image` builds and runs (build tag
// imagetest: it is not part of `make test`).
const EnvDebianImage = "INCUS_PROVIDER_TEST_DEBIAN_IMAGE"

const debianTemplates = `templates:
  - templateId: debian
    displayName: production-shaped guest (Debian, systemd)
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
`

// The production-shaped guest image, through the provider: targets from it
// become active, their daemons answer through data routes, each has its
// own identity (machine id, daemonInstanceId), systemd is PID 1 with the
// daemon's unit active, a graceful stop ends cleanly without force, and the
// targets wake from stopped and from paused.
func TestDebianGuestImage(t *testing.T) {
	alias := os.Getenv(EnvDebianImage)
	if alias == "" {
		t.Fatalf("%s is not set: run make test-image, which builds the image first", EnvDebianImage)
	}
	r := newRig(t, rigOptions{templates: debianTemplates, image: alias})

	// Two owners at once, from an image of tens of thousands of files.
	envs := []string{"deb-a", "deb-b"}
	routesOf := make([]routes.Route, len(envs))
	var wg sync.WaitGroup
	start := time.Now()
	errs := make(chan error, len(envs))
	for i, env := range envs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			owner := controller.Owner{UniverseID: "u-provider", EnvironmentID: env}
			if _, err := r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: "debian"}); err != nil {
				errs <- fmt.Errorf("%s: %w", env, err)
				return
			}
			o := r.until(owner, "active and running", 5*time.Minute, func(o controller.Observation) bool {
				return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning && o.Message == ""
			})
			routesOf[i] = routes.Route{Owner: owner, TargetID: o.TargetID}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("two targets active %v after their creates", time.Since(start).Round(time.Millisecond))
	defer r.closeAll(routesOf[0].Owner, routesOf[1].Owner)

	ids := map[string]bool{}
	machines := map[string]bool{}
	for _, route := range routesOf {
		id := r.daemonID(route)
		if ids[id] {
			t.Fatalf("two targets answer with one daemonInstanceId %q: a daemon identity was cloned", id)
		}
		ids[id] = true
		if comm := guestExec(t, r, route.TargetID, "cat", "/proc/1/comm"); comm != "systemd" {
			t.Fatalf("PID 1 of %s is %q, want systemd", route.TargetID, comm)
		}
		if state := guestExec(t, r, route.TargetID, "systemctl", "is-active", "lightspeed-envd.service"); state != "active" {
			t.Fatalf("lightspeed-envd.service on %s is %q", route.TargetID, state)
		}
		mid := guestExec(t, r, route.TargetID, "cat", "/etc/machine-id")
		if len(mid) != 32 || machines[mid] {
			t.Fatalf("machine id of %s is %q (seen before: %v): each instance must write its own", route.TargetID, mid, machines[mid])
		}
		machines[mid] = true
		if out := guestExec(t, r, route.TargetID, "sh", "-c", "ss -ltnH 2>/dev/null || cat /proc/net/tcp"); out == "" {
			t.Fatalf("no listening sockets readable on %s", route.TargetID)
		}
	}

	// A clean stop, asked of Incus without force and with a bound: systemd
	// must power off on the signal Incus sends, or the stop times out.
	target := routesOf[0].TargetID
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	stopStart := time.Now()
	op, err := r.client.UpdateInstanceState(ctx, target, incus.InstanceStatePut{Action: "stop", Timeout: 30})
	if err == nil {
		_, err = r.client.Wait(ctx, op)
	}
	if err != nil {
		t.Fatalf("a graceful stop of %s failed (systemd did not power off on Incus's signal within 30 s?): %v", target, err)
	}
	t.Logf("graceful stop of a systemd guest: %v", time.Since(stopStart).Round(time.Millisecond))

	// That stop was not asked of the provider: it brings the target back
	// to the power recorded for it.
	r.until(routesOf[0].Owner, "running again", time.Minute, func(o controller.Observation) bool {
		return o.Power == controller.PowerRunning && o.Message == ""
	})

	// It wakes from stopped through a route dial, and from paused.
	r.power(routesOf[0], controller.PowerStopped)
	wakeStart := time.Now()
	ws := r.mustUpgrade(routesOf[0])
	_ = ws.Close()
	t.Logf("stopped → upgraded: %v", time.Since(wakeStart).Round(time.Millisecond))
	r.power(routesOf[1], controller.PowerPaused)
	wakeStart = time.Now()
	ws = r.mustUpgrade(routesOf[1])
	_ = ws.Close()
	t.Logf("paused → upgraded: %v", time.Since(wakeStart).Round(time.Millisecond))
}

// guestExec runs a command in the guest with the incus client and returns
// its trimmed output.
func guestExec(t *testing.T, r *rig, name string, argv ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	args := append([]string{"--project", r.client.Project(), "exec", name, "--"}, argv...)
	out, err := exec.CommandContext(ctx, "incus", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("incus %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}
