// Package incustest lets tests run against the real Incus daemon on this
// machine: a gate that skips (or fails) when there is none, a throwaway
// project per test that is emptied and deleted when the test ends, and the
// image to launch.
//
// Environment:
//
//	INCUS_PROVIDER_TEST_SOCKET   unix socket (default /var/lib/incus/unix.socket)
//	INCUS_PROVIDER_TEST_IMAGE    image alias to launch (default lightspeed-dev-guest)
//	INCUS_PROVIDER_REQUIRE_INCUS "1": no daemon, or no image, fails the test instead of skipping it
package incustest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/clusterenv"
)

const (
	EnvSocket  = "INCUS_PROVIDER_TEST_SOCKET"
	EnvImage   = "INCUS_PROVIDER_TEST_IMAGE"
	EnvRequire = "INCUS_PROVIDER_REQUIRE_INCUS"

	DefaultSocket = "/var/lib/incus/unix.socket"
	DefaultImage  = "lightspeed-dev-guest"

	// ProjectPrefix starts the name of every project Client creates, so
	// that leftovers of a killed test run are easy to spot.
	ProjectPrefix = "lsit-"
)

// cleanupTimeout bounds emptying and deleting a test project.
const cleanupTimeout = 3 * time.Minute

// Socket is the socket the tests use.
func Socket() string {
	if s := os.Getenv(EnvSocket); s != "" {
		return s
	}
	return DefaultSocket
}

// Server returns a client for the default project after checking that the
// daemon answers and trusts us; otherwise the test is skipped, or failed when
// INCUS_PROVIDER_REQUIRE_INCUS=1. Use Client for anything that creates
// objects.
func Server(t testing.TB) *incus.Client {
	t.Helper()
	c, err := incus.New(incus.Config{Socket: Socket(), CallTimeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("incustest: %v", err)
	}
	if _, err := os.Stat(Socket()); err != nil {
		unavailable(t, fmt.Sprintf("no Incus socket: %v", err))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv, err := c.GetServer(ctx)
	if err == nil && srv.Auth != "trusted" {
		err = fmt.Errorf("server says auth=%q", srv.Auth)
	}
	if err != nil {
		unavailable(t, fmt.Sprintf("Incus at %s not usable: %v", Socket(), err))
	}
	t.Cleanup(c.Close)
	return c
}

// Client returns a client working in a fresh project named lsit-<random>,
// with features.images=false and features.profiles=false so that the default
// project's images and "default" profile (root disk) are used. When the test
// ends, every instance in the project is force-stopped and deleted and the
// project is deleted; whatever is left behind fails the test.
func Client(t testing.TB) *incus.Client {
	t.Helper()
	root := Server(t)
	name := ProjectPrefix + randomHex(4)

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Every test instance takes its root disk from the default profile:
	// without one, each create fails alike, which says nothing of why.
	prof, err := root.GetProfile(ctx, "default")
	if err != nil {
		t.Fatalf("incustest: %v", err)
	}
	if d := prof.Devices["root"]; d["type"] != "disk" || d["path"] != "/" {
		t.Fatalf("incustest: the default profile has no root disk (devices %v): deploy/dev/incus-up.sh adds one; "+
			"a forced delete of a project sharing the profile empties it on Incus 6.0.4 (lxc/incus#2416)", prof.Devices)
	}
	want := map[string]string{"features.images": "false", "features.profiles": "false"}
	if err := root.CreateProject(ctx, name, want); err != nil {
		t.Fatalf("incustest: %v", err)
	}
	t.Cleanup(func() { removeProject(t, root, name) })

	p, err := root.GetProject(ctx, name)
	if err != nil {
		t.Fatalf("incustest: %v", err)
	}
	for k, v := range want {
		if p.Config[k] != v {
			t.Fatalf("incustest: project %s: config %s=%q, want %q", name, k, p.Config[k], v)
		}
	}
	return root.WithProject(name)
}

// Image returns the alias of the image tests launch, after checking that it
// exists (a missing image skips the test, or fails it when
// INCUS_PROVIDER_REQUIRE_INCUS=1).
func Image(t testing.TB) string {
	t.Helper()
	alias := os.Getenv(EnvImage)
	if alias == "" {
		alias = DefaultImage
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := Server(t).GetImageAlias(ctx, alias); err != nil {
		if errors.Is(err, incus.ErrNotFound) {
			unavailable(t, fmt.Sprintf("image alias %q not found (import it, or set %s)", alias, EnvImage))
		}
		t.Fatalf("incustest: %v", err)
	}
	return alias
}

func unavailable(t testing.TB, reason string) {
	t.Helper()
	if os.Getenv(EnvRequire) == "1" {
		t.Fatalf("incustest: %s (%s=1)", reason, EnvRequire)
	}
	t.Skipf("incustest: skipping: %s; set %s=1 to fail instead", reason, EnvRequire)
}

// removeProject empties and deletes a test project. It runs in t.Cleanup,
// when t.Context() is already cancelled, hence its own context.
func removeProject(t testing.TB, root *incus.Client, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), cleanupTimeout)
	defer cancel()
	c := root.WithProject(name)

	// A test that ends while a create or start is still running leaves the
	// instance busy; wait those operations out before stopping and deleting,
	// and go round again for anything a late operation brought back.
	for attempt := 0; attempt < 3; attempt++ {
		settle(ctx, c)
		insts, err := c.ListInstances(ctx)
		if err != nil {
			t.Errorf("incustest: cleanup: %v", err)
			break
		}
		if len(insts) == 0 {
			break
		}
		for _, inst := range insts {
			if inst.StatusCode != incus.StatusStopped {
				op, err := c.UpdateInstanceState(ctx, inst.Name, incus.InstanceStatePut{Action: incus.ActionStop, Force: true})
				if err == nil {
					_, err = c.Wait(ctx, op)
				}
				if err != nil {
					t.Logf("incustest: cleanup: force stop %s: %v", inst.Name, err)
				}
			}
			op, err := c.DeleteInstance(ctx, inst.Name)
			if err == nil {
				_, err = c.Wait(ctx, op)
			}
			if err != nil && !errors.Is(err, incus.ErrNotFound) {
				t.Logf("incustest: cleanup: delete %s: %v", inst.Name, err)
			}
		}
	}

	err := root.DeleteProject(ctx, name)
	if err == nil || errors.Is(err, incus.ErrNotFound) {
		return
	}
	// Something survived the loop above; let the server clear it out.
	if ferr := root.ForceDeleteProject(ctx, name); ferr != nil && !errors.Is(ferr, incus.ErrNotFound) {
		t.Errorf("incustest: cleanup: project %s left behind: %v (forced: %v)", name, err, ferr)
		return
	}
	t.Logf("incustest: cleanup: project %s needed a forced delete: %v", name, err)
}

// settle waits, within ctx, for the project's running operations to end.
func settle(ctx context.Context, c *incus.Client) {
	ops, err := c.ListOperations(ctx)
	if err != nil {
		return
	}
	for i := range ops {
		if ops[i].Class == "websocket" {
			// An exec (the exec dialer's bridge) ends with its instance,
			// and never while the instance is frozen: the force stop that
			// follows ends it.
			continue
		}
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		_, _ = c.Wait(wctx, &ops[i])
		cancel()
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}

// EnvClusterFile names the settings file deploy/dev/incus-cluster-up.sh
// writes (default DefaultClusterFile); EnvRequireCluster "1" makes a missing
// cluster fail the test instead of skipping it (make test sets it).
const (
	EnvClusterFile     = "INCUS_PROVIDER_TEST_CLUSTER_ENV"
	EnvRequireCluster  = "INCUS_PROVIDER_REQUIRE_CLUSTER"
	DefaultClusterFile = clusterenv.DefaultPath

	// ClusterProjectPrefix starts the projects ClusterClient makes: LXC
	// names a container's cgroup after its project and name on the whole
	// host, which the rig shares with the ordinary daemon.
	ClusterProjectPrefix = "lsc-"
)

// ClusterRig is the three-member cluster of deploy/dev/incus-cluster-up.sh.
type ClusterRig struct {
	// Config reaches the cluster over HTTPS (every member's URL, the rig's
	// client certificate, the cluster certificate pinned), in the default
	// project.
	Config incus.Config
	// URLs, Members, Sockets and PIDs list the members in one order.
	URLs    []string
	Members []string
	Sockets []string
	PIDs    []int
}

// Cluster reads the rig's settings and checks that every member answers;
// otherwise the test is skipped, or failed with
// INCUS_PROVIDER_REQUIRE_CLUSTER=1.
func Cluster(t testing.TB) *ClusterRig {
	t.Helper()
	// make test runs the cluster's tests in a lane of their own, chosen by
	// name (-run '^TestCluster'); a cluster test named otherwise would run
	// in no lane, or in the single-host lane without its rig.
	if !strings.HasPrefix(t.Name(), "TestCluster") {
		t.Fatalf("incustest: %s uses the cluster rig, so its name must begin with TestCluster (deploy/dev/test.sh chooses the cluster lane by name)", t.Name())
	}
	path := os.Getenv(EnvClusterFile)
	if path == "" {
		path = DefaultClusterFile
	}
	missing := func(why string) {
		t.Helper()
		if os.Getenv(EnvRequireCluster) == "1" {
			t.Fatalf("incustest: no cluster rig: %s (%s=1; deploy/dev/incus-cluster-up.sh makes one)", why, EnvRequireCluster)
		}
		t.Skipf("incustest: skipping: no cluster rig: %s; run deploy/dev/incus-cluster-up.sh, and set %s=1 to fail instead", why, EnvRequireCluster)
	}
	st, err := clusterenv.Read(path)
	if err != nil {
		missing(err.Error())
	}
	r := &ClusterRig{URLs: st.URLs, Members: st.Members, Sockets: st.Sockets, PIDs: st.PIDs}
	r.Config = incus.Config{URLs: r.URLs, ClientCert: st.ClientCert, ClientKey: st.ClientKey,
		ServerCert: st.ServerCert, CallTimeout: 30 * time.Second}
	for i, s := range r.Sockets {
		c, err := incus.New(incus.Config{Socket: s, CallTimeout: 5 * time.Second})
		if err != nil {
			t.Fatalf("incustest: %v", err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err = c.GetServer(ctx)
		cancel()
		c.Close()
		if err != nil {
			missing(fmt.Sprintf("member %s does not answer: %v", r.Members[i], err))
		}
	}
	return r
}

// Member returns a client of one member's unix socket, default project.
func (r *ClusterRig) Member(t testing.TB, i int) *incus.Client {
	t.Helper()
	c, err := incus.New(incus.Config{Socket: r.Sockets[i], CallTimeout: 30 * time.Second})
	if err != nil {
		t.Fatalf("incustest: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// Client returns a client of the cluster over HTTPS in a fresh project
// (lsc-<random>, sharing the default project's images and profile), which
// is emptied and deleted when the test ends, through member 0's socket.
func (r *ClusterRig) Client(t testing.TB) *incus.Client {
	t.Helper()
	root := r.Member(t, 0)
	name := ClusterProjectPrefix + randomHex(4)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := root.CreateProject(ctx, name, map[string]string{"features.images": "false", "features.profiles": "false"}); err != nil {
		t.Fatalf("incustest: %v", err)
	}
	t.Cleanup(func() { removeProject(t, root, name) })
	cfg := r.Config
	cfg.Project = name
	c, err := incus.New(cfg)
	if err != nil {
		t.Fatalf("incustest: cluster client: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}
