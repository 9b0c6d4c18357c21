package incus_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// TestNoSilentConnectionAfterABurst: Incus reads the first bytes of each
// connection to its unix socket inside its accept loop, so one connection
// that is open but has sent nothing keeps every later client of the socket
// (the CLI, the start hooks of its own containers, other providers) from
// being served. Go's transport parks a dial it no longer needs in its idle
// pool without writing to it; bursts of concurrent calls make such dials.
// After each burst, a fresh connection must be answered at once.
func TestNoSilentConnectionAfterABurst(t *testing.T) {
	c := incustest.Server(t)
	const (
		rounds  = 12
		workers = 48
		probeBy = 3 * time.Second
	)
	deadline := time.Now().Add(90 * time.Second)
	for round := 1; round <= rounds && time.Now().Before(deadline); round++ {
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		var wg sync.WaitGroup
		errs := make(chan error, workers)
		for range workers {
			wg.Go(func() {
				if _, err := c.GetServer(ctx); err != nil {
					errs <- err
				}
			})
		}
		wg.Wait()
		cancel()
		close(errs)
		for err := range errs {
			t.Fatalf("round %d: GetServer: %v", round, err)
		}
		if took, err := probe(incustest.Socket(), probeBy); err != nil {
			t.Fatalf("round %d: a fresh connection to Incus was not answered within %v (%v, after %v): a connection of ours is open and silent", round, probeBy, err, took)
		}
		// Idle connections are shed between rounds only by their owner,
		// so that the next burst dials again.
		c.Close()
	}
}

// probe sends one request on a connection of its own and reads the status
// line.
func probe(socket string, within time.Duration) (time.Duration, error) {
	start := time.Now()
	conn, err := net.DialTimeout("unix", socket, within)
	if err != nil {
		return time.Since(start), err
	}
	defer conn.Close()
	if err := conn.SetDeadline(start.Add(within)); err != nil {
		return time.Since(start), err
	}
	if _, err := conn.Write([]byte("GET /1.0 HTTP/1.1\r\nHost: unix.socket\r\nConnection: close\r\n\r\n")); err != nil {
		return time.Since(start), err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err == nil && !strings.HasPrefix(line, "HTTP/1.1 200") {
		err = fmt.Errorf("unexpected status line %q", strings.TrimSpace(line))
	}
	return time.Since(start), err
}
