package provider_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// chromium is Debian's package's binary (deploy/dev/test.sh installs it).
const chromium = "/usr/bin/chromium"

// needChromium skips the test when Chromium is missing, or fails it when
// any of the require variables (incustest.EnvRequire, ...) is "1".
func needChromium(t *testing.T, require ...string) {
	t.Helper()
	_, err := os.Stat(chromium)
	if err == nil {
		return
	}
	for _, env := range require {
		if os.Getenv(env) == "1" {
			t.Fatalf("%s is missing (apt-get install chromium; deploy/dev/test.sh does): %v", chromium, err)
		}
	}
	t.Skipf("%s is missing; set %s=1 to fail instead", chromium, strings.Join(require, "=1 or "))
}

// artifactDir is where screenshots go: $INCUS_PROVIDER_ARTIFACTS, or the
// test's temporary directory.
func artifactDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("INCUS_PROVIDER_ARTIFACTS")
	if dir == "" {
		dir = t.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// chromiumArgs are the flags of every headless run, with a virtual time
// budget of budget.
func chromiumArgs(t *testing.T, budget time.Duration) []string {
	t.Helper()
	return []string{
		"--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
		"--disable-background-networking", "--disable-component-update", "--disable-sync",
		"--disable-default-apps", "--disable-extensions", "--no-pings", "--no-proxy-server",
		// Nothing but the edge is ever looked up or reached: *.localhost is
		// loopback, every other name fails without a DNS query.
		`--host-resolver-rules=MAP *.localhost 127.0.0.1, MAP * ~NOTFOUND`,
		"--user-data-dir=" + t.TempDir(),
		"--virtual-time-budget=" + strconv.FormatInt(budget.Milliseconds(), 10),
		"--window-size=900,400",
	}
}

// runChromium runs Chromium with args and extra on url, bounded at a
// minute, and answers its output.
func runChromium(t *testing.T, args []string, url string, extra ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, chromium, append(append(append([]string(nil), args...), extra...), url)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("chromium %v: %v\n%s", extra, err, stderr.String())
	}
	return out
}

// guestPage is what a DOM dump shows of the dev guest's page
// (internal/devguest's page).
type guestPage int

const (
	pageDone    guestPage = iota // both paragraphs read what they should
	pagePending                  // a paragraph is still on its way
	pageAbsent                   // the DOM has no paragraph of the page
)

// wantParagraphs are the page's paragraphs once the stream and the echo
// have both delivered.
var wantParagraphs = map[string]string{
	"sse": "sse: event-1 event-2 event-3 [sse done]",
	"ws":  "ws: echo: hello from the browser [ws done]",
}

// readGuestPage reads the two paragraphs the page writes into; any text
// that is neither what they should read nor on its way to it is an error.
func readGuestPage(dom string) (guestPage, error) {
	state := pageDone
	for _, id := range []string{"sse", "ws"} {
		// The page's own script names the same words, so only the two
		// paragraphs it writes into are read.
		m := regexp.MustCompile(`<p id="` + id + `">([^<]*)</p>`).FindStringSubmatch(dom)
		if m == nil {
			return pageAbsent, fmt.Errorf("the DOM has no paragraph %q", id)
		}
		switch got := m[1]; {
		case got == wantParagraphs[id]:
		case strings.HasPrefix(wantParagraphs[id], got):
			state = pagePending
		default:
			return state, fmt.Errorf("the %s paragraph reads %q, want %q", id, got, wantParagraphs[id])
		}
	}
	return state, nil
}

// TestIngressInABrowser loads the dev guest's page through the edge in
// headless Chromium and checks what the page wrote into its own text: the
// server-sent events it streamed and the WebSocket echo it got. The
// screenshot goes to $INCUS_PROVIDER_ARTIFACTS (or the test's temporary
// directory), and its path is logged.
func TestIngressInABrowser(t *testing.T) {
	needChromium(t, incustest.EnvRequire)
	r := newRig(t, rigOptions{})
	web := r.create("ingress-browser", "web")
	o, err := r.ensure(web.Owner, web.TargetID)
	endpoint := mustEndpoint(t)(o, err)

	shot := filepath.Join(artifactDir(t), "ingress-browser.png")
	args := chromiumArgs(t, 5*time.Second)
	run := func(extra ...string) []byte {
		t.Helper()
		return runChromium(t, args, endpoint+"/", extra...)
	}
	// Chromium dumps the DOM once its virtual time budget is spent, and
	// virtual time does not wait for a WebSocket's answer: on a loaded
	// machine the echo can come after the dump. A dump whose paragraphs
	// are still on their way is taken again, a bounded number of times;
	// any other text fails at once.
	const dumps = 4
	for attempt := 1; ; attempt++ {
		dom := string(run("--dump-dom"))
		t.Logf("the page's DOM through %s (dump %d):\n%s", endpoint, attempt, dom)
		state, err := readGuestPage(dom)
		if err != nil {
			t.Fatal(err)
		}
		if state == pageDone {
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
