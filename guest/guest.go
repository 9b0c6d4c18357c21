package guest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
)

// DefaultPort is the port the guest daemon listens on, on the guest loopback.
// It is the only definition: a template that names no daemonPort, and
// lsenvd-dev without --listen, take it from here, so the two cannot drift.
const DefaultPort = 19091

// Dialer kinds accepted by New.
const (
	KindNetns = "netns"
	KindProxy = "proxy"
	KindExec  = "exec"
	// KindMember is netns for guests on the provider's own cluster member
	// and exec for the rest (NewMember).
	KindMember = "member"
)

// DefaultKind is the dialer the provider uses unless configured otherwise.
// It was chosen by measurement (see the package tests, TestMeasure): with no
// device on the instance, a stopped container starts about a second faster
// than one carrying a proxy device, and a netns dial costs well under a
// millisecond.
const DefaultKind = KindNetns

// Kinds lists the accepted dialer kinds, in the order they are documented.
var Kinds = []string{KindNetns, KindProxy, KindExec, KindMember}

// ErrNotRunning is matched (errors.Is) by errors for instances that have no
// init process, i.e. are stopped.
var ErrNotRunning = errors.New("instance is not running")

// Target names a guest: the Incus instance and the daemon's port on the guest
// loopback.
type Target struct {
	Instance string
	Port     int
	// Location is the cluster member that holds the instance (Incus's
	// location field); empty or "none" on a standalone server.
	Location string
}

func (t Target) String() string { return fmt.Sprintf("%s:%d", t.Instance, t.Port) }

// validate checks the fields every dialer relies on. Instance names end up in
// file names (proxy) and error messages, so anything that is not a plausible
// Incus instance name is refused.
func (t Target) validate() error {
	if t.Instance == "" {
		return errors.New("guest: empty instance name")
	}
	if t.Instance == "." || t.Instance == ".." || strings.ContainsAny(t.Instance, "/\x00") {
		return fmt.Errorf("guest: invalid instance name %q", t.Instance)
	}
	if t.Port < 1 || t.Port > 65535 {
		return fmt.Errorf("guest: instance %q: port %d out of range 1-65535", t.Instance, t.Port)
	}
	return nil
}

// Dialer opens streams to the daemon inside a guest. Implementations are safe
// for concurrent use.
type Dialer interface {
	// DialContext opens a stream to the daemon inside the guest. Bounded by
	// ctx. Success means a stream exists, not that the daemon answers (see the
	// package documentation on frozen guests).
	DialContext(ctx context.Context, t Target) (net.Conn, error)
	// Devices returns the Incus devices an instance needs at creation for
	// this dialer to work (nil for netns). The map is fresh on every call;
	// the caller may merge it into its own devices.
	Devices(t Target) map[string]map[string]string
	// Forget drops any cached per-instance state (call when an instance
	// stops, restarts or is deleted).
	Forget(instance string)
	// Name returns the kind: "netns" or "proxy".
	Name() string
}

// remover is implemented by dialers that leave something on the host for
// each instance (the proxy dialer's socket file).
type remover interface{ Removed(instance string) }

// Removed tells d that the instance is deleted for good, so that whatever
// it keeps on the host for it can go.
func Removed(d Dialer, instance string) {
	switch v := d.(type) {
	case remover:
		v.Removed(instance)
	case *memberDialer:
		Removed(v.local, instance)
		Removed(v.remote, instance)
	case *forwardDialer:
		Removed(v.fallback, instance)
	}
}

// ErrDeviceDown: the dialer's way to the daemon is an Incus device on the
// host, and nothing listens there. For an instance that runs, the device is
// dead (RestartedDevice says how to restart it); for one that does not, it
// is what stopped means.
var ErrDeviceDown = errors.New("guest: the daemon's device on the host does not listen")

// deviceRestarter is implemented by dialers whose way to the daemon is an
// Incus device the server can leave dead while the instance runs.
type deviceRestarter interface {
	restartedDevice(devices map[string]map[string]string) (string, map[string]string, bool)
}

// RestartedDevice says which of the instance's devices d reaches the daemon
// through, and the config to write to make the server restart it (the same
// device to the guest). ok is false for a dialer with no such device.
func RestartedDevice(d Dialer, devices map[string]map[string]string) (name string, config map[string]string, ok bool) {
	switch v := d.(type) {
	case deviceRestarter:
		return v.restartedDevice(devices)
	case *memberDialer:
		return RestartedDevice(v.local, devices)
	case *forwardDialer:
		return RestartedDevice(v.fallback, devices)
	}
	return "", nil, false
}

// PIDLookup returns the instance's init PID as the host sees it (from GET
// /1.0/instances/NAME/state, field .pid; 0 or -1 when stopped). It is
// supplied by the caller, who owns the Incus client and the project.
type PIDLookup func(ctx context.Context, instance string) (int, error)

// Options are what the dialers need; each kind uses its part.
type Options struct {
	// Lookup finds an instance's init PID (netns, member).
	Lookup PIDLookup
	// SocketDir holds the proxy devices' sockets (proxy).
	SocketDir string
	// Exec runs the bridge in a guest (exec, member).
	Exec Execer
	// Bridge is the exec dialer's command, the port appended; nil means
	// DefaultBridge.
	Bridge []string
	// Member is the cluster member this provider runs on (member): its
	// guests are dialled through netns, the others through their member's
	// peer replica (Peers) or exec.
	Member string
	// Located finds an instance's init PID and member together (member):
	// the member dialer's netns side enters only its own member's PIDs.
	Located LocatedLookup
	// Peers maps other members to their replicas' forwarding addresses
	// (member; see NewForward), PeerSecret is the replicas' shared secret,
	// and ObserveForward is told of each forwarded dial.
	Peers          map[string]string
	PeerSecret     []byte
	PeerSecrets    *PeerSecrets // when set, in PeerSecret's place: replaceable
	ObserveForward func(member, outcome string, reason error)
}

// New returns the dialer of the given kind (one of Kinds). Unlike NewNetns,
// NewProxy and NewExec it checks the prerequisites up front: netns needs a
// lookup and the privileges to enter other network namespaces, proxy needs
// a usable socket directory, exec needs Incus's exec, member needs all of
// netns and exec and the member's name.
func New(kind string, o Options) (Dialer, error) {
	switch kind {
	case KindNetns:
		if o.Lookup == nil {
			return nil, errors.New("guest: the netns dialer needs a PID lookup")
		}
		if err := netnsSupported(); err != nil {
			return nil, fmt.Errorf("guest: the netns dialer cannot work here (use %q or %q instead): %w", KindProxy, KindExec, err)
		}
		return NewNetns(o.Lookup), nil
	case KindProxy:
		p, err := newProxy(o.SocketDir)
		if err != nil {
			return nil, err
		}
		return p, nil
	case KindExec:
		if o.Exec == nil {
			return nil, errors.New("guest: the exec dialer needs Incus's exec")
		}
		return NewExec(o.Exec, o.Bridge), nil
	case KindMember:
		if o.Member == "" {
			return nil, errors.New("guest: the member dialer needs the name of the cluster member the provider runs on")
		}
		if o.Located != nil {
			o.Lookup = OnMember(o.Member, o.Located)
		}
		local, err := New(KindNetns, o)
		if err != nil {
			return nil, fmt.Errorf("guest: the member dialer dials its own member's guests through netns: %w", err)
		}
		remote, err := New(KindExec, o)
		if err != nil {
			return nil, err
		}
		if len(o.Peers) > 0 {
			// One list for every replica: this member's own entry is
			// this process, and its guests are dialled directly.
			others := make(map[string]string, len(o.Peers))
			for m, a := range o.Peers {
				if m != o.Member {
					others[m] = a
				}
			}
			remote, err = NewForward(ForwardOptions{Peers: others, Secrets: o.PeerSecrets, Secret: o.PeerSecret, Fallback: remote, Observe: o.ObserveForward})
			if err != nil {
				return nil, err
			}
		}
		return NewMember(o.Member, local, remote), nil
	default:
		return nil, fmt.Errorf("guest: unknown dialer kind %q: allowed values are %s", kind, strings.Join(Kinds, ", "))
	}
}
