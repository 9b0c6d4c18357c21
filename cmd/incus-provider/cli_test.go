package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// ran is one finished run of the binary.
type ran struct {
	stdout, stderr string
	code           int
}

// runBinary runs the built provider with exactly env (and PATH) and args,
// and waits for it to exit: every case here must end by itself.
func runBinary(t *testing.T, env []string, args ...string) ran {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, providerBinary(t), args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("%v %v did not exit within 60 s (it serves?): %s", env, args, errOut.String())
	}
	var ee *exec.ExitError
	code := 0
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return ran{stdout: out.String(), stderr: errOut.String(), code: code}
}

// declaredVariables reads, from this package's source rather than through
// the code under test, every environment variable it reads: each env tag
// of config.go (with its default) and every literal Getenv/LookupEnv.
func declaredVariables(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	tag := regexp.MustCompile(`env:"([A-Z0-9_]+)"(?:\s+envDefault:"([^"]*)")?`)
	call := regexp.MustCompile(`(?:Getenv|LookupEnv)\("([A-Z0-9_]+)"\)`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range tag.FindAllStringSubmatch(string(src), -1) {
			out[m[1]] = m[2]
		}
		for _, m := range call.FindAllStringSubmatch(string(src), -1) {
			if _, ok := out[m[1]]; !ok {
				out[m[1]] = ""
			}
		}
	}
	if len(out) < 20 {
		t.Fatalf("found only %d variables in the source; update this test", len(out))
	}
	return out
}

func TestHelpIsTheConfigurationReference(t *testing.T) {
	for _, arg := range []string{"--help", "-h"} {
		// A listener that would be taken if it served: it must not.
		r := runBinary(t, []string{"PROVIDER_LISTEN=127.0.0.1:1", "PROVIDER_TEMPLATES=/nonexistent"}, arg)
		if r.code != 0 || r.stderr != "" {
			t.Fatalf("%s: exit %d, stderr %q", arg, r.code, r.stderr)
		}
		blocks := map[string]string{}
		for _, b := range regexp.MustCompile(`(?m)^[A-Z][A-Z0-9_]+\n(?:    .*\n)+`).FindAllString(r.stdout, -1) {
			name, _, _ := strings.Cut(b, "\n")
			blocks[name] = b
		}
		for name, def := range declaredVariables(t) {
			b, ok := blocks[name]
			if !ok {
				t.Errorf("%s: %s, read by the provider, is not in the reference", arg, name)
				continue
			}
			want := "    default: " + def + "\n"
			if def == "" {
				want = "    default: (unset)\n"
			}
			if !strings.Contains(b, want) {
				t.Errorf("%s: %s's entry lacks %q:\n%s", arg, name, want, b)
			}
			if !regexp.MustCompile(`(?m)^    allowed: \S.*$`).MatchString(b) {
				t.Errorf("%s: %s's entry says nothing of what it allows:\n%s", arg, name, b)
			}
		}
	}
}

func TestVersionPrintsTheBuild(t *testing.T) {
	r := runBinary(t, nil, "--version")
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("exit %d, stderr %q", r.code, r.stderr)
	}
	for _, want := range []string{"incus-provider " + testVersion, runtime.Version(), runtime.GOOS + "/" + runtime.GOARCH} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("--version printed %q, without %q", r.stdout, want)
		}
	}
	if strings.Count(r.stdout, "\n") != 1 {
		t.Errorf("--version printed more than a line: %q", r.stdout)
	}
}

// oneSentence fails unless stderr is exactly one line, naming want, with
// no trace of a Go stack or a JSON log record repeating it.
func oneSentence(t *testing.T, r ran, want ...string) {
	t.Helper()
	if r.code != exitBadSetting {
		t.Errorf("exit %d, want %d; stderr:\n%s", r.code, exitBadSetting, r.stderr)
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(r.stderr, "\n"), "\n") {
		// Info records of start-up may precede the refusal.
		if strings.HasPrefix(l, `{"level":"info"`) {
			continue
		}
		lines = append(lines, l)
	}
	if len(lines) != 1 || !strings.HasPrefix(lines[0], "incus-provider: ") {
		t.Errorf("want one sentence on stderr, got:\n%s", r.stderr)
	}
	for _, bad := range []string{"goroutine ", ".go:", "stacktrace", "panic"} {
		if strings.Contains(strings.Join(lines, "\n"), bad) || strings.Contains(r.stderr, `"stacktrace"`) {
			t.Errorf("stderr carries %q:\n%s", bad, r.stderr)
		}
	}
	for _, w := range want {
		if !strings.Contains(r.stderr, w) {
			t.Errorf("stderr does not say %q:\n%s", w, r.stderr)
		}
	}
}

// TestEveryBadSettingAtOnce: one start names every refused setting, each in
// a sentence of its own on a line of its own, and touches nothing: the
// Incus socket named does not exist, and a start that reached for it would
// exit 1, not 2.
func TestEveryBadSettingAtOnce(t *testing.T) {
	notPEM := filepath.Join(t.TempDir(), "not.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r := runBinary(t, []string{"INCUS_SOCKET=/nonexistent/incus.sock", "PROVIDER_TEMPLATES=/nonexistent.yaml",
		"PROVIDER_LISTEN=0.0.0.0:8480", "PROVIDER_MAX_IN_FLIGHT=many", "PROVIDER_GRACEFUL_STOP=0s",
		"PROVIDER_TLS_CERT=" + notPEM, "PROVIDER_TLS_KEY=" + notPEM, "PROVIDER_CREDENTAIL_FILE=/etc/credential",
		"INCUS_PORJECT=prod", "INCUS_DIR=/var/lib/incus"})
	if r.code != exitBadSetting {
		t.Fatalf("exit %d, want %d; stderr:\n%s", r.code, exitBadSetting, r.stderr)
	}
	lines := strings.Split(strings.TrimRight(r.stderr, "\n"), "\n")
	for _, want := range []string{"PROVIDER_TEMPLATES=", "PROVIDER_LISTEN=", "PROVIDER_MAX_IN_FLIGHT=", "PROVIDER_GRACEFUL_STOP=",
		"PROVIDER_TLS_CERT=", "PROVIDER_CREDENTAIL_FILE is set", "INCUS_PORJECT is set"} {
		n := 0
		for _, l := range lines {
			if strings.HasPrefix(l, "incus-provider: "+want) {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%d lines begin %q, want 1:\n%s", n, want, r.stderr)
		}
	}
	if len(lines) != 7 || strings.Contains(r.stderr, "INCUS_DIR") || strings.Contains(r.stderr, "{") {
		t.Errorf("want exactly the 7 refusals (INCUS_DIR is Incus's own), got:\n%s", r.stderr)
	}
}

func TestUnknownArgumentsExit2(t *testing.T) {
	for _, args := range [][]string{{"--foo"}, {"serve"}, {"--help", "extra"}, {"-version=1"}} {
		r := runBinary(t, nil, args...)
		oneSentence(t, r, args[0], "--help")
		if r.stdout != "" {
			t.Errorf("%v: printed %q on stdout", args, r.stdout)
		}
	}
}

func TestBadSettingsExit2WithOneSentence(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string { return fileIn(t, dir, name, body) }
	good, err := filepath.Abs("../../deploy/templates.dev.yaml")
	if err != nil {
		t.Fatal(err)
	}
	badTemplates := write("bad.yaml", "templates:\n  - nonsense: 1\n")
	empty := write("empty", "")
	notPEM := write("not.pem", "not a certificate\n")
	cases := []struct {
		env  []string
		want []string
	}{
		{[]string{"PROVIDER_MAX_IN_FLIGHT=8"}, []string{"PROVIDER_MAX_IN_FLIGHT", "from 16"}},
		{[]string{"PROVIDER_MAX_IN_FLIGHT=many"}, []string{"PROVIDER_MAX_IN_FLIGHT", "whole number"}},
		{[]string{"PROVIDER_GRACEFUL_STOP=soon"}, []string{"PROVIDER_GRACEFUL_STOP", "duration"}},
		{[]string{"PROVIDER_LOG_LEVEL=loud"}, []string{"PROVIDER_LOG_LEVEL"}},
		{[]string{"PROVIDER_GUEST_SOCKET_DIR=relative"}, []string{"PROVIDER_GUEST_SOCKET_DIR", "absolute"}},
		{[]string{"PROVIDER_TEMPLATES=/nonexistent.yaml"}, []string{"PROVIDER_TEMPLATES"}},
		{[]string{"PROVIDER_TEMPLATES=" + badTemplates}, []string{badTemplates, "nonsense"}},
		{[]string{"PROVIDER_TEMPLATES=" + good, "PROVIDER_CREDENTIAL_FILE=" + empty}, []string{"PROVIDER_CREDENTIAL_FILE", "empty"}},
		{[]string{"PROVIDER_TEMPLATES=" + good, "PROVIDER_TLS_CERT=" + notPEM, "PROVIDER_TLS_KEY=" + notPEM}, []string{"PROVIDER_TLS_CERT", "not a usable pair"}},
		{[]string{"PROVIDER_TEMPLATES=" + good, "PROVIDER_LISTEN=192.0.2.1:8480", "PROVIDER_ALLOW_NO_CREDENTIAL=yes", "INCUS_SOCKET=" + incustest.Socket()},
			[]string{"PROVIDER_LISTEN", "cannot be bound"}},
		{[]string{"PROVIDER_LISTEN=0.0.0.0:8480"}, []string{`PROVIDER_LISTEN="0.0.0.0:8480"`, "PROVIDER_CREDENTIAL_FILE is unset"}},
		{[]string{"PROVIDER_CREDENTAIL_FILE=" + empty}, []string{"PROVIDER_CREDENTAIL_FILE is set", "did you mean PROVIDER_CREDENTIAL_FILE?"}},
		{[]string{"PROVIDER_INGRESS_TLS_CERT=" + notPEM, "PROVIDER_INGRESS_TLS_KEY=" + notPEM}, []string{"PROVIDER_INGRESS_TLS_CERT", "not a usable pair"}},
	}
	// The rest reach Incus; a missing project is refused as one, not as
	// an image that cannot be resolved.
	incustest.Client(t)
	cases = append(cases, struct {
		env  []string
		want []string
	}{[]string{"PROVIDER_TEMPLATES=" + good, "INCUS_SOCKET=" + incustest.Socket(), "INCUS_PROJECT=ops-no-such-project"},
		[]string{`INCUS_PROJECT="ops-no-such-project"`, "no project"}})
	for _, c := range cases {
		t.Run(strings.Join(c.env, " "), func(t *testing.T) {
			env := append([]string{"PROVIDER_LISTEN=127.0.0.1:0", "PROVIDER_METRICS_LISTEN=off", "PROVIDER_TEMPLATES=" + good}, c.env...)
			r := runBinary(t, env)
			oneSentence(t, r, c.want...)
			if strings.Contains(r.stderr, "image") {
				t.Errorf("the refusal speaks of an image: %s", r.stderr)
			}
		})
	}
}
