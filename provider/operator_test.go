package provider_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// TestClusterOperatorSeesEveryPhase: `incus-provider targets list` and
// `targets show`, run with a replica's settings as an operator on call
// would, against the cluster rig holding a target in every phase the
// provider observes: provisioning, active (running, paused, stopped),
// closing, failed and unknown. Each phase comes about the way it does in
// production, then holds still for the commands: a template whose
// instances cannot start fails its target; an operator's delete protection
// holds a close; both replicas killed right after a create's answer leave
// a target that was never booted; a member's incusd killed leaves its
// target unknown. The commands read Incus only: no replica is running when
// they do.
func TestClusterOperatorSeesEveryPhase(t *testing.T) {
	cl := incustest.Cluster(t)
	// A profile with a NIC on a bridge that does not exist: Incus creates
	// the instance and refuses every start of it, in the device's start,
	// before anything runs. (A disk without its source is refused at the
	// create; an init that does not exist sometimes fails the start and
	// sometimes only stops the container after it, as CI found.) Profiles
	// are the cluster's default project's (the test project shares them).
	profile := "lsops-nostart-" + peerSecret(t)[:8]
	cli := func(args ...string) {
		t.Helper()
		cmd := exec.Command("incus", args...)
		cmd.Env = append(os.Environ(), "INCUS_DIR="+filepath.Dir(cl.Sockets[0]),
			"INCUS_CONF="+filepath.Join(filepath.Dir(cl.Config.ClientCert), "client"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("incus %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	cli("profile", "create", profile)
	// Registered before the rig's project, so removed after it.
	t.Cleanup(func() { cli("profile", "delete", profile) })
	cli("profile", "device", "add", profile, "nowhere", "nic", "nictype=bridged", "parent=lsnobridge0", "name=eth9")
	r := newLBRigOpts(t, lbOptions{templates: `  - templateId: cannot-start
    displayName: guest whose every start Incus refuses
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    placement: lsm1
    profiles: [default, ` + profile + `]
`})

	at := func(env string) controller.Owner {
		return controller.Owner{UniverseID: "u-opsphases", EnvironmentID: env}
	}
	power := func(env string, p controller.Power) {
		t.Helper()
		if _, err := r.call("target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: at(env)}, Power: p}, 30*time.Second); err != nil {
			t.Fatal(err)
		}
		r.until(at(env), "at "+string(p), 60*time.Second, func(o controller.Observation) bool {
			return o.Phase == controller.PhaseActive && o.Power == p && o.Message == ""
		})
	}
	r.runningRoute(at("running"), "on-lsm1")
	r.runningRoute(at("paused"), "on-lsm2")
	power("paused", controller.PowerPaused)
	r.runningRoute(at("stopped"), "on-lsm1")
	power("stopped", controller.PowerStopped)
	r.runningRoute(at("unknown"), "on-lsm3")
	if _, err := r.call("target/create", controller.CreateParams{Owner: at("failed"), TemplateID: "cannot-start"}, 60*time.Second); err != nil {
		t.Fatal(err)
	}
	r.until(at("failed"), "failed", 90*time.Second, func(o controller.Observation) bool { return o.Phase == controller.PhaseFailed })

	// The operator protects the instance from deletion; the close is
	// recorded, and the provider stops the instance and is refused its
	// delete, until the protection goes.
	closing := r.runningRoute(at("closing"), "on-lsm2").TargetID
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := r.client.PatchInstanceConfig(ctx, closing, map[string]string{"security.protection.delete": "true"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := r.client.PatchInstanceConfig(ctx, closing, map[string]string{"security.protection.delete": "false"}); err != nil {
			t.Errorf("lifting the delete protection: %v", err)
		}
	})
	if _, err := r.call("target/close", controller.TargetParams{Target: controller.TargetRef{Owner: at("closing")}}, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	r.until(at("closing"), "closing", 30*time.Second, func(o controller.Observation) bool { return o.Phase == controller.PhaseClosing })

	// A create answered, and both replicas killed before anything started
	// the instance. Its template's starts fail, so nothing boots it; were
	// the kills later than three failed starts (the provider then records
	// the failure), another owner is tried.
	var provisioning controller.Owner
	for attempt := 1; provisioning == (controller.Owner{}); attempt++ {
		o := at("provisioning-" + string(rune('0'+attempt)))
		if _, err := r.call("target/create", controller.CreateParams{Owner: o, TemplateID: "cannot-start"}, 60*time.Second); err != nil {
			t.Fatal(err)
		}
		r.stop(0, syscall.SIGKILL)
		r.stop(1, syscall.SIGKILL)
		inst, _, err := r.client.GetInstance(ctx, targets.Name(o))
		if err != nil {
			t.Fatalf("the instance of a create answered before the kills: %v", err)
		}
		if v, ok := targets.Inspect(inst); ok && v.Observation.Phase == controller.PhaseProvisioning {
			provisioning = o
			break
		}
		if attempt == 3 {
			t.Fatal("three creates in a row were past provisioning before both replicas were killed")
		}
		r.start(0)
		r.start(1)
		r.awaitUp(0)
		r.awaitUp(1)
	}

	memberCtl(t, "kill", "lsm3")
	t.Cleanup(func() { memberCtl(t, "start", "lsm3") })

	operator := func(args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(r.bin, args...)
		cmd.Env = r.replicaEnv(0)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		code := 0
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatalf("incus-provider %s: %v", strings.Join(args, " "), err)
		}
		return stdout.String(), stderr.String(), code
	}
	want := map[string]struct {
		phase controller.Phase
		power controller.Power
	}{
		"running":                  {controller.PhaseActive, controller.PowerRunning},
		"paused":                   {controller.PhaseActive, controller.PowerPaused},
		"stopped":                  {controller.PhaseActive, controller.PowerStopped},
		"failed":                   {controller.PhaseFailed, ""},
		"closing":                  {controller.PhaseClosing, ""},
		"unknown":                  {controller.PhaseUnknown, ""},
		provisioning.EnvironmentID: {controller.PhaseProvisioning, ""},
	}
	out, errOut, code := operator("targets", "list", "--json")
	if code != 0 {
		t.Fatalf("targets list --json: exit %d: %s", code, errOut)
	}
	var views []targets.View
	if err := json.Unmarshal([]byte(out), &views); err != nil {
		t.Fatalf("targets list --json: %v:\n%s", err, out)
	}
	byID := map[string]targets.View{}
	for _, v := range views {
		byID[v.TargetID] = v
	}
	for env, w := range want {
		v, ok := byID[targets.Name(at(env))]
		if !ok {
			t.Errorf("targets list has no %s target (%s):\n%s", env, targets.Name(at(env)), out)
			continue
		}
		if v.Observation.Phase != w.phase || v.Observation.Power != w.power {
			t.Errorf("the %s target is listed %s/%s, want %s/%s: %+v", env, v.Observation.Phase, v.Observation.Power, w.phase, w.power, v)
		}
	}
	if u := byID[targets.Name(at("unknown"))]; !strings.Contains(u.Observation.Message, "lsm3") {
		t.Errorf("the unknown target's message does not name its member: %q", u.Observation.Message)
	}
	if c := byID[closing]; c.ClosingFrom.IsZero() {
		t.Errorf("the closing target's view says not since when: %+v", c)
	}

	table, errOut, code := operator("targets", "list")
	if code != 0 {
		t.Fatalf("targets list: exit %d: %s", code, errOut)
	}
	t.Logf("targets list, with a member down and no replica running:\n%s", table)
	for env, w := range want {
		row := regexp.MustCompile("(?m)^" + targets.Name(at(env)) + " .* " + string(w.phase) + "\\b")
		if !row.MatchString(table) {
			t.Errorf("the table has no row for the %s target in phase %s", env, w.phase)
		}
	}

	for env, w := range map[string]controller.Phase{"unknown": controller.PhaseUnknown, provisioning.EnvironmentID: controller.PhaseProvisioning, "closing": controller.PhaseClosing} {
		out, errOut, code := operator("targets", "show", at(env).UniverseID+"/"+env)
		if code != 0 || !regexp.MustCompile(`(?m)^phase +`+string(w)+`$`).MatchString(out) {
			t.Errorf("targets show of the %s target: exit %d:\n%s%s", env, code, out, errOut)
		}
	}
}
