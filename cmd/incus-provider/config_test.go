package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestConfigRefusesBadValuesWithOneSentence(t *testing.T) {
	templates := filepath.Join(t.TempDir(), "t.yaml")
	if err := os.WriteFile(templates, []byte("templates: []\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name, value, want string
	}{
		{"PROVIDER_LISTEN", "8480", "use host:port"},
		{"PROVIDER_LISTEN", "unix:relative.sock", "absolute path"},
		{"PROVIDER_MAX_IN_FLIGHT", "8", "from 16"},
		{"PROVIDER_MAX_IN_FLIGHT", "many", "PROVIDER_MAX_IN_FLIGHT"},
		{"PROVIDER_GRACEFUL_STOP", "0s", "from 1s to 10m"},
		{"PROVIDER_GRACEFUL_STOP", "soon", "PROVIDER_GRACEFUL_STOP"},
		{"PROVIDER_GUEST_DIALER", "ssh", "use netns or proxy"},
		{"PROVIDER_LOG_LEVEL", "loud", "debug, info, warn or error"},
		{"PROVIDER_TLS_CERT", "/nonexistent.pem", "PROVIDER_TLS_KEY"},
		{"PROVIDER_CREDENTIAL_FILE", "/nonexistent", "readable file"},
		{"INCUS_URL", "http://incus:8443", "https://"},
		{"PROVIDER_METRICS_LISTEN", "unix:/x", "host:port"},
	}
	for _, c := range cases {
		t.Run(c.name+"="+c.value, func(t *testing.T) {
			t.Setenv("PROVIDER_TEMPLATES", templates)
			t.Setenv(c.name, c.value)
			_, err := loadConfig()
			if err == nil {
				t.Fatal("accepted")
			}
			msg := err.Error()
			if !strings.Contains(msg, c.name) || !strings.Contains(msg, c.value) || !strings.Contains(msg, c.want) || strings.Contains(msg, "\n") {
				t.Fatalf("got %q: want one line naming %s, %q and %q", msg, c.name, c.value, c.want)
			}
		})
	}
}

func TestConfigDefaults(t *testing.T) {
	templates := filepath.Join(t.TempDir(), "t.yaml")
	if err := os.WriteFile(templates, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PROVIDER_TEMPLATES", templates)
	c, err := loadConfig()
	if err != nil {
		t.Fatal(err)
	}
	if c.Listen != "127.0.0.1:8480" || c.MetricsListen != "127.0.0.1:9480" || c.GuestDialer != "netns" || c.IncusProject != "default" || c.MaxInFlight != 64 {
		t.Fatalf("defaults changed; update README.md with them: %+v", c)
	}
}
