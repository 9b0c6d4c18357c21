package templates

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/guest"
)

func write(t *testing.T, name, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

const good = `templates:
  - templateId: a
    displayName: A
    powerStates: [running, paused, stopped]
    idle: {pauseAfterMs: 1000, closeAfterMs: 5000}
    resources: {vcpus: 2, memoryBytes: 1073741824}
    imageAlias: img
`

func TestLoadGoodFileInYAMLAndJSON(t *testing.T) {
	c, err := Load(write(t, "t.yaml", good))
	if err != nil {
		t.Fatal(err)
	}
	tm, ok := c.Get("a")
	if !ok || tm.DaemonPort != guest.DefaultPort || tm.InstanceType != "container" || tm.Profiles[0] != "default" {
		t.Fatalf("defaults not applied: %+v", tm)
	}
	w, err := Load(write(t, "w.yaml", strings.Replace(good, "imageAlias: img", "imageAlias: img\n    warm: 32", 1)))
	if err != nil {
		t.Fatal(err)
	}
	if tw, _ := w.Get("a"); tw.Warm != 32 || tm.Warm != 0 {
		t.Fatalf("warm: got %d (and %d without the member), want 32 and 0", tw.Warm, tm.Warm)
	}
	j := `{"templates": [{"templateId": "j", "displayName": "J", "imageFingerprint": "` + strings.Repeat("ab", 32) + `"}]}`
	if _, err := Load(write(t, "t.json", j)); err != nil {
		t.Fatal(err)
	}
}

func TestLoadRefusesWithOneSentenceNamingFileTemplateAndMember(t *testing.T) {
	cases := map[string]struct{ body, want string }{
		"unknown member":    {strings.Replace(good, "imageAlias: img", "imageAlias: img\n    colour: red", 1), `template "a": member templates[0].colour is not a known member`},
		"no image":          {strings.Replace(good, "    imageAlias: img\n", "", 1), `templates[0].imageAlias or imageFingerprint must be set`},
		"bad idle order":    {strings.Replace(good, "closeAfterMs: 5000", "closeAfterMs: 500", 1), `templates[0].idle.closeAfterMs must not be smaller than pauseAfterMs`},
		"zero idle":         {strings.Replace(good, "pauseAfterMs: 1000", "pauseAfterMs: 0", 1), `templates[0].idle.pauseAfterMs must be positive`},
		"huge number":       {strings.Replace(good, "pauseAfterMs: 1000", "pauseAfterMs: 9007199254740992", 1), `templates[0].idle.pauseAfterMs must be below 2^53`},
		"bad power":         {strings.Replace(good, "paused, stopped", "paused, asleep", 1), `templates[0].powerStates[2] must be one of`},
		"suspended ctr":     {strings.Replace(good, "paused, stopped", "suspended", 1), `templates[0].powerStates cannot include suspended for a container`},
		"ingress no port":   {strings.Replace(good, "imageAlias: img", "imageAlias: img\n    publicIngress: true", 1), `templates[0].ingressPort must be set exactly when publicIngress is true`},
		"ingress no flag":   {strings.Replace(good, "imageAlias: img", "imageAlias: img\n    ingressPort: 8080", 1), `template "a": member templates[0].ingressPort must be set exactly when publicIngress is true`},
		"ingress on daemon": {strings.Replace(good, "imageAlias: img", "imageAlias: img\n    publicIngress: true\n    ingressPort: 19091", 1), `templates[0].ingressPort must differ from daemonPort`},
		"ingress port big":  {strings.Replace(good, "imageAlias: img", "imageAlias: img\n    publicIngress: true\n    ingressPort: 70000", 1), `templates[0].ingressPort`},
		"short fingerprint": {strings.Replace(good, "imageAlias: img", "imageFingerprint: abc123", 1), `templates[0].imageFingerprint must be a full 64-character`},
		"duplicate id":      {good + strings.TrimPrefix(good, "templates:\n"), `template "a" (templates[1]) repeats a templateId`},
		"null":              {strings.Replace(good, "displayName: A", "displayName: null", 1), `templates[0].displayName must not be null`},
		"empty":             {"templates: []\n", "lists no templates"},
		"warm too big":      {strings.Replace(good, "imageAlias: img", "imageAlias: img\n    warm: 65", 1), `template "a": member templates[0].warm must be from 0 to 64`},
		"warm negative":     {strings.Replace(good, "imageAlias: img", "imageAlias: img\n    warm: -1", 1), `template "a": member templates[0].warm`},
		"warm deprecated":   {strings.Replace(good, "imageAlias: img", "imageAlias: img\n    deprecated: true\n    warm: 2", 1), `template "a": member templates[0].warm must be 0 for a deprecated template`},
	}
	for name, c := range cases {
		path := write(t, "templates.yaml", c.body)
		_, err := Load(path)
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		msg := err.Error()
		if !strings.Contains(msg, path) || !strings.Contains(msg, c.want) || strings.Contains(msg, "\n") {
			t.Errorf("%s: got %q, want one line naming %s and containing %q", name, msg, path, c.want)
		}
	}
}

// TestEmptyOptionsAreLeftOut: the contract omits absent options and empty
// collections, so a file's resources: {} (or metadata: {}) is listed as
// nothing, not as an empty object.
func TestEmptyOptionsAreLeftOut(t *testing.T) {
	body := strings.Replace(good, "    idle: {pauseAfterMs: 1000, closeAfterMs: 5000}\n", "", 1)
	body = strings.Replace(body, "resources: {vcpus: 2, memoryBytes: 1073741824}", "resources: {}\n    metadata: {}\n    profiles: []", 1)
	c, err := Load(write(t, "t.yaml", body))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal(c.Wire())
	if err != nil {
		t.Fatal(err)
	}
	if want := `[{"templateId":"a","displayName":"A","powerStates":["running","paused","stopped"]}]`; string(raw) != want {
		t.Fatalf("listed as %s, want %s", raw, want)
	}
}
