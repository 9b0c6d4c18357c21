package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/lightspeed-dev/incus-provider/targets"
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
		{"PROVIDER_GUEST_DIALER", "ssh", "use auto, netns, proxy, exec or member"},
		{"PROVIDER_INCUS_MEMBER", "-m1", "the name of the Incus cluster member"},
		{"PROVIDER_LOG_LEVEL", "loud", "debug, info, warn or error"},
		{"PROVIDER_OBSERVATION_CACHE", "maybe", "on or off"},
		{"PROVIDER_CACHE_CORRECTION_INTERVAL", "5s", "from 10s to 1h"},
		{"PROVIDER_TLS_CERT", "/nonexistent.pem", "PROVIDER_TLS_KEY"},
		{"PROVIDER_CREDENTIAL_FILE", "/nonexistent", "readable file"},
		{"INCUS_URL", "http://incus:8443", "https://"},
		{"INCUS_URL", "https://10.0.0.1:8443,http://10.0.0.2:8443", `"http://10.0.0.2:8443" must start with https://`},
		{"INCUS_URL", "https://10.0.0.1:8443,https://10.0.0.1:8443/", "the same endpoint twice"},
		{"INCUS_URL", "https://10.0.0.1:8443,", "empty entry"},
		{"INCUS_URL", "https://10.0.0.1:8443/1.0", "without a path"},
		{"INCUS_URL", "https://10.0.0.1", "must give a port"},
		{"INCUS_URL", "https://admin@10.0.0.1:8443", "user"},
		{"INCUS_URL", "https://10.0.0.1:8443?project=x", "query"},
		{"PROVIDER_METRICS_LISTEN", "unix:/x", "host:port"},
		{"PROVIDER_ROUTE_LISTEN", "unix:/x", "host:port"},
		{"PROVIDER_ROUTE_LISTEN", "8481", "host:port"},
		{"PROVIDER_ROUTE_PATH", "routes", "an absolute path"},
		{"PROVIDER_ROUTE_PATH", "/routes/", "not ending in /"},
		{"PROVIDER_ROUTE_PATH", "/", "one or more segments"},
		{"PROVIDER_ROUTE_PATH", "/a//b", "one or more segments"},
		{"PROVIDER_ROUTE_PATH", "/a?b", "letters, digits"},
		{"PROVIDER_MEMORY_LIMIT", "lots", "such as 768MiB or 2GiB, or off"},
		{"PROVIDER_MEMORY_LIMIT", "768MB", "such as 768MiB"},
		{"PROVIDER_MEMORY_LIMIT", "1MiB", "from 64MiB"},
		{"PROVIDER_MEMORY_LIMIT", "-1", "from 64MiB"},
		{"PROVIDER_DECODE_BUDGET", "8MiB", "from 16MiB"},
		{"PROVIDER_DECODE_BUDGET", "64 MiB", "such as 64MiB"},
		{"PROVIDER_MAX_CONNECTIONS", "8", "from 16"},
		{"PROVIDER_MAX_CONNECTIONS", "many", "PROVIDER_MAX_CONNECTIONS"},
		{"PROVIDER_MAX_CONTROL_CONNECTIONS", "0", "from 1"},
		{"PROVIDER_PEER_LISTEN", "unix:/run/p.sock", "use host:port"},
		{"PROVIDER_PEERS", "node1", "member=host:port"},
		{"PROVIDER_PEERS", "node1=10.0.0.1", "member=host:port"},
		{"PROVIDER_PEERS", "node1=10.0.0.1:8483,node1=10.0.0.2:8483", "twice"},
		{"PROVIDER_PEER_SECRET_FILE", "/nonexistent", "only with PROVIDER_PEER_LISTEN or PROVIDER_PEERS"},
		{"PROVIDER_INGRESS_LISTEN", "unix:/x", "or off"},
		{"PROVIDER_INGRESS_TLS_CERT", "/nonexistent/ingress.crt", "PROVIDER_INGRESS_TLS_KEY together"},
		{"PROVIDER_INGRESS_BASE_URL", "https://env.example.com", "exactly once in its host"},
		{"PROVIDER_INGRESS_BASE_URL", "ftp://{label}.example.com", "http or https"},
		{"PROVIDER_INGRESS_BASE_URL", "https://{label}.example.com/app", "no user, path"},
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
	if c.Listen != "127.0.0.1:8480" || c.MetricsListen != "127.0.0.1:9480" || c.GuestDialer != "auto" || c.IncusProject != "default" || c.MaxInFlight != 64 {
		t.Fatalf("defaults changed; update README.md with them: %+v", c)
	}
	if c.memoryLimitBytes != 768<<20 || c.decodeBudgetBytes != 64<<20 || c.MaxConnections != 4096 || c.MaxControl != 64 {
		t.Fatalf("defaults changed; update README.md with them: %+v", c)
	}
}

func TestConfigSizes(t *testing.T) {
	templates := filepath.Join(t.TempDir(), "t.yaml")
	if err := os.WriteFile(templates, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PROVIDER_TEMPLATES", templates)
	for _, c := range []struct {
		memory, budget   string
		memoryB, budgetB int64
	}{{"off", "16777216", 0, 16 << 20}, {"2GiB", "1GiB", 2 << 30, 1 << 30}, {"67108864B", "32768KiB", 64 << 20, 32 << 20}} {
		t.Setenv("PROVIDER_MEMORY_LIMIT", c.memory)
		t.Setenv("PROVIDER_DECODE_BUDGET", c.budget)
		got, err := loadConfig()
		if err != nil {
			t.Fatalf("%s, %s: %v", c.memory, c.budget, err)
		}
		if got.memoryLimitBytes != c.memoryB || got.decodeBudgetBytes != c.budgetB {
			t.Fatalf("%s, %s: read %d, %d", c.memory, c.budget, got.memoryLimitBytes, got.decodeBudgetBytes)
		}
	}
}

func TestConfigIncusURLs(t *testing.T) {
	templates := filepath.Join(t.TempDir(), "t.yaml")
	if err := os.WriteFile(templates, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PROVIDER_TEMPLATES", templates)
	t.Setenv("INCUS_CLIENT_CERT", "/c.crt")
	t.Setenv("INCUS_CLIENT_KEY", "/c.key")
	t.Setenv("INCUS_SERVER_CERT", "/s.crt")
	for v, want := range map[string][]string{
		"https://10.0.0.1:8443": {"https://10.0.0.1:8443"},
		"https://10.0.0.1:8443, https://10.0.0.2:8443,https://m3.example:8443/": {
			"https://10.0.0.1:8443", "https://10.0.0.2:8443", "https://m3.example:8443/"},
	} {
		t.Setenv("INCUS_URL", v)
		c, err := loadConfig()
		if err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		if strings.Join(c.incusURLs, " ") != strings.Join(want, " ") {
			t.Errorf("INCUS_URL=%s: got %q, want %q", v, c.incusURLs, want)
		}
	}
	t.Setenv("INCUS_URL", "https://10.0.0.1:8443,https://10.0.0.2:8443")
	t.Setenv("INCUS_SERVER_CERT", "")
	if _, err := loadConfig(); err == nil || !strings.Contains(err.Error(), "INCUS_SERVER_CERT") {
		t.Errorf("a list without the pinned certificate: %v", err)
	}
}

func TestConfigPeers(t *testing.T) {
	dir := t.TempDir()
	templates := filepath.Join(dir, "t.yaml")
	if err := os.WriteFile(templates, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PROVIDER_TEMPLATES", templates)
	t.Setenv("PROVIDER_PEER_LISTEN", "127.0.0.2:8483")
	t.Setenv("PROVIDER_PEERS", "node1=127.0.0.2:8483, node2=127.0.0.3:8483")
	if _, err := loadConfig(); err == nil || !strings.Contains(err.Error(), "PROVIDER_PEER_SECRET_FILE") {
		t.Fatalf("peers without a secret: %v", err)
	}
	secret := filepath.Join(dir, "peer.secret")
	write := func(content string, mode os.FileMode) {
		t.Helper()
		if err := os.WriteFile(secret, []byte(content), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(secret, mode); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PROVIDER_PEER_SECRET_FILE", secret)
	write(strings.Repeat("s", 40)+"\n", 0o644)
	if _, err := loadConfig(); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("a readable secret: %v", err)
	}
	write("short\n", 0o600)
	if _, err := loadConfig(); err == nil || !strings.Contains(err.Error(), "at least 32") {
		t.Fatalf("a short secret: %v", err)
	}
	write(strings.Repeat("s", 40)+"\n", 0o600)
	c, err := loadConfig()
	if err != nil {
		t.Fatal(err)
	}
	if len(c.peerSecret) != 40 || c.peers["node1"] != "127.0.0.2:8483" || c.peers["node2"] != "127.0.0.3:8483" || len(c.peers) != 2 {
		t.Fatalf("read %d secret bytes and peers %v", len(c.peerSecret), c.peers)
	}
}

// TestRouteBaseIsWhatARuntimeDials: the data route base printed at start is
// the route listener's when there is one, else the controller listener's,
// and there is none for a unix socket alone (the contract: a unix://
// controller has no derivable base).
func TestRouteBaseIsWhatARuntimeDials(t *testing.T) {
	for _, c := range []struct {
		cfg    config
		scheme string
		want   string
	}{
		{config{Listen: "127.0.0.1:8480", RoutePath: "/routes"}, "ws", "ws://127.0.0.1:8480/routes"},
		{config{Listen: "127.0.0.1:8480", RoutePath: "/env/data", TLSCert: "c"}, "wss", "wss://127.0.0.1:8480/env/data"},
		{config{Listen: "unix:/run/p.sock", RoutePath: "/routes"}, "unix", ""},
		{config{Listen: "unix:/run/p.sock", RouteListen: "0.0.0.0:8481", RoutePath: "/routes"}, "unix", "ws://0.0.0.0:8481/routes"},
		{config{Listen: "unix:/run/p.sock", RouteListen: "[::1]:8481", RoutePath: "/r", TLSCert: "c"}, "unix", "wss://[::1]:8481/r"},
	} {
		if got := routeBaseURL(c.cfg, c.scheme); got != c.want {
			t.Errorf("%+v: route base %q, want %q", c.cfg, got, c.want)
		}
	}
}

// TestDefaultReplicaOfAnyListener: a replica id for every listener, a unix
// socket's of any length included (a long path once sliced the host name
// out of range, and the process panicked at start), and different ids for
// two sockets on one host.
func TestDefaultReplicaOfAnyListener(t *testing.T) {
	long := "unix:/tmp/" + strings.Repeat("d", 200) + "/provider.sock"
	seen := map[string]string{}
	for _, listen := range []string{"127.0.0.1:8480", "127.0.0.1:8481", "[::1]:8480", "unix:/run/a.sock", "unix:/run/b.sock", long} {
		id := defaultReplica(listen)
		if !targets.ValidReplica(id) {
			t.Fatalf("%s: replica id %q is not valid", listen, id)
		}
		if other, dup := seen[id]; dup && !strings.HasSuffix(listen, ":8480") {
			t.Fatalf("%s and %s share the replica id %q", listen, other, id)
		}
		seen[id] = listen
	}
}
