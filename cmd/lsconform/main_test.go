package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/conformance"
)

func noEnv(string) string { return "" }

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

// capture is a suite that records its Config and answers canned results.
type capture struct {
	cfg     conformance.Config
	results []conformance.Result
}

func (c *capture) run(_ context.Context, cfg conformance.Config) []conformance.Result {
	c.cfg = cfg
	return c.results
}

func TestPrintsOneLinePerCheckAndTheSummary(t *testing.T) {
	suite := &capture{results: []conformance.Result{
		{Name: "handshake", Passed: true, Detail: "server x"},
		{Name: "credential", Skipped: true, Detail: "no credential is configured"},
		{Name: "pure-get", Detail: "target/get created a target"},
	}}
	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"ws://127.0.0.1:9/control"}, noEnv, &out, &errOut, suite.run)
	if code != exitFailed {
		t.Errorf("exit %d, want %d", code, exitFailed)
	}
	want := "PASS handshake: server x\nSKIP credential: no credential is configured\nFAIL pure-get: target/get created a target\n1 passed, 1 failed, 1 skipped\n"
	if out.String() != want {
		t.Errorf("output:\n%s\nwant:\n%s", out.String(), want)
	}
}

func TestExitsZeroWhenNothingFailed(t *testing.T) {
	suite := &capture{results: []conformance.Result{{Name: "handshake", Passed: true}}}
	var out bytes.Buffer
	if code := run(context.Background(), []string{"-url", "ws://127.0.0.1:9/control"}, noEnv, &out, &out, suite.run); code != exitPassed {
		t.Errorf("exit %d, want 0; output %s", code, out.String())
	}
	if !strings.HasSuffix(out.String(), "1 passed, 0 failed\n") {
		t.Errorf("output %q lacks the closing line", out.String())
	}
}

func TestFlagsAndEnvironment(t *testing.T) {
	dir := t.TempDir()
	credFile := filepath.Join(dir, "credential")
	if err := os.WriteFile(credFile, []byte("  from-the-file\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := envOf(map[string]string{
		"LSCONFORM_URL":             "ws://127.0.0.1:9/control",
		"LSCONFORM_CREDENTIAL_FILE": credFile,
		"LSCONFORM_UNIVERSE":        "u-env",
		"LSCONFORM_TIMEOUT":         "3s",
		"LSCONFORM_ROUTE_BASE":      "ws://127.0.0.1:9/data",
	})
	suite := &capture{}
	var out bytes.Buffer
	code := run(context.Background(), []string{"-template", "small", "-universe", "u-flag", "-checks", "handshake, pure-get", "-settle-timeout", "90s", "-answer-bound", "4s", "-idle-grace", "12s"}, env, &out, &out, suite.run)
	if code != exitPassed {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	want := conformance.Config{
		URL: "ws://127.0.0.1:9/control", Credential: "from-the-file", TemplateID: "small", UniverseID: "u-flag",
		Timeout: 3 * time.Second, AnswerBound: 4 * time.Second, SettleTimeout: 90 * time.Second, PollInterval: conformance.DefaultPollInterval,
		IdleAfter: conformance.DefaultIdleAfter, IdleGrace: 12 * time.Second,
		UnixRequestPath: conformance.DefaultUnixRequestPath, RouteBase: "ws://127.0.0.1:9/data", Checks: []string{"handshake", "pure-get"},
	}
	if !reflect.DeepEqual(suite.cfg, want) {
		t.Errorf("config %+v, want %+v", suite.cfg, want)
	}
}

func TestCredentialValue(t *testing.T) {
	suite := &capture{}
	var out bytes.Buffer
	env := envOf(map[string]string{"LSCONFORM_CREDENTIAL": "from-the-env"})
	if code := run(context.Background(), []string{"unix:///run/incus-provider.sock"}, env, &out, &out, suite.run); code != exitPassed {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	if suite.cfg.Credential != "from-the-env" || suite.cfg.URL != "unix:///run/incus-provider.sock" {
		t.Errorf("config %+v", suite.cfg)
	}
}

func TestUsageErrors(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte("\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := map[string][]string{
		"no URL":                {},
		"two URLs":              {"ws://a/control", "ws://b/control"},
		"URL as flag and arg":   {"-url", "ws://a/control", "ws://b/control"},
		"an http URL":           {"http://127.0.0.1/control"},
		"a relative unix path":  {"unix://run/p.sock"},
		"both credentials":      {"-credential", "x", "-credential-file", empty, "ws://a/control"},
		"an empty credential":   {"-credential-file", empty, "ws://a/control"},
		"a missing file":        {"-credential-file", filepath.Join(dir, "none"), "ws://a/control"},
		"an unknown check":      {"-checks", "handshake,nope", "ws://a/control"},
		"a bad duration":        {"-timeout", "soon", "ws://a/control"},
		"a zero duration":       {"-poll", "0s", "ws://a/control"},
		"an unknown flag":       {"-fast", "ws://a/control"},
		"a CA file with no PEM": {"-ca-file", empty, "wss://a/control"},
		"a bad universe id":     {"-universe", "not ok", "ws://a/control"},
	}
	for name, args := range cases {
		suite := &capture{}
		var out, errOut bytes.Buffer
		if code := run(context.Background(), args, noEnv, &out, &errOut, suite.run); code != exitUsage {
			t.Errorf("%s: exit %d, want %d (stderr %s)", name, code, exitUsage, errOut.String())
		}
		if out.Len() != 0 {
			t.Errorf("%s: printed %q on stdout", name, out.String())
		}
	}
	var out, errOut bytes.Buffer
	if code := run(context.Background(), nil, envOf(map[string]string{"LSCONFORM_TIMEOUT": "later"}), &out, &errOut, (&capture{}).run); code != exitUsage {
		t.Errorf("a bad LSCONFORM_TIMEOUT: exit %d, want %d", code, exitUsage)
	}
}

func TestList(t *testing.T) {
	var out bytes.Buffer
	if code := run(context.Background(), []string{"-list"}, noEnv, &out, &out, (&capture{}).run); code != exitPassed {
		t.Fatalf("exit %d", code)
	}
	var names []string
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		name, rule, ok := strings.Cut(line, "\t")
		if !ok || !strings.HasPrefix(rule, "§") || !strings.Contains(rule, ": \"") {
			t.Errorf("-list line %q: want the name, a tab, and the contract's section and sentence", line)
		}
		names = append(names, name)
	}
	if !reflect.DeepEqual(names, conformance.CheckNames()) {
		t.Errorf("-list named %v, want %v", names, conformance.CheckNames())
	}
}

// The real suite against a loopback port nothing listens on: every check
// that needs the controller fails, and the exit status says so.
func TestRealSuiteAgainstNothing(t *testing.T) {
	var out, errOut bytes.Buffer
	code := run(context.Background(), []string{"-timeout", "2s", "ws://127.0.0.1:1/control"}, noEnv, &out, &errOut, conformance.Run)
	if code != exitFailed {
		t.Fatalf("exit %d, want %d; stdout %s stderr %s", code, exitFailed, out.String(), errOut.String())
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	want := fmt.Sprintf("0 passed, %d failed, 1 skipped", len(conformance.CheckNames())-1)
	if last := lines[len(lines)-1]; last != want {
		t.Errorf("closing line %q, want %q", last, want)
	}
	verdicts := 0
	for i, line := range lines {
		switch {
		case strings.HasPrefix(line, "FAIL "):
			verdicts++
			if i+1 >= len(lines) || !strings.HasPrefix(lines[i+1], "    contract §") {
				t.Errorf("the failure %q is not followed by the contract's rule it enforces", line)
			}
		case strings.HasPrefix(line, "PASS "), strings.HasPrefix(line, "SKIP "):
			verdicts++
		}
	}
	if verdicts != len(conformance.CheckNames()) {
		t.Errorf("%d verdicts, want one per check:\n%s", verdicts, out.String())
	}
}
