package targets

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/templates"
)

// The reads of the provider's metadata that run once per instance of the
// project: the idle loop's inventory, the reconciler's pass, the ingress
// index's rebuild, and a get's observation. At 10,000 targets each is paid
// 10,000 times a period, so they are measured without Incus, on instances
// as the observation cache keeps them (user.* keys only).
//
//	go test -run '^$' -bench 'Decode' -benchmem ./targets/

const decodeBenchTargets = 10000

// decodeBenchInstances are n targets in the mix a busy project has: most
// running with a create's metadata, some powered down by the idle loop,
// some with another replica's relay lease, some routed for ingress, a few
// closing.
func decodeBenchInstances(n int) []incus.Instance {
	created := time.Now().Add(-time.Hour)
	ms := func(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }
	out := make([]incus.Instance, n)
	for i := range out {
		o := controller.Owner{UniverseID: "u-bench", EnvironmentID: fmt.Sprintf("env-%06d", i)}
		config := map[string]string{
			"user.lightspeed.schema":        "1",
			"user.lightspeed.universe":      o.UniverseID,
			"user.lightspeed.environment":   o.EnvironmentID,
			"user.lightspeed.template":      "bench",
			"user.lightspeed.image":         "abababababababababababababababababababababababababababababababab",
			"user.lightspeed.daemon_port":   "19091",
			"user.lightspeed.created_at_ms": ms(created),
			"user.lightspeed.booted_at_ms":  ms(created.Add(1200 * time.Millisecond)),
			"user.lightspeed.idle":          `{"pauseAfterMs":3600000,"stopAfterMs":7200000,"closeAfterMs":86400000}`,
			"user.lightspeed.power":         "running",
			"user.lightspeed.power_at_ms":   ms(created),
			"user.lightspeed.power_by":      "create",
		}
		status := incus.InstanceRunning
		switch {
		case i%10 == 1:
			status = incus.InstanceFrozen
			config["user.lightspeed.power"], config["user.lightspeed.power_by"] = "paused", "idle"
			config["user.lightspeed.idle_since_ms"] = ms(created.Add(time.Minute))
		case i%10 == 2:
			config["user.lightspeed.relays.r-other"] = ms(time.Now().Add(time.Minute))
		case i%10 == 3:
			config["user.lightspeed.ingress_label"] = benchLabel(i)
			config["user.lightspeed.ingress_routed"] = "true"
			config["user.lightspeed.ingress_port"] = "8080"
		case i%100 == 4:
			config["user.lightspeed.closing_since_ms"] = ms(time.Now())
		}
		out[i] = incus.Instance{Name: Name(o), Type: "container", Status: status, Config: config,
			CreatedAt: created, LastUsedAt: created}
	}
	return out
}

// decodeBenchService is a service that never reaches Incus, with the
// bench template.
func decodeBenchService(b *testing.B) *Service {
	b.Helper()
	p := filepath.Join(b.TempDir(), "templates.yaml")
	body := `templates:
  - templateId: bench
    displayName: bench guest
    powerStates: [running, paused, stopped]
    imageFingerprint: ` + fakeFingerprint + "\n"
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		b.Fatal(err)
	}
	cat, err := templates.Load(p)
	if err != nil {
		b.Fatal(err)
	}
	if err := cat.Resolve(context.Background(), fakeImages{}); err != nil {
		b.Fatal(err)
	}
	client, err := incus.New(incus.Config{Socket: "/nonexistent/unix.socket"})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(client.Close)
	return mustNew(b, client, cat, nopDialer{}, zap.NewNop(), Config{NoCache: true, Replica: "r-self"})
}

func BenchmarkDecodeIdleTargets(b *testing.B) {
	s := decodeBenchService(b)
	list := decodeBenchInstances(decodeBenchTargets)
	b.ReportAllocs()
	for b.Loop() {
		n := 0
		for i := range list {
			if _, ok := s.idleTargetOf(&list[i]); ok {
				n++
			}
		}
		if n != len(list) {
			b.Fatalf("%d of %d instances read as targets", n, len(list))
		}
	}
}

// BenchmarkDecodePass is what a reconcile pass reads of every instance
// (ownerOf, needsWork, landedAfterClosed, forgetStaleLease's look).
func BenchmarkDecodePass(b *testing.B) {
	s := decodeBenchService(b)
	list := decodeBenchInstances(decodeBenchTargets)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		work := 0
		for i := range list {
			inst := &list[i]
			if _, ok := ownerOf(inst); !ok {
				b.Fatal("not a target")
			}
			if needsWork(inst) || s.landedAfterClosed(inst) {
				work++
			}
			s.forgetStaleLease(ctx, inst)
		}
		if work == 0 {
			b.Fatal("no instance needs work")
		}
	}
}

func BenchmarkDecodeObserve(b *testing.B) {
	list := decodeBenchInstances(decodeBenchTargets)
	owners := make([]controller.Owner, len(list))
	for i := range list {
		owners[i], _ = ownerOf(&list[i])
	}
	b.ReportAllocs()
	for b.Loop() {
		for i := range list {
			if err := checkOwned(&list[i], owners[i]); err != nil {
				b.Fatal(err)
			}
			_ = Observe(&list[i], owners[i])
		}
	}
}

func BenchmarkDecodeIngressRebuild(b *testing.B) {
	list := decodeBenchInstances(decodeBenchTargets)
	var x ingressIndex
	x.init()
	b.ReportAllocs()
	for b.Loop() {
		x.rebuild(list, x.mark(), nil)
	}
	if len(x.byLabel) != decodeBenchTargets/10 {
		b.Fatalf("%d routes, want %d", len(x.byLabel), decodeBenchTargets/10)
	}
}

// benchLabel is a valid ingress label of its own for each i.
func benchLabel(i int) string {
	b := []byte("aaaaaaaaaaaaaaaaaaaaaaaaaa")
	for j := len(b) - 1; i > 0; j-- {
		b[j] = byte('a' + i%26)
		i /= 26
	}
	return string(b)
}
