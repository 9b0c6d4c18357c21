package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// readyzBody fetches /readyz from the child's metrics listener.
func (c *child) readyzBody(t *testing.T) string {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second}
	resp, err := hc.Get(strings.TrimSuffix(c.metrics, "/metrics") + "/readyz")
	if err != nil {
		t.Fatalf("/readyz: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("/readyz: %v", err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/readyz answered %d: %s", resp.StatusCode, b)
	}
	return string(b)
}

// PROVIDER_OBSERVATION_CACHE: on (the default), /readyz comes to say the
// cache is confirmed once Incus's event stream is up and listed; off, it
// says so, and the cache never confirms.
func TestObservationCacheSwitch(t *testing.T) {
	t.Run("on", func(t *testing.T) {
		c := startProvider(t)
		deadline := time.Now().Add(30 * time.Second)
		var body string
		for time.Now().Before(deadline) {
			if body = c.readyzBody(t); strings.Contains(body, "observation cache: confirmed") {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Fatalf("/readyz never said the cache is confirmed within 30s:\n%s", body)
	})
	t.Run("off", func(t *testing.T) {
		c := startProvider(t, "PROVIDER_OBSERVATION_CACHE=off")
		// Past the first full list, which would confirm a cache that ran.
		time.Sleep(2 * time.Second)
		if body := c.readyzBody(t); !strings.Contains(body, "observation cache: off") {
			t.Fatalf("/readyz with the cache off:\n%s", body)
		}
		c.logMu.Lock()
		log := c.log.String()
		c.logMu.Unlock()
		if strings.Contains(log, "observation cache confirmed") {
			t.Fatalf("the cache confirmed though it is off:\n%s", c.logTail(20))
		}
	})
}
