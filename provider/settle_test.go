package provider_test

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// TestActiveMeansStartedAndClosesAtOnce: a target is observed active only
// once no server operation holds its instance (LXD keeps a start running
// while a proxy device comes up, and refuses changes meanwhile), so a close
// asked the moment it is active is taken (a close that meets an operation
// waits for it; one answered unavailable because the server is slow is
// asked again, as the runtime would). Every owner's instance is gone
// afterwards, and with the proxy dialer so is its socket file. Run for
// many owners at once, with whichever server and dialer the suite runs on
// (INCUS_PROVIDER_TEST_SOCKET, INCUS_PROVIDER_TEST_DIALER).
func TestActiveMeansStartedAndClosesAtOnce(t *testing.T) {
	r := newRig(t, rigOptions{})
	const owners = 12
	var mu sync.Mutex
	var problems []string
	unavailable := 0
	report := func(f string, a ...any) {
		mu.Lock()
		problems = append(problems, fmt.Sprintf(f, a...))
		mu.Unlock()
	}
	var wg sync.WaitGroup
	for i := range owners {
		wg.Go(func() {
			owner := controller.Owner{UniverseID: "u-settle", EnvironmentID: fmt.Sprintf("env-%d", i)}
			// As the runtime does: an unavailable create is asked again
			// (a loaded Incus can outlast the answer's patience); counted.
			for attempt := 0; ; attempt++ {
				_, err := r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: "t1"})
				if err == nil {
					break
				}
				if !retryable(err) || attempt == 30 {
					report("owner %d: create, attempt %d: %v", i, attempt+1, err)
					return
				}
				mu.Lock()
				unavailable++
				mu.Unlock()
				time.Sleep(time.Second)
			}
			var o controller.Observation
			for deadline := time.Now().Add(90 * time.Second); ; time.Sleep(10 * time.Millisecond) {
				var err error
				o, err = r.get(owner)
				if err == nil && o.Phase == controller.PhaseActive {
					break
				}
				if time.Now().After(deadline) {
					report("owner %d: never active: %+v, %v", i, o, err)
					return
				}
			}
			if ops := r.operationsOn(o.TargetID); len(ops) > 0 {
				inst, _, _ := r.client.GetInstance(r.ctx(), o.TargetID)
				report("owner %d: observed active at %s while the server still runs %s on its instance (booted at %s)", i, time.Now().Format("15:04:05.000"), strings.Join(ops, ", "), inst.Config["user.lightspeed.booted_at_ms"])
			}
			socket := ""
			if dev, ok := r.dialer.Devices(guest.Target{Instance: o.TargetID, Port: guest.DefaultPort})[guest.ProxyDeviceName]; ok {
				socket = strings.TrimPrefix(dev["listen"], "unix:")
			}
			for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
				c, err := r.closeTarget(owner)
				var rpcErr *jsonrpc.Error
				if errors.As(err, &rpcErr) && rpcErr.Kind == jsonrpc.KindUnavailable {
					// Asked again, as the runtime would; counted.
					mu.Lock()
					unavailable++
					mu.Unlock()
				} else if err != nil {
					report("owner %d: close: %v", i, err)
					return
				}
				if err == nil && c.Phase == controller.PhaseClosed {
					break
				}
				if time.Now().After(deadline) {
					report("owner %d: not closed within 60 s: %+v, %v", i, c, err)
					return
				}
			}
			if socket != "" {
				if _, err := os.Lstat(socket); !errors.Is(err, os.ErrNotExist) {
					report("owner %d: the proxy socket %s is still there after the close (%v)", i, socket, err)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d owners created and closed at once; %d create and close answers were unavailable and asked again", owners, unavailable)
	if len(problems) > 0 {
		t.Fatalf("%d problems:\n%s", len(problems), strings.Join(problems, "\n"))
	}
	list, err := r.client.ListInstances(r.ctx())
	if err != nil || len(list) != 0 {
		t.Fatalf("%d instances left after every owner closed (%v)", len(list), err)
	}
}

// operationsOn lists the server's unfinished operations on the instance.
func (r *rig) operationsOn(name string) []string {
	r.t.Helper()
	ops, err := r.client.ListOperations(r.ctx())
	if err != nil {
		r.t.Errorf("list operations: %v", err)
		return nil
	}
	var out []string
	for _, op := range ops {
		for _, urls := range op.Resources {
			for _, u := range urls {
				if u == "/1.0/instances/"+name || strings.HasPrefix(u, "/1.0/instances/"+name+"?") {
					out = append(out, fmt.Sprintf("%s (%s, since %s)", op.Description, op.ID, op.CreatedAt.Format("15:04:05.000")))
				}
			}
		}
	}
	return out
}
