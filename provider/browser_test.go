package provider_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// chromium is Debian's package's binary (deploy/dev/test.sh installs it).
const chromium = "/usr/bin/chromium"

// TestIngressInABrowser loads the dev guest's page through the edge in
// headless Chromium and checks what the page wrote into its own text: the
// server-sent events it streamed and the WebSocket echo it got. The
// screenshot goes to $INCUS_PROVIDER_ARTIFACTS (or the test's temporary
// directory), and its path is logged.
func TestIngressInABrowser(t *testing.T) {
	if _, err := os.Stat(chromium); err != nil {
		if os.Getenv(incustest.EnvRequire) == "1" {
			t.Fatalf("%s is missing (apt-get install chromium; deploy/dev/test.sh does): %v", chromium, err)
		}
		t.Skipf("%s is missing; set %s=1 to fail instead", chromium, incustest.EnvRequire)
	}
	r := newRig(t, rigOptions{})
	web := r.create("ingress-browser", "web")
	o, err := r.ensure(web.Owner, web.TargetID)
	endpoint := mustEndpoint(t)(o, err)

	dir := os.Getenv("INCUS_PROVIDER_ARTIFACTS")
	if dir == "" {
		dir = t.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	shot := filepath.Join(dir, "ingress-browser.png")
	args := []string{
		"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--disable-default-apps", "--disable-extensions", "--no-pings", "--no-proxy-server",
		// Nothing but the edge is ever looked up or reached: *.localhost is
		// loopback, every other name fails without a DNS query.
		`--host-resolver-rules=MAP *.localhost 127.0.0.1, MAP * ~NOTFOUND`,
		"--user-data-dir=" + t.TempDir(),
		"--virtual-time-budget=5000",
		"--window-size=900,400",
	}
	run := func(extra ...string) []byte {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, chromium, append(append(args, extra...), endpoint+"/")...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("chromium %v: %v\n%s", extra, err, stderr.String())
		}
		return out
	}
	// Chromium dumps the DOM once its virtual time budget is spent, and
	// virtual time does not wait for a WebSocket's answer: on a loaded
	// machine the echo can come after the dump. A dump whose paragraphs
	// are still on their way is taken again, a bounded number of times;
	// any other text fails at once.
	want := map[string]string{
		"sse": "sse: event-1 event-2 event-3 [sse done]",
		"ws":  "ws: echo: hello from the browser [ws done]",
	}
	const dumps = 4
	for attempt := 1; ; attempt++ {
		dom := string(run("--dump-dom"))
		t.Logf("the page's DOM through %s (dump %d):\n%s", endpoint, attempt, dom)
		pending := false
		for _, id := range []string{"sse", "ws"} {
			// The page's own script names the same words, so only the two
			// paragraphs it writes into are read.
			m := regexp.MustCompile(`<p id="` + id + `">([^<]*)</p>`).FindStringSubmatch(dom)
			if m == nil {
				t.Fatalf("the DOM has no paragraph %q", id)
			}
			switch got := m[1]; {
			case got == want[id]:
			case strings.HasPrefix(want[id], got):
				pending = true
			default:
				t.Fatalf("the %s paragraph reads %q, want %q", id, got, want[id])
			}
		}
		if !pending {
			break
		}
		if attempt == dumps {
			t.Fatalf("after %d dumps the page had still not finished", dumps)
		}
	}
	run("--screenshot=" + shot)
	if fi, err := os.Stat(shot); err != nil || fi.Size() == 0 {
		t.Fatalf("no screenshot at %s: %v", shot, err)
	}
	t.Logf("screenshot: %s", shot)
	if _, err := r.closeTarget(web.Owner); err != nil {
		t.Fatal(err)
	}
}
