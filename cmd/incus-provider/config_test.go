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
		{"PROVIDER_WARM_MEMORY_MAX", "lots", "such as 8GiB, or off"},
		{"PROVIDER_WARM_MEMORY_MAX", "0", "such as 8GiB, or off"},
		{"PROVIDER_WARM_BURST_WINDOW", "0s", "from 1s to 1h"},
		{"PROVIDER_WARM_SHRINK_AFTER", "1s", "from 10s to 24h"},
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
			_, err := loadConfig(testEnviron())
			if err == nil {
				t.Fatal("accepted")
			}
			// Other settings may be refused beside it (a cluster URL
			// without its certificates); its own refusal is one line.
			var line string
			for l := range strings.SplitSeq(err.Error(), "\n") {
				if strings.HasPrefix(l, c.name+"=") {
					line = l
				}
			}
			if !strings.Contains(line, c.value) || !strings.Contains(line, c.want) {
				t.Fatalf("got %q: want a line naming %s, %q and %q", err, c.name, c.value, c.want)
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
	c, err := loadConfig(testEnviron())
	if err != nil {
		t.Fatal(err)
	}
	if c.Listen != "127.0.0.1:8480" || c.MetricsListen != "127.0.0.1:9480" || c.GuestDialer != "auto" || c.IncusProject != "default" || c.MaxInFlight != 64 {
		t.Fatalf("defaults changed; update docs/configuration.md with them: %+v", c)
	}
	if c.memoryLimitBytes != 768<<20 || c.decodeBudgetBytes != 64<<20 || c.MaxConnections != 4096 || c.MaxControl != 64 {
		t.Fatalf("defaults changed; update docs/configuration.md with them: %+v", c)
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
		got, err := loadConfig(testEnviron())
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
		c, err := loadConfig(testEnviron())
		if err != nil {
			t.Fatalf("%s: %v", v, err)
		}
		if strings.Join(c.incusURLs, " ") != strings.Join(want, " ") {
			t.Errorf("INCUS_URL=%s: got %q, want %q", v, c.incusURLs, want)
		}
	}
	t.Setenv("INCUS_URL", "https://10.0.0.1:8443,https://10.0.0.2:8443")
	t.Setenv("INCUS_SERVER_CERT", "")
	if _, err := loadConfig(testEnviron()); err == nil || !strings.Contains(err.Error(), "INCUS_SERVER_CERT") {
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
	if _, err := loadConfig(testEnviron()); err == nil || !strings.Contains(err.Error(), "PROVIDER_PEER_SECRET_FILE") {
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
	if _, err := loadConfig(testEnviron()); err == nil || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("a readable secret: %v", err)
	}
	write("short\n", 0o600)
	if _, err := loadConfig(testEnviron()); err == nil || !strings.Contains(err.Error(), "at least 32") {
		t.Fatalf("a short secret: %v", err)
	}
	write(strings.Repeat("s", 40)+"\n", 0o600)
	c, err := loadConfig(testEnviron())
	if err != nil {
		t.Fatal(err)
	}
	if len(c.peerSecrets) != 1 || len(c.peerSecrets[0]) != 40 || c.peers["node1"] != "127.0.0.2:8483" || c.peers["node2"] != "127.0.0.3:8483" || len(c.peers) != 2 {
		t.Fatalf("read secrets %q and peers %v", c.peerSecrets, c.peers)
	}
	// Two lines while rotating, the proving one first; more, or a short
	// one, are refused.
	write(strings.Repeat("n", 40)+"\n\n"+strings.Repeat("o", 33)+"\n", 0o600)
	if c, err = loadConfig(testEnviron()); err != nil || len(c.peerSecrets) != 2 || c.peerSecrets[0][0] != 'n' || len(c.peerSecrets[1]) != 33 {
		t.Fatalf("two secrets: %q, %v", c.peerSecrets, err)
	}
	write(strings.Repeat("a", 40)+"\n"+strings.Repeat("b", 40)+"\n"+strings.Repeat("c", 40)+"\n", 0o600)
	if _, err := loadConfig(testEnviron()); err == nil || !strings.Contains(err.Error(), "3 lines") {
		t.Fatalf("three secrets: %v", err)
	}
	write(strings.Repeat("a", 40)+"\nshort\n", 0o600)
	if _, err := loadConfig(testEnviron()); err == nil || !strings.Contains(err.Error(), "line 2 holds 5 bytes") {
		t.Fatalf("a short second secret: %v", err)
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

// testEnviron is this process's environment without the test harness's
// own variables (INCUS_PROVIDER_REQUIRE_INCUS and the like, which make
// test exports): the provider refuses them as unknown settings, as it
// would any, and a provider started by a test never sees them.
func testEnviron() []string {
	var out []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "INCUS_PROVIDER_") || strings.HasPrefix(kv, "PROVIDER_TEST_") {
			continue
		}
		out = append(out, kv)
	}
	return out
}

// TestConfigRefusesWhatIsNotASetting: a PROVIDER_* or INCUS_* variable the
// provider does not read is refused, with the setting it most likely
// meant; Incus's own variables pass.
func TestConfigRefusesWhatIsNotASetting(t *testing.T) {
	templates := filepath.Join(t.TempDir(), "t.yaml")
	if err := os.WriteFile(templates, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	base := append(testEnviron(), "PROVIDER_TEMPLATES="+templates)
	for _, c := range []struct{ kv, want string }{
		{"PROVIDER_CREDENTAIL_FILE=/etc/c", "PROVIDER_CREDENTAIL_FILE is set, and is not a setting of incus-provider; did you mean PROVIDER_CREDENTIAL_FILE?"},
		{"PROVIDER_LISTN=0.0.0.0:1", "did you mean PROVIDER_LISTEN?"},
		{"INCUS_PORJECT=prod", "did you mean INCUS_PROJECT?"},
		{"INCUS_SOCKT=/s", "did you mean INCUS_SOCKET?"},
		{"PROVIDER_TOTALLY_DIFFERENT=1", "PROVIDER_TOTALLY_DIFFERENT is set, and is not a setting of incus-provider; unset it"},
		{"INCUS_PROVIDER_REQUIRE_INCUS=1", "INCUS_PROVIDER_REQUIRE_INCUS is set, and is not a setting"},
	} {
		_, err := loadConfig(append(base, c.kv))
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Count(err.Error(), "\n") != 0 {
			t.Errorf("%s: got %v, want the one line %q", c.kv, err, c.want)
		}
	}
	for _, own := range incusOwnVariables {
		if _, err := loadConfig(append(base, own+"=1")); err != nil {
			t.Errorf("%s, Incus's own, refused: %v", own, err)
		}
	}
}

// TestConfigRefusesAnOpenListenerWithoutACredential: a controller listener
// that reaches beyond this host needs a credential, or the explicit
// setting that says something in front checks every caller.
func TestConfigRefusesAnOpenListenerWithoutACredential(t *testing.T) {
	dir := t.TempDir()
	templates := filepath.Join(dir, "t.yaml")
	credential := filepath.Join(dir, "credential")
	for _, f := range []string{templates, credential} {
		if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	base := append(testEnviron(), "PROVIDER_TEMPLATES="+templates)
	for _, c := range []struct {
		env     []string
		refused string // the variable refused, or "" for accepted
	}{
		{[]string{"PROVIDER_LISTEN=127.0.0.1:8480"}, ""},
		{[]string{"PROVIDER_LISTEN=127.9.9.9:8480"}, ""},
		{[]string{"PROVIDER_LISTEN=[::1]:8480"}, ""},
		{[]string{"PROVIDER_LISTEN=localhost:8480"}, ""},
		{[]string{"PROVIDER_LISTEN=unix:/run/p.sock"}, ""},
		{[]string{"PROVIDER_LISTEN=0.0.0.0:8480"}, "PROVIDER_LISTEN"},
		{[]string{"PROVIDER_LISTEN=:8480"}, "PROVIDER_LISTEN"},
		{[]string{"PROVIDER_LISTEN=[::]:8480"}, "PROVIDER_LISTEN"},
		{[]string{"PROVIDER_LISTEN=10.1.2.3:8480"}, "PROVIDER_LISTEN"},
		{[]string{"PROVIDER_LISTEN=provider.example.com:8480"}, "PROVIDER_LISTEN"},
		{[]string{"PROVIDER_LISTEN=unix:/run/p.sock", "PROVIDER_ROUTE_LISTEN=0.0.0.0:8481"}, "PROVIDER_ROUTE_LISTEN"},
		{[]string{"PROVIDER_LISTEN=0.0.0.0:8480", "PROVIDER_CREDENTIAL_FILE=" + credential}, ""},
		{[]string{"PROVIDER_LISTEN=0.0.0.0:8480", "PROVIDER_ALLOW_NO_CREDENTIAL=yes"}, ""},
		{[]string{"PROVIDER_LISTEN=0.0.0.0:8480", "PROVIDER_ALLOW_NO_CREDENTIAL=maybe"}, "PROVIDER_ALLOW_NO_CREDENTIAL"},
	} {
		_, err := loadConfig(append(base, c.env...))
		switch {
		case c.refused == "" && err != nil:
			t.Errorf("%v: refused: %v", c.env, err)
		case c.refused != "" && (err == nil || !strings.HasPrefix(err.Error(), c.refused+"=") || strings.Contains(err.Error(), "\n")):
			t.Errorf("%v: got %v, want one refusal of %s", c.env, err, c.refused)
		}
	}
}

// TestConfigReadsTheFilesItNames: a credential, a certificate pair or a
// peers' secret that cannot be used is refused by the configuration's
// check, before the process touches Incus or binds a port, and a good
// pair is handed on loaded.
func TestConfigReadsTheFilesItNames(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string { return fileIn(t, dir, name, body) }
	templates := write("t.yaml", "x")
	empty := write("empty", " \n")
	notPEM := write("not.pem", "not a certificate\n")
	cert, key := selfSigned(t)
	base := append(testEnviron(), "PROVIDER_TEMPLATES="+templates)
	for _, c := range []struct {
		env  []string
		want string
	}{
		{[]string{"PROVIDER_CREDENTIAL_FILE=" + empty}, "PROVIDER_CREDENTIAL_FILE="},
		{[]string{"PROVIDER_TLS_CERT=" + notPEM, "PROVIDER_TLS_KEY=" + key}, "PROVIDER_TLS_CERT="},
		{[]string{"PROVIDER_TLS_CERT=" + cert, "PROVIDER_TLS_KEY=" + notPEM}, "PROVIDER_TLS_CERT="},
		{[]string{"PROVIDER_TLS_CERT=" + cert, "PROVIDER_TLS_KEY=/nonexistent.key"}, "PROVIDER_TLS_KEY="},
		{[]string{"PROVIDER_INGRESS_TLS_CERT=" + cert, "PROVIDER_INGRESS_TLS_KEY=" + notPEM}, "PROVIDER_INGRESS_TLS_CERT="},
	} {
		_, err := loadConfig(append(base, c.env...))
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("%v: got %v, want a refusal beginning %q", c.env, err, c.want)
		}
	}
	c, err := loadConfig(append(base, "PROVIDER_TLS_CERT="+cert, "PROVIDER_TLS_KEY="+key, "PROVIDER_CREDENTIAL_FILE="+write("credential", "s3cret\n")))
	if err != nil {
		t.Fatal(err)
	}
	if c.tlsCert == nil || len(c.tlsCert.Certificate) == 0 || !c.credential.Enabled() {
		t.Fatalf("a good pair and credential were not handed on: cert %v, credential %v", c.tlsCert != nil, c.credential.Enabled())
	}
}

func TestEditDistance(t *testing.T) {
	for _, c := range []struct {
		a, b string
		d    int
	}{{"", "", 0}, {"abc", "abc", 0}, {"abc", "acb", 1}, {"abc", "ab", 1}, {"ab", "abc", 1}, {"kitten", "sitting", 3}, {"", "abc", 3}} {
		if got := editDistance(c.a, c.b); got != c.d {
			t.Errorf("editDistance(%q, %q) = %d, want %d", c.a, c.b, got, c.d)
		}
	}
}

// fileIn writes body to a file of the test's own directory dir and
// answers its path.
func fileIn(t *testing.T, dir, name, body string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// The replicas a pool of ready spares is shared among: the members
// PROVIDER_PEERS names and this one, counted once whether or not the list
// names it too.
func TestReplicaCount(t *testing.T) {
	peers := map[string]string{"lsm1": "a:1", "lsm2": "b:1"}
	for _, c := range []struct {
		member string
		peers  map[string]string
		want   int
	}{{"", nil, 1}, {"lsm1", nil, 1}, {"lsm1", peers, 2}, {"lsm3", peers, 3}, {"", peers, 3}} {
		if got := replicaCount(c.member, c.peers); got != c.want {
			t.Errorf("replicaCount(%q, %v) = %d, want %d", c.member, c.peers, got, c.want)
		}
	}
}
