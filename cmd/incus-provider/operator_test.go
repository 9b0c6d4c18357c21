package main

import (
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/targets"
)

// TestOperatorCommands: with the provider's own settings, targets list and
// show read what Incus records of each target (a table, or JSON), by id or
// by owner; targets close asks the running provider, which closes it; an
// unknown target is said to be so.
func TestOperatorCommands(t *testing.T) {
	c := startProvider(t)
	ctl := c.controller(t)
	owners := []controller.Owner{{UniverseID: "u-ops", EnvironmentID: "env-a"}, {UniverseID: "u-ops", EnvironmentID: "env-b"}}
	call := targetCaller(ctl)
	ids := map[string]string{}
	for _, o := range owners {
		if _, err := call("target/create", controller.CreateParams{Owner: o, TemplateID: "dev-small"}); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(90 * time.Second)
		for {
			obs, err := call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: o}})
			if err == nil && obs.Phase == controller.PhaseActive && obs.Power == controller.PowerRunning {
				ids[o.EnvironmentID] = obs.TargetID
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%v never active: %+v, %v", o, obs, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	if _, err := call("target/setPower", controller.SetPowerParams{Target: controller.TargetRef{Owner: owners[1]}, Power: controller.PowerPaused}); err != nil {
		t.Fatal(err)
	}

	r := runBinary(t, c.env, "targets", "list")
	if r.code != 0 {
		t.Fatalf("list: exit %d: %s", r.code, r.stderr)
	}
	for _, o := range owners {
		if !strings.Contains(r.stdout, ids[o.EnvironmentID]+"  u-ops/"+o.EnvironmentID+"  dev-small  active  ") {
			t.Errorf("list has no row for %v:\n%s", o, r.stdout)
		}
	}
	t.Logf("targets list:\n%s", r.stdout)
	if !strings.Contains(r.stdout, "2 targets in project ") {
		t.Errorf("list does not count two targets:\n%s", r.stdout)
	}

	r = runBinary(t, c.env, "targets", "list", "--json")
	var views []targets.View
	if err := json.Unmarshal([]byte(r.stdout), &views); err != nil || r.code != 0 || len(views) != 2 {
		t.Fatalf("list --json: exit %d, %d views, %v:\n%s", r.code, len(views), err, r.stdout)
	}

	r = runBinary(t, c.env, "targets", "show", "u-ops/env-b", "--json")
	var v targets.View
	if err := json.Unmarshal([]byte(r.stdout), &v); err != nil || r.code != 0 {
		t.Fatalf("show --json: exit %d, %v:\n%s%s", r.code, err, r.stdout, r.stderr)
	}
	if v.TargetID != ids["env-b"] || v.Owner != owners[1] || v.Intent != "paused" || v.IntentBy == "" || v.CreatedAt.IsZero() {
		t.Errorf("show by owner: %+v", v)
	}
	r = runBinary(t, c.env, "targets", "show", ids["env-a"])
	for _, want := range []string{"target +" + ids["env-a"], "owner +u-ops/env-a", "phase +active", "power +running"} {
		if r.code != 0 || !regexp.MustCompile("(?m)^"+want+"$").MatchString(r.stdout) {
			t.Errorf("show by id lacks %q: exit %d:\n%s%s", want, r.code, r.stdout, r.stderr)
		}
	}

	r = runBinary(t, c.env, "targets", "close", ids["env-a"])
	if r.code != 0 || !strings.Contains(r.stdout, ids["env-a"]+": closed") {
		t.Fatalf("close: exit %d:\n%s%s", r.code, r.stdout, r.stderr)
	}
	obs, err := call("target/get", controller.TargetParams{Target: controller.TargetRef{Owner: owners[0], TargetID: ids["env-a"]}})
	if err == nil || !strings.Contains(err.Error(), "notFound") {
		t.Errorf("the closed target after the close: %+v, %v", obs, err)
	}
	r = runBinary(t, c.env, "targets", "list")
	if r.code != 0 || !strings.Contains(r.stdout, "1 targets in project ") || strings.Contains(r.stdout, ids["env-a"]) {
		t.Errorf("list after the close: exit %d:\n%s", r.code, r.stdout)
	}

	r = runBinary(t, c.env, "targets", "show", "u-ops/env-never")
	if r.code != exitFailed || !strings.Contains(r.stderr, "holds no target u-ops/env-never") {
		t.Errorf("an unknown owner: exit %d: %s", r.code, r.stderr)
	}
	// The audit trail (on by default) has the runtime's create and the
	// operator's close, each naming owner, target and outcome.
	c.logMu.Lock()
	logged := c.log.String()
	c.logMu.Unlock()
	found := map[string]bool{}
	for line := range strings.SplitSeq(logged, "\n") {
		var rec map[string]any
		if json.Unmarshal([]byte(line), &rec) != nil || rec["logger"] != "audit" || rec["universe"] != "u-ops" || rec["environment"] != "env-a" {
			continue
		}
		switch {
		case rec["method"] == "target/create" && rec["outcome"] == "ok":
			found["create"] = true
		case rec["method"] == "target/close" && rec["target"] == ids["env-a"] && rec["outcome"] == "ok":
			found["close"] = true
		}
	}
	if !found["create"] || !found["close"] {
		t.Errorf("the audit trail lacks the create or the close of u-ops/env-a: %v", found)
	}
	r = runBinary(t, c.env, "targets", "frobnicate")
	if r.code != exitBadSetting || !strings.Contains(r.stderr, "usage: incus-provider targets list") {
		t.Errorf("an unknown command: exit %d: %s", r.code, r.stderr)
	}
}
