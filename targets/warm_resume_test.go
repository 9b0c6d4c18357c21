package targets

import (
	"context"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap/zaptest"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incusfault"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

// A claimed warm instance whose rename Incus keeps refusing (as it does
// for a name it has wrecked: a volume and no instance) is resumed less and
// less often, not at every survey; and once Incus takes the rename again,
// the hand-out finishes.
func TestWarmResumeThatKeepsFailingBacksOff(t *testing.T) {
	h := warmHarness(t, 1)
	svc, stop := h.startWarm(h.catalog, nil, func(s string) bool { return s == "claimed" })
	h.awaitPool(t, 1)
	o := owner("resume-backoff")
	if _, err := svc.CreateTarget(context.Background(), controller.CreateParams{Owner: o, TemplateID: "w"}); err == nil {
		t.Fatal("the hook did not stop the hand-out")
	}
	stop()
	var claimed string
	for _, inst := range h.instances() {
		if isWarmName(inst.Name) && inst.Config[keyWarmClaim] == Name(o) {
			claimed = inst.Name
		}
	}
	if claimed == "" {
		t.Fatal("the crash after the claim left no claimed warm instance: the test tests nothing")
	}

	proxy := incustest.FaultProxy(t)
	// A rename is POST /1.0/instances/{name}; a create posts to the
	// collection, so the pool's refill is not refused.
	refused := proxy.Add(incusfault.Rule{Method: "POST", Path: "/1.0/instances/" + claimed, Fault: incusfault.Fail,
		Status: 500, Message: "injected: the name's storage is in the way"})
	viaProxy, err := incus.New(incus.Config{Socket: proxy.Socket(), Project: h.client.Project(), CallTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	const interval = 200 * time.Millisecond
	next := mustNew(t, viaProxy, h.catalog, h.dialer, zaptest.NewLogger(t),
		Config{GracefulStop: 2 * time.Second, ReconcileInterval: interval, WarmStale: time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = next.Run(ctx) }()
	t.Cleanup(func() { cancel(); wg.Wait() })

	// 20 surveys: one resume each without a backoff. With it, tries at
	// about 0, 0.2, 0.4, 0.8, 1.6 and 3.2 s (each wait counted from the
	// try's end, and a survey's tick can just miss it).
	const window = 20 * interval
	time.Sleep(window)
	tries := proxy.Hits(refused)
	t.Logf("%d renames refused in %s of surveys every %s", tries, window, interval)
	if tries < 2 {
		t.Fatalf("%d resumes in %s: the survey stopped trying", tries, window)
	}
	if tries > 8 {
		t.Fatalf("%d resumes in %s of surveys every %s: no backoff", tries, window, interval)
	}

	proxy.Remove(refused)
	deadline := time.Now().Add(30 * time.Second)
	for {
		inst, _, err := h.client.GetInstance(ctxT(t), Name(o))
		if err == nil && inst.Config[keyWarmClaim] == Name(o) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the hand-out did not finish within 30 s of Incus taking renames again (%v)", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	h.checkOnePerOwner(t, []controller.Owner{o})
}
