package provider_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"
)

// livePage is headless Chromium showing one page, driven over the DevTools
// protocol on loopback, so that a test reads the page's text while it runs
// (a DOM dump ends the page, and its virtual time is not the real time in
// which a test kills a replica).
type livePage struct {
	cmd    *exec.Cmd
	cancel context.CancelFunc
	ws     *websocket.Conn
	id     int
}

// openLivePage starts Chromium on url and connects to its page. It is
// closed at the test's cleanup.
func openLivePage(t *testing.T, url string) *livePage {
	t.Helper()
	dir := t.TempDir()
	args := chromiumArgs(t, 0)
	kept := args[:0:0]
	for _, a := range args {
		if !strings.HasPrefix(a, "--virtual-time-budget") && !strings.HasPrefix(a, "--user-data-dir") {
			kept = append(kept, a)
		}
	}
	kept = append(kept, "--user-data-dir="+dir, "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", url)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	p := &livePage{cmd: exec.CommandContext(ctx, chromium, kept...), cancel: cancel}
	if err := p.cmd.Start(); err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(p.close)
	// Chromium writes the port it took to DevToolsActivePort.
	var port string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if b, err := os.ReadFile(filepath.Join(dir, "DevToolsActivePort")); err == nil {
			if line, _, _ := strings.Cut(string(b), "\n"); line != "" {
				port = line
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("Chromium did not open its DevTools port in 30 s")
		}
	}
	var target string
	for deadline := time.Now().Add(30 * time.Second); target == ""; time.Sleep(50 * time.Millisecond) {
		var pages []struct{ Type, WebSocketDebuggerURL string }
		rctx, rcancel := context.WithTimeout(context.Background(), 5*time.Second)
		req, _ := http.NewRequestWithContext(rctx, http.MethodGet, "http://127.0.0.1:"+port+"/json/list", nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_ = json.NewDecoder(resp.Body).Decode(&pages)
			resp.Body.Close()
		}
		rcancel()
		for _, pg := range pages {
			if pg.Type == "page" && pg.WebSocketDebuggerURL != "" {
				target = pg.WebSocketDebuggerURL
			}
		}
		if target == "" && time.Now().After(deadline) {
			t.Fatal("Chromium listed no page in 30 s")
		}
	}
	d := websocket.Dialer{HandshakeTimeout: 10 * time.Second}
	ws, _, err := d.Dial(target, nil)
	if err != nil {
		t.Fatalf("the DevTools protocol: %v", err)
	}
	p.ws = ws
	return p
}

// text is the page's text now ("" while it has none).
func (p *livePage) text(t *testing.T) string {
	t.Helper()
	p.id++
	msg := map[string]any{"id": p.id, "method": "Runtime.evaluate",
		"params": map[string]any{"expression": "document.body ? document.body.innerText : ''", "returnByValue": true}}
	_ = p.ws.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if err := p.ws.WriteJSON(msg); err != nil {
		t.Fatalf("the DevTools protocol: %v", err)
	}
	_ = p.ws.SetReadDeadline(time.Now().Add(10 * time.Second))
	for {
		var answer struct {
			ID     int `json:"id"`
			Result struct {
				Result struct {
					Value any `json:"value"`
				} `json:"result"`
			} `json:"result"`
			Error *struct{ Message string } `json:"error"`
		}
		if err := p.ws.ReadJSON(&answer); err != nil {
			t.Fatalf("the DevTools protocol: %v", err)
		}
		if answer.ID != p.id {
			continue // an event, or an older answer
		}
		if answer.Error != nil {
			t.Fatalf("Runtime.evaluate: %s", answer.Error.Message)
		}
		s, _ := answer.Result.Result.Value.(string)
		return s
	}
}

// await polls the page's text until cond holds, at most within.
func (p *livePage) await(t *testing.T, what string, within time.Duration, cond func(string) bool) string {
	t.Helper()
	var last string
	for deadline := time.Now().Add(within); ; time.Sleep(100 * time.Millisecond) {
		if last = p.text(t); cond(last) {
			return last
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s; the page reads %q", what, within, last)
		}
	}
}

func (p *livePage) close() {
	if p.ws != nil {
		_ = p.ws.Close()
	}
	p.cancel()
	_ = p.cmd.Wait()
}

// heldCounts reads the hold mode's line of the dev guest's page.
func heldCounts(text string) (opened, echoes int, ok bool) {
	for _, line := range strings.Split(text, "\n") {
		if _, err := fmt.Sscanf(strings.TrimSpace(line), "held: opened %d echoes %d", &opened, &echoes); err == nil {
			return opened, echoes, true
		}
	}
	return 0, 0, false
}
