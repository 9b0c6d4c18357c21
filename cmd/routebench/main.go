// Command routebench measures the data routes on the real Incus with the
// development guest, in one run, and prints a table:
//
//   - dial → upgraded latency of a paused target and of a stopped target
//     (median and p95 over -wakes wakes each, and whether each first dial
//     was upgraded rather than refused);
//   - round-trip latency of 64-byte messages (env/getIdle requests padded to
//     64 bytes), relayed through the route versus direct (the provider's own
//     GuestDialer connection to the same daemon), as a ratio from the same
//     run; and, as the floor any relay can reach, through a plain byte pipe
//     in the provider process that reads nothing;
//   - throughput of 64 KiB and 1 MiB messages, relayed versus direct:
//     downloads (pipelined fs/readFile answers of that size) and uploads
//     (notifications of that size, which the daemon reads and drops,
//     followed by one request as a barrier);
//   - memory per idle open relay: the provider's resident set growth over
//     -idle-relays relays opened and initialized, then left idle.
//
// It needs root (the netns GuestDialer), a running Incus and the development
// guest image (deploy/guest/build-image.sh). It works in an Incus project of
// its own, lsbench-<random>, and removes it, its instance and its child
// process when it ends, also on an error or Ctrl-C. Everything it dials is
// on loopback or inside the guest's own network namespace.
//
// Usage:
//
//	go build -o bin/routebench ./cmd/routebench
//	sudo bin/routebench [-wakes 20] [-rtt 2000] [-seconds 4s] [-idle-relays 1000] [-only wakes]
//
// Each wake's first dial is also divided by the provider's own clock
// (wake.Trace): the time inside Incus's unfreeze or start, the time
// waiting for the guest daemon, and the provider's own share, whose goal
// is ≤ 2 ms p50 (issue 25). -only wakes measures the wakes alone.
//
// The table goes to stdout, progress to stderr. Targets are the issue's:
// paused → upgraded p50 ≤ 50 ms; stopped → upgraded p50 ≤ 500 ms with the
// first dial upgraded; relayed round trip ≤ 1.5× direct; relayed 1 MiB
// throughput ≥ 0.9× direct; ≤ 64 KiB per idle relay. Each is reported as
// met or MISSED; the command fails only when it cannot measure.
//
// Cluster mode (issue 8) runs the same measurements on the cluster rig of
// deploy/dev/incus-cluster-up.sh, for two targets in one run:
//
//	sudo bin/routebench -cluster /run/incus-provider-dev/cluster/cluster.env -member lsm1 [-remote lsm3] [-owners 20]
//
// The provider child talks to the cluster over HTTPS (every member's URL,
// the rig's client certificate, the cluster certificate pinned) as a
// provider on -member would: guests on that member through netns, the
// others through exec. One target is placed on -member (the local
// baseline), one on -remote (default: the last other member), and each
// figure is reported for both with the remote/local ratio. Then -owners
// owners are created at once through the controller plane, their templates
// placed round-robin over every member, and closed again. The project is
// lsc-<random> (the rig's teardown sweeps that prefix: LXC names cgroups
// host-wide) and is removed at the end, also on an error or Ctrl-C.
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clock"
)

func main() {
	if os.Getenv(childEnv) == "1" {
		if err := runChild(); err != nil {
			fmt.Fprintln(os.Stderr, "routebench provider:", err)
			os.Exit(1)
		}
		return
	}
	var cfg benchConfig
	flag.IntVar(&cfg.wakes, "wakes", 20, "wakes measured from paused, and again from stopped (at least 20 for the report)")
	flag.IntVar(&cfg.rtt, "rtt", 2000, "round trips measured on each path")
	flag.DurationVar(&cfg.seconds, "seconds", 4*time.Second, "time spent on each throughput measurement, per path")
	flag.IntVar(&cfg.idleRelays, "idle-relays", 1000, "idle relays opened for the memory measurement")
	flag.StringVar(&cfg.socket, "incus-socket", "/var/lib/incus/unix.socket", "Incus unix socket")
	flag.StringVar(&cfg.socat, "socat", "socat", "socat binary for the relay floor (a C byte relay in the guest's namespace); empty to measure without it")
	flag.StringVar(&cfg.image, "image", "lightspeed-dev-guest", "image alias of the development guest")
	flag.StringVar(&cfg.cluster, "cluster", "", "settings file of the cluster rig (deploy/dev/incus-cluster-up.sh): measure on the cluster instead of -incus-socket")
	flag.StringVar(&cfg.member, "member", "", "with -cluster: the member the provider runs on (its guests through netns, the others through exec)")
	flag.StringVar(&cfg.remote, "remote", "", "with -cluster: the member of the remote target (default: the last member that is not -member)")
	flag.BoolVar(&cfg.forward, "forward", false, "with -cluster: reach the remote target through a second provider process standing for the replica on -remote (replica-to-replica forwarding, PROVIDER_PEERS) instead of exec")
	flag.StringVar(&cfg.lb, "lb", "", "with -cluster -forward: the HAProxy configuration (deploy/haproxy/incus-provider.cfg) to put in front of both provider processes; create → active is then measured through it, one controller connection per owner")
	flag.IntVar(&cfg.owners, "owners", 20, "with -cluster: owners created at once for create → active, spread round-robin over the members")
	flag.StringVar(&cfg.only, "only", "", "measure only this: \""+onlyWakes+"\" (the wakes from paused and from stopped, with their breakdown; single host)")
	flag.Parse()
	if cfg.only != "" && (cfg.only != onlyWakes || cfg.cluster != "") {
		fmt.Fprintf(os.Stderr, "routebench: -only takes %q, on a single host\n", onlyWakes)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	runMode := run
	if cfg.cluster != "" {
		runMode = runCluster
	}
	if err := runMode(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "routebench:", err)
		os.Exit(1)
	}
}

type benchConfig struct {
	wakes, rtt, idleRelays int
	seconds                time.Duration
	socket, image          string
	socat                  string

	cluster, member, remote string
	owners                  int
	forward                 bool
	lb                      string

	// only narrows the run to one measurement (onlyWakes), for quick
	// comparisons; empty measures everything.
	only string
}

const onlyWakes = "wakes"

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func run(ctx context.Context, cfg benchConfig) error {
	if os.Geteuid() != 0 {
		return errors.New("run as root: the netns GuestDialer enters the guests' network namespaces")
	}
	root, err := incus.New(incus.Config{Socket: cfg.socket})
	if err != nil {
		return err
	}
	defer root.Close()
	sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	srv, err := root.GetServer(sctx)
	if err != nil {
		return fmt.Errorf("incus at %s does not answer: %w", cfg.socket, err)
	}
	fp, err := root.GetImageAlias(sctx, cfg.image)
	if err != nil {
		return fmt.Errorf("image alias %q (build it with deploy/guest/build-image.sh): %w", cfg.image, err)
	}

	project := "lsbench-" + randomHex(4)
	if err := root.CreateProject(sctx, project, map[string]string{"features.images": "false", "features.profiles": "false"}); err != nil {
		return err
	}
	client := root.WithProject(project)
	defer removeProject(root, project)

	work, err := os.MkdirTemp("", "routebench-")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(work) }()
	tmplPath := filepath.Join(work, "templates.yaml")
	if err := os.WriteFile(tmplPath, []byte(fmt.Sprintf(`templates:
  - templateId: bench
    displayName: routebench guest
    powerStates: [running, paused, stopped]
    imageAlias: %s
`, cfg.image)), 0o600); err != nil {
		return err
	}
	credential := randomHex(16)

	child, addr, err := startChild(ctx, []string{"ROUTEBENCH_INCUS_SOCKET=" + cfg.socket, "ROUTEBENCH_PROJECT=" + project,
		"ROUTEBENCH_TEMPLATES=" + tmplPath, "ROUTEBENCH_CREDENTIAL=" + credential})
	if err != nil {
		return err
	}
	defer child.stop()

	loadBefore := loadAverage()
	dialer, err := guest.New(guest.KindNetns, guest.Options{Lookup: client.InitPID})
	if err != nil {
		return err
	}
	s := &session{cfg: cfg, addr: addr, credential: credential, incus: client, dialer: dialer}
	fmt.Fprintf(os.Stderr, "routebench: Incus %s, image %s (%.12s), project %s, provider at %s\n",
		srv.Environment.ServerVersion, cfg.image, fp, project, addr)
	if err := s.connect(ctx); err != nil {
		return err
	}
	defer s.close()
	b := &bench{session: s, template: "bench"}
	if err := b.create(ctx); err != nil {
		return err
	}
	defer b.tearDown()
	rep, err := b.measure(ctx)
	if err != nil {
		return err
	}
	rep.header = fmt.Sprintf("Incus %s, image %s (%.12s), GuestDialer netns, %d CPUs, load average %s at the start, %s at the end",
		srv.Environment.ServerVersion, cfg.image, fp, numCPU(), loadBefore, loadAverage())
	rep.print(os.Stdout)
	return nil
}

type childProc struct {
	cmd   *exec.Cmd
	stdin interface{ Close() error }
}

func (c *childProc) stop() {
	_ = c.stdin.Close()
	done := make(chan struct{})
	go func() { _ = c.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = c.cmd.Process.Kill()
		<-done
	}
}

// startChild starts the provider child with env (its ROUTEBENCH_*
// settings) added to this process's environment.
func startChild(ctx context.Context, env []string) (*childProc, string, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, "", err
	}
	// Not bound to ctx: on Ctrl-C the child must outlive the measurement
	// long enough to close the target; stop ends it.
	cmd := exec.CommandContext(context.WithoutCancel(ctx), self)
	cmd.Env = append(append(os.Environ(), childEnv+"=1"), env...)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, "", err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, "", err
	}
	if err := cmd.Start(); err != nil {
		return nil, "", err
	}
	c := &childProc{cmd: cmd, stdin: stdin}
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if addr, ok := strings.CutPrefix(sc.Text(), "ADDR "); ok {
				lines <- addr
			}
		}
		close(lines)
	}()
	select {
	case addr, ok := <-lines:
		if !ok {
			c.stop()
			return nil, "", errors.New("the provider child exited before serving")
		}
		return c, addr, nil
	case <-time.After(60 * time.Second):
		c.stop()
		return nil, "", errors.New("the provider child did not start serving within 60 s")
	case <-ctx.Done():
		c.stop()
		return nil, "", ctx.Err()
	}
}

// removeProject deletes every instance of the project, then the project,
// going round again for up to three minutes: on the cluster rig other
// tests kill and restart members, and a member that is down holds its
// instances until it is back.
func removeProject(root *incus.Client, project string) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c := root.WithProject(project)
	var err error
	for ctx.Err() == nil {
		insts, lerr := c.ListInstances(ctx)
		for _, inst := range insts {
			if inst.StatusCode != incus.StatusStopped {
				if op, err := c.UpdateInstanceState(ctx, inst.Name, incus.InstanceStatePut{Action: incus.ActionStop, Force: true}); err == nil {
					_, _ = c.Wait(ctx, op)
				}
			}
			if op, err := c.DeleteInstance(ctx, inst.Name); err == nil {
				_, _ = c.Wait(ctx, op)
			}
		}
		if err = root.DeleteProject(ctx, project); err == nil || errors.Is(err, incus.ErrNotFound) {
			return
		}
		if lerr == nil && len(insts) == 0 {
			// Nothing listed, yet not empty: let the server clear it out.
			if err = root.ForceDeleteProject(ctx, project); err == nil {
				return
			}
		}
		fmt.Fprintf(os.Stderr, "routebench: the project %s is not deleted yet, again in 2 s: %v\n", project, errors.Join(lerr, err))
		clock.Sleep(ctx, 2*time.Second)
	}
	fmt.Fprintf(os.Stderr, "routebench: could not delete the project %s: %v\n", project, err)
}

// loadAverage is the one-minute load average: numbers measured on a busy
// machine say more about the machine than about the relay.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0]
	}
	return "unknown"
}
