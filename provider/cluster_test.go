package provider_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"net"
	"net/http"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/conformance"
	"github.com/lightspeed-dev/incus-provider/controller"
	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
	"github.com/lightspeed-dev/incus-provider/internal/jsonrpc"
)

// These tests run the provider against the three-member cluster of
// deploy/dev/incus-cluster-up.sh (make test brings it up), as a provider on
// the first member: Incus over HTTPS with the cluster certificate pinned,
// guests on its own member through netns and on the others through exec.

const clusterTemplates = `templates:
  - templateId: on-lsm1
    displayName: guest on member lsm1
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    placement: lsm1
  - templateId: on-lsm2
    displayName: guest on member lsm2
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    placement: lsm2
  - templateId: on-lsm3
    displayName: guest on member lsm3
    powerStates: [running, paused, stopped]
    imageAlias: {{image}}
    placement: lsm3
  - templateId: idle-lsm3
    displayName: guest on lsm3 paused after 1.5 s idle
    powerStates: [running, paused, stopped]
    idle: {pauseAfterMs: 1500}
    imageAlias: {{image}}
    placement: lsm3
`

// countingDialer counts the dials that went its way.
type countingDialer struct {
	guest.Dialer
	n atomic.Int64
}

func (d *countingDialer) DialContext(ctx context.Context, t guest.Target) (net.Conn, error) {
	d.n.Add(1)
	return d.Dialer.DialContext(ctx, t)
}

// memberDialers are the two halves of the cluster rig's dialer, for tests
// that check which way a guest was reached.
var memberDialers = map[*testing.T][2]*countingDialer{}

func newMemberDialer(t *testing.T, member string, client *incus.Client) guest.Dialer {
	t.Helper()
	local, err := guest.New(guest.KindNetns, guest.Options{Lookup: client.InitPID})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := guest.New(guest.KindExec, guest.Options{Exec: func(ctx context.Context, instance string, argv []string) (net.Conn, error) {
		return client.ExecStream(ctx, instance, argv)
	}})
	if err != nil {
		t.Fatal(err)
	}
	l, r := &countingDialer{Dialer: local}, &countingDialer{Dialer: remote}
	memberDialers[t] = [2]*countingDialer{l, r}
	t.Cleanup(func() { delete(memberDialers, t) })
	return guest.NewMember(member, l, r)
}

func TestClusterGuestsOnEveryMember(t *testing.T) {
	cl := incustest.Cluster(t)
	r := newRig(t, rigOptions{cluster: cl})
	halves := memberDialers[t]
	for i, member := range cl.Members {
		local0, remote0 := halves[0].n.Load(), halves[1].n.Load()
		route := r.create("on-"+member, "on-"+member)
		inst, err := r.client.GetInstanceExpanded(r.ctx(), route.TargetID)
		if err != nil {
			t.Fatal(err)
		}
		if inst.Location != member {
			t.Fatalf("template on-%s placed its instance on %q", member, inst.Location)
		}
		for name, d := range inst.ExpandedDevices {
			if d["type"] == "nic" {
				t.Fatalf("%s has a network device %q: its daemon must be reachable by the provider's path alone", inst.Name, name)
			}
		}
		// Relay, then wake from paused and from stopped, each through a
		// route dial, on this member.
		ws := r.mustUpgrade(route)
		_ = ws.Close()
		for _, p := range []controller.Power{controller.PowerPaused, controller.PowerStopped} {
			r.power(route, p)
			d := r.dial(route)
			if d.Conn == nil {
				t.Fatalf("%s, %s: route refused: %+v after %s", member, p, d.Refusal, d.Elapsed)
			}
			initialize(t, d.Conn)
			_ = d.Conn.Close()
			t.Logf("member %s: dial of a %s target answered in %s", member, p, d.Elapsed)
		}
		local, remote := halves[0].n.Load()-local0, halves[1].n.Load()-remote0
		if i == 0 && (local == 0 || remote != 0) {
			t.Fatalf("the provider's own member's guest was dialled %d times through netns and %d through exec; want netns only", local, remote)
		}
		if i > 0 && (remote == 0 || local != 0) {
			t.Fatalf("member %s's guest was dialled %d times through netns and %d through exec; want exec only", member, local, remote)
		}
	}

	// The idle loop reaches a guest on another member and applies its policy.
	route := r.create("idle-on-lsm3", "idle-lsm3")
	start := time.Now()
	r.until(route.Owner, "paused by its idle policy", 30*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused
	})
	t.Logf("idle pause on lsm3 after %s", time.Since(start))
}

// memberCtl runs deploy/dev/incus-cluster-member.sh, the one way the rig
// kills and starts a member.
func memberCtl(t *testing.T, action, member string) {
	t.Helper()
	out, err := exec.Command("../deploy/dev/incus-cluster-member.sh", action, member).CombinedOutput()
	if err != nil {
		t.Fatalf("incus-cluster-member.sh %s %s: %v: %s", action, member, err, out)
	}
}

// TestClusterMemberDown kills the incusd of the member holding one target
// (its guests keep running, as after a daemon crash) and drives the
// provider from outside meanwhile: the target on a live member keeps
// working without pause; the one on the dead member is observed unknown,
// with a message naming its member, and never failed, closed or created
// again; its route answers 503 with Retry-After at once. With the member
// back, everything is as before.
func TestClusterMemberDown(t *testing.T) {
	cl := incustest.Cluster(t)
	// The cache's correcting list never comes within the test: the dead
	// member's target is observed unknown because the cache watches the
	// members' states (targets/cache.go, watchMembers).
	r := newRig(t, rigOptions{cluster: cl, cacheCorrection: time.Hour})
	live := r.create("down-live", "on-lsm1")
	dead := r.create("down-dead", "on-lsm3")
	before, _, err := r.client.GetInstance(r.ctx(), dead.TargetID)
	if err != nil {
		t.Fatal(err)
	}

	memberCtl(t, "kill", "lsm3")
	killed := time.Now()
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			memberCtl(t, "start", "lsm3")
		}
	})

	// Until the dead member's target is observed unknown: every answer is
	// unavailable or unknown or still active, never failed or closed.
	var unknownAfter time.Duration
	phases := map[controller.Phase]int{}
	refused := 0
	for deadline := time.Now().Add(60 * time.Second); ; {
		o, err := r.get(dead.Owner)
		if err == nil {
			phases[o.Phase]++
			switch o.Phase {
			case controller.PhaseFailed, controller.PhaseClosed, controller.PhaseClosing:
				t.Fatalf("%s after the member died: the target observed %s: %+v", time.Since(killed), o.Phase, o)
			case controller.PhaseUnknown:
				if !strings.Contains(o.Message, "lsm3") {
					t.Fatalf("the unknown observation does not name the member: %q", o.Message)
				}
				unknownAfter = time.Since(killed)
			}
		}
		if err != nil {
			refused++
		}
		if unknownAfter > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dead member's target was never observed unknown in 60 s (phases seen %v, last error %v)", phases, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("member killed -> its target observed unknown after %s (observations before: %v, errors before: %d)", unknownAfter, phases, refused)

	// The operator's view: the targets gauge names the member.
	for deadline := time.Now().Add(30 * time.Second); gaugeValue(t, r, "incus_provider_targets_by_member", map[string]string{"member": "lsm3", "phase": "unknown"}) != 1; {
		if time.Now().After(deadline) {
			t.Fatal("incus_provider_targets_by_member{member=lsm3,phase=unknown} never reached 1")
		}
		time.Sleep(200 * time.Millisecond)
	}

	// Meanwhile the live member's target serves, and the dead one's route
	// refuses at once, retryably.
	ws := r.mustUpgrade(live)
	_ = ws.Close()
	d := r.dial(dead)
	if d.Conn != nil {
		t.Fatal("the route of a target on a dead member upgraded")
	}
	if d.Refusal == nil || d.Refusal.Status != http.StatusServiceUnavailable || d.Refusal.RetryAfter <= 0 {
		t.Fatalf("route of a target on a dead member: %+v, want 503 with Retry-After", d.Refusal)
	}
	if d.Elapsed > 3*time.Second {
		t.Fatalf("the refusal took %s: nothing can change while the member is down, so it need not hold", d.Elapsed)
	}
	if o, err := r.get(dead.Owner); err != nil || o.Phase != controller.PhaseUnknown {
		t.Fatalf("a create for the owner would go through get first: %+v, %v", o, err)
	}
	// A create for the owner while its member is down answers the target it
	// has, never a second one.
	if o, err := r.call("target/create", controller.CreateParams{Owner: dead.Owner, TemplateID: "on-lsm3"}); err == nil && o.TargetID != dead.TargetID {
		t.Fatalf("create during the outage answered another target: %+v", o)
	}

	// A power request while the member is down answers in its bound, and
	// means what it says: refused (nothing changes), or accepted (and
	// carried out once the member is back).
	start := time.Now()
	_, perr := r.setPower(dead.Owner, controller.PowerPaused)
	if took := time.Since(start); took > 4*time.Second {
		t.Fatalf("setPower took %s while the member was down", took)
	}
	want := controller.PowerRunning
	if perr == nil {
		want = controller.PowerPaused
	}
	t.Logf("setPower paused during the outage: %v", perr)

	memberCtl(t, "start", "lsm3")
	restarted = true
	back := time.Now()
	r.until(dead.Owner, "active and "+string(want)+" again", 90*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == want && o.Message == ""
	})
	if want == controller.PowerPaused {
		r.power(dead, controller.PowerRunning)
	}
	t.Logf("member restarted -> its target active again after %s", time.Since(back))
	ws = r.mustUpgrade(dead)
	_ = ws.Close()
	after, _, err := r.client.GetInstance(r.ctx(), dead.TargetID)
	if err != nil {
		t.Fatal(err)
	}
	if after.Location != before.Location || after.CreatedAt != before.CreatedAt {
		t.Fatalf("the instance changed across the outage: %s created %s, now %s created %s", before.Location, before.CreatedAt, after.Location, after.CreatedAt)
	}
	list, err := r.client.ListInstances(r.ctx())
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 {
		t.Fatalf("%d instances after the outage, want the 2 targets", len(list))
	}
}

// TestClusterLeaderDown kills the cluster's database leader while the
// provider serves a target on another member: answers stay bounded while
// Incus elects a new leader, then every method and the route work again,
// without a restart of anything.
func TestClusterLeaderDown(t *testing.T) {
	cl := incustest.Cluster(t)
	r := newRig(t, rigOptions{cluster: cl})
	members, err := cl.Member(t, 0).ListClusterMembers(r.ctx())
	if err != nil {
		t.Fatal(err)
	}
	leader := ""
	for _, m := range members {
		if slices.Contains(m.Roles, "database-leader") {
			leader = m.ServerName
		}
	}
	if leader == "" {
		t.Fatalf("no database leader among %+v", members)
	}
	other := "lsm2"
	if leader == other {
		other = "lsm3"
	}
	route := r.create("leader-down", "on-"+other)

	memberCtl(t, "kill", leader)
	killed := time.Now()
	restarted := false
	t.Cleanup(func() {
		if !restarted {
			memberCtl(t, "start", leader)
		}
	})
	var longest, firstOK time.Duration
	failures, streak := 0, 0
	for deadline := killed.Add(60 * time.Second); streak < 5; {
		start := time.Now()
		o, err := r.get(route.Owner)
		took := time.Since(start)
		longest = max(longest, took)
		if took > 4*time.Second {
			t.Fatalf("target/get took %s while the leader was down (%v)", took, err)
		}
		if err == nil && o.Phase == controller.PhaseActive {
			if firstOK == 0 || streak == 0 {
				firstOK = time.Since(killed)
			}
			streak++
		} else {
			failures++
			streak = 0
		}
		if time.Now().After(deadline) {
			t.Fatalf("the target was not observed active again within 60 s of the leader's death (%d failed answers; last %+v, %v)", failures, o, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("leader %s killed: target/get answered within %s each, %d failed answers, served again from %s", leader, longest, failures, firstOK)
	// target/get may be answered from the observation cache throughout;
	// the route reaches a guest on another member through an Incus exec,
	// which waits for the new leader (about 7 s after the kill). Until
	// then it answers 503 with Retry-After, and a runtime dials again.
	ws := r.upgradeAsARuntime(route)
	_ = ws.Close()
	r.power(route, controller.PowerPaused)
	r.power(route, controller.PowerRunning)

	memberCtl(t, "start", leader)
	restarted = true
}

// TestClusterTwoReplicas runs two providers on one project, as replicas on
// members lsm1 and lsm2 would, each with its own relays, pending requests
// and reconciler, coordinated through Incus alone: concurrent creates and
// closes for one owner through both leave one instance and one answer, and
// concurrent dials of one sleeping target through both all succeed.
func TestClusterTwoReplicas(t *testing.T) {
	cl := incustest.Cluster(t)
	a := newRig(t, rigOptions{cluster: cl})
	b := newRig(t, rigOptions{cluster: cl, after: a, member: "lsm2"})
	replicas := []*rig{a, b}
	seed := testSeed(t)
	rnd := rand.New(rand.NewPCG(uint64(seed), 0))

	// Creates: eight owners, four creates each, spread over both replicas.
	const owners, each = 8, 4
	type answer struct {
		id  string
		err error
	}
	answers := make([][]answer, owners)
	var wg sync.WaitGroup
	var retried atomic.Int64
	for i := range owners {
		answers[i] = make([]answer, each)
		owner := controller.Owner{UniverseID: "u-replicas", EnvironmentID: "env-" + strconv.Itoa(i)}
		tmpl := []string{"on-lsm1", "on-lsm2", "on-lsm3"}[i%3]
		for j := range each {
			r := replicas[(i+j)%2]
			wg.Go(func() {
				// unavailable is retryable: the runtime retries it, so does this.
				var o controller.Observation
				var err error
				for range 20 {
					o, err = r.call("target/create", controller.CreateParams{Owner: owner, TemplateID: tmpl})
					if !isUnavailable(err) {
						break
					}
					retried.Add(1)
					time.Sleep(250 * time.Millisecond)
				}
				answers[i][j] = answer{o.TargetID, err}
			})
		}
	}
	wg.Wait()
	for i := range owners {
		owner := controller.Owner{UniverseID: "u-replicas", EnvironmentID: "env-" + strconv.Itoa(i)}
		for j, an := range answers[i] {
			if an.err != nil {
				t.Fatalf("owner %d, create %d: %v", i, j, an.err)
			}
			if an.id != "" && an.id != answers[i][0].id && answers[i][0].id != "" {
				t.Fatalf("owner %d: creates answered two targets, %s and %s", i, answers[i][0].id, an.id)
			}
		}
		a.until(owner, "active", 90*time.Second, func(o controller.Observation) bool {
			return o.Phase == controller.PhaseActive && o.Power == controller.PowerRunning
		})
	}
	t.Logf("%d creates through two replicas: one target per owner (%d answers unavailable and retried)", owners*each, retried.Load())
	list, err := a.client.ListInstances(a.ctx())
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != owners {
		t.Fatalf("%d instances for %d owners", len(list), owners)
	}

	// Dials of a paused target, half through each replica, at once.
	owner := controller.Owner{UniverseID: "u-replicas", EnvironmentID: "env-1"}
	o, err := a.get(owner)
	if err != nil {
		t.Fatal(err)
	}
	route := routeOf(owner, o.TargetID)
	a.power(route, controller.PowerPaused)
	events := watchLifecycle(t, a.client, route.TargetID)
	wakesBefore := []int{a.wakes(), b.wakes()}
	const dials = 8
	results := make([]conformance.RouteDial, dials)
	for i := range dials {
		r := replicas[i%2]
		wg.Go(func() {
			d, err := conformance.DialRoute(context.Background(), r.url(route), credential)
			if err != nil {
				t.Errorf("dial %d: %v", i, err)
			}
			results[i] = d
		})
	}
	wg.Wait()
	for i, d := range results {
		if d.Conn == nil {
			t.Fatalf("dial %d through replica %d refused: %+v after %s", i, i%2, d.Refusal, d.Elapsed)
		}
		initialize(t, d.Conn)
		_ = d.Conn.Close()
	}
	// Every dial was upgraded, so the target was resumed: its event is
	// awaited, not a fixed time.
	ev := events(30*time.Second, func(by map[string]int) bool { return by["instance-resumed"] > 0 })
	flights := []int{a.wakes() - wakesBefore[0], b.wakes() - wakesBefore[1]}
	t.Logf("%d dials of a paused target through two replicas: all upgraded; Incus resumed it %d times; wakes finished: replica A %d, B %d", dials, ev["instance-resumed"], flights[0], flights[1])
	// Each replica's dials share one wake. These replicas forward to no
	// peers, so across them nothing is shared before the unfreeze (replicas
	// that forward to each other hand the wake to one of them:
	// TestClusterOneWakeAcrossReplicas), and Incus's unfreeze takes no lock of its own: it
	// checks the instance is frozen, then thaws it (driver_lxc.go,
	// Unfreeze), so two replicas' unfreezes sent a moment apart may both
	// be carried out. Measured on this rig: five concurrent unfreezes of one
	// frozen instance through three members, 21 instance-resumed for 20
	// instance-paused. The target is still woken once: never paused or
	// stopped again in between.
	for i, n := range flights {
		if n > 1 {
			t.Fatalf("replica %d flew %d wakes for its %d dials of one paused target, want its dials to share one", i, n, dials/2)
		}
	}
	if got := ev["instance-resumed"]; got < 1 || got > flights[0]+flights[1] {
		t.Fatalf("concurrent dials through two replicas, %d and %d wakes, resumed the target %d times (events %v)", flights[0], flights[1], got, ev)
	}
	for _, down := range []string{"instance-paused", "instance-stopped", "instance-shutdown"} {
		if ev[down] != 0 {
			t.Fatalf("the target was powered down again while dials woke it (events %v)", ev)
		}
	}

	// Closes and creates for one owner through both replicas at once, in a
	// seeded order: the owner ends with at most one instance, closed or
	// active, never two.
	owner = controller.Owner{UniverseID: "u-replicas", EnvironmentID: "env-2"}
	ops := []string{"target/close", "target/close", "target/create", "target/create"}
	rnd.Shuffle(len(ops), func(i, j int) { ops[i], ops[j] = ops[j], ops[i] })
	for i, m := range ops {
		r := replicas[i%2]
		wg.Go(func() {
			var err error
			if m == "target/close" {
				_, err = r.closeTarget(owner)
			} else {
				_, err = r.call(m, controller.CreateParams{Owner: owner, TemplateID: "on-lsm3"})
			}
			if err != nil {
				t.Logf("%s through replica %d: %v", m, i%2, err)
			}
		})
	}
	wg.Wait()
	deadline := time.Now().Add(90 * time.Second)
	for {
		o, err := a.get(owner)
		var rpcErr *jsonrpc.Error
		if errors.As(err, &rpcErr) && rpcErr.Kind == jsonrpc.KindNotFound {
			t.Logf("order %v: the owner ends with nothing (closed)", ops)
			break
		}
		if err == nil && o.Phase == controller.PhaseActive && o.Message == "" {
			t.Logf("order %v: the owner ends active", ops)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("order %v: the owner never settled: %+v, %v", ops, o, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	list, err = a.client.ListInstances(a.ctx())
	if err != nil {
		t.Fatal(err)
	}
	if len(list) > owners {
		t.Fatalf("%d instances for %d owners after the close/create race", len(list), owners)
	}
}

// isUnavailable says a controller call was answered unavailable.
func isUnavailable(err error) bool {
	var e *jsonrpc.Error
	return errors.As(err, &e) && e.Kind == jsonrpc.KindUnavailable
}

// gaugeValue is the value of the gauge series whose labels include all of
// want (-1 when there is none).
func gaugeValue(t *testing.T, r *rig, name string, want map[string]string) float64 {
	t.Helper()
	ms := r.series(name, want)
	if len(ms) == 0 {
		return -1
	}
	return ms[0].GetGauge().GetValue()
}

// TestClusterReplicaPowerDown: replica A relays a data connection to a
// target; a setPower paused through replica B first closes A's relay with
// a going-away frame, then pauses the target; and no replica's idle loop
// powers a target down while another replica relays to it.
func TestClusterReplicaPowerDown(t *testing.T) {
	cl := incustest.Cluster(t)
	a := newRig(t, rigOptions{cluster: cl})
	b := newRig(t, rigOptions{cluster: cl, after: a, member: "lsm2"})
	t0 := time.Now()

	route := a.create("replica-drain", "on-lsm2")
	t.Logf("created; %s into the test", time.Since(t0))
	ws := a.mustUpgrade(route)
	// A's lease is on the instance within leaseWatch of the relay.
	for deadline := time.Now().Add(5 * time.Second); ; {
		inst, _, err := a.client.GetInstance(a.ctx(), route.TargetID)
		if err != nil {
			t.Fatal(err)
		}
		if countPrefix(inst.Config, "user.lightspeed.relays.") == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no relay lease on the instance 5 s after replica A's relay opened: %v", inst.Config)
		}
		time.Sleep(50 * time.Millisecond)
	}
	start := time.Now()
	o, err := b.setPower(route.Owner, controller.PowerPaused)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("setPower paused through B answered: %s %s %q", o.Phase, o.Power, o.Message)
	awaitGoingAway(t, ws)
	closedAfter := time.Since(start)
	b.until(route.Owner, "paused", 30*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused && o.Message == ""
	})
	t.Logf("A's relay got going-away %s after B's setPower; paused after %s", closedAfter, time.Since(start))
	// A's lease is gone with its relay.
	for deadline := time.Now().Add(5 * time.Second); ; {
		inst, _, err := a.client.GetInstance(a.ctx(), route.TargetID)
		if err != nil {
			t.Fatal(err)
		}
		if countPrefix(inst.Config, "user.lightspeed.relays.") == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica A's lease outlived its relay by 5 s: %v", inst.Config)
		}
		time.Sleep(50 * time.Millisecond)
	}

	// Idle: a target paused after 1.5 s idle stays running for as long as
	// A relays to it, though B's idle loop finds its daemon idle.
	t.Logf("lease gone; %s into the test", time.Since(t0))
	idleRoute := b.create("replica-idle", "idle-lsm3")
	t.Logf("idle target created; %s into the test", time.Since(t0))
	ws = a.mustUpgrade(idleRoute)
	time.Sleep(6 * time.Second)
	if o, err := b.get(idleRoute.Owner); err != nil || o.Power != controller.PowerRunning {
		t.Fatalf("a target another replica relays to was powered down by idle: %+v, %v", o, err)
	}
	_ = ws.Close()
	b.until(idleRoute.Owner, "paused by idle once A's relay closed", 40*time.Second, func(o controller.Observation) bool {
		return o.Phase == controller.PhaseActive && o.Power == controller.PowerPaused
	})
	t.Logf("paused by idle; %s into the test", time.Since(t0))
}

func countPrefix(m map[string]string, prefix string) int {
	n := 0
	for k := range m {
		if strings.HasPrefix(k, prefix) {
			n++
		}
	}
	return n
}
