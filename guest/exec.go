package guest

import (
	"context"
	"fmt"
	"net"
	"strconv"
)

// Execer runs a command in an instance with its stdin and stdout joined into
// one stream (incus.Client.ExecStream); Close of the stream ends the command.
type Execer func(ctx context.Context, instance string, argv []string) (net.Conn, error)

// DefaultBridge is the command the exec dialer runs in the guest, with the
// daemon's port appended: BusyBox's nc (or netcat-openbsd's) copies bytes
// between its stdio and the daemon's loopback socket and nothing else.
var DefaultBridge = []string{"nc", "127.0.0.1"}

type execDialer struct {
	exec   Execer
	bridge []string
}

// NewExec returns a Dialer that reaches the daemon through the Incus API
// alone: each dial starts the bridge command in the guest (an exec with
// stdin and stdout on websockets) and the stream is that command's stdio. It
// works for an instance on any cluster member, needs no device, no network
// and no privilege on the instance's host, and puts the daemon on no
// network; the price is an exec per connection (tens of milliseconds, see
// TestMeasure) and every byte crossing incusd. The guest image must carry
// the bridge (nc by default). bridge nil means DefaultBridge.
func NewExec(exec Execer, bridge []string) Dialer {
	if len(bridge) == 0 {
		bridge = DefaultBridge
	}
	return &execDialer{exec: exec, bridge: append([]string(nil), bridge...)}
}

func (d *execDialer) Name() string                                { return KindExec }
func (d *execDialer) Devices(Target) map[string]map[string]string { return nil }
func (d *execDialer) Forget(string)                               {}

func (d *execDialer) DialContext(ctx context.Context, t Target) (net.Conn, error) {
	if err := t.validate(); err != nil {
		return nil, err
	}
	if d.exec == nil {
		return nil, fmt.Errorf("guest: exec dial %s: no Incus exec configured", t)
	}
	argv := append(append([]string(nil), d.bridge...), strconv.Itoa(t.Port))
	c, err := d.exec(ctx, t.Instance, argv)
	if err != nil {
		return nil, fmt.Errorf("guest: exec dial %s: %w", t, err)
	}
	return c, nil
}

// memberDialer sends a dial for a guest on this provider's own member to
// local, and every other to remote: the cluster form of the provider.
type memberDialer struct {
	member string
	local  Dialer
	remote Dialer
}

// NewMember returns the dialer for a provider running on the cluster member
// named member: guests whose Target.Location is that member (or empty, as
// on a standalone server) through local (netns: sub-millisecond dials, no
// start-up cost), guests elsewhere through remote (exec). An empty member
// means the provider runs on no member: everything goes to remote.
func NewMember(member string, local, remote Dialer) Dialer {
	return &memberDialer{member: member, local: local, remote: remote}
}

func (d *memberDialer) pick(t Target) Dialer {
	if d.member != "" && (t.Location == "" || t.Location == d.member || t.Location == "none") {
		return d.local
	}
	return d.remote
}

func (d *memberDialer) Name() string { return KindMember }

func (d *memberDialer) Devices(t Target) map[string]map[string]string {
	// Placement is Incus's to choose, so an instance needs what either side
	// would; netns and exec need nothing.
	out := d.remote.Devices(t)
	for k, v := range d.local.Devices(t) {
		if out == nil {
			out = map[string]map[string]string{}
		}
		out[k] = v
	}
	return out
}

func (d *memberDialer) Forget(instance string) {
	d.local.Forget(instance)
	d.remote.Forget(instance)
}

func (d *memberDialer) DialContext(ctx context.Context, t Target) (net.Conn, error) {
	return d.pick(t).DialContext(ctx, t)
}
