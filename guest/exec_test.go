package guest

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
)

func noExec(context.Context, string, []string) (net.Conn, error) {
	return nil, errors.New("no exec in this test")
}

// recorder is a Dialer that remembers the targets it was asked for.
type recorder struct {
	name  string
	dials []Target
}

func (r *recorder) DialContext(_ context.Context, t Target) (net.Conn, error) {
	r.dials = append(r.dials, t)
	return nil, errors.New(r.name)
}
func (r *recorder) Devices(Target) map[string]map[string]string { return nil }
func (r *recorder) Forget(string)                               {}
func (r *recorder) Name() string                                { return r.name }

func TestMemberDialerSendsOtherMembersGuestsToRemote(t *testing.T) {
	for _, tc := range []struct {
		member, location, want string
	}{
		{"m1", "m1", "local"},
		{"m1", "", "local"},     // a standalone server names no location
		{"m1", "none", "local"}, // what Incus says when not clustered
		{"m1", "m2", "remote"},
		{"m1", "M1", "remote"}, // member names are exact
		{"", "m1", "remote"},   // a provider on no member has no local guests
		{"", "", "remote"},
	} {
		local, remote := &recorder{name: "local"}, &recorder{name: "remote"}
		d := NewMember(tc.member, local, remote)
		_, err := d.DialContext(context.Background(), Target{Instance: "i", Port: 1, Location: tc.location})
		if err == nil || err.Error() != tc.want {
			t.Errorf("member %q, location %q: dialled %v, want %s", tc.member, tc.location, err, tc.want)
		}
	}
}

func TestExecDialerRunsTheBridgeWithThePort(t *testing.T) {
	var got []string
	d := NewExec(func(_ context.Context, instance string, argv []string) (net.Conn, error) {
		got = append([]string{instance}, argv...)
		return nil, errors.New("refused")
	}, nil)
	_, err := d.DialContext(context.Background(), Target{Instance: "i1", Port: 19091})
	if err == nil || !strings.Contains(err.Error(), "i1:19091") || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("error %v does not name the target and the cause", err)
	}
	if strings.Join(got, " ") != "i1 nc 127.0.0.1 19091" {
		t.Fatalf("ran %q", got)
	}
	if _, err := d.DialContext(context.Background(), Target{Instance: "../x", Port: 1}); err == nil {
		t.Fatal("an invalid instance name was dialled")
	}
}

// execDialer builds the exec dialer on the fixture's project; the test
// image has BusyBox only as /bin/busybox.
func (f *incusFixture) execDialer(t *testing.T) Dialer {
	t.Helper()
	c, err := incus.New(incus.Config{Socket: incusSocket(), Project: f.project})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return NewExec(func(ctx context.Context, instance string, argv []string) (net.Conn, error) {
		return c.ExecStream(ctx, instance, argv)
	}, []string{"/bin/busybox", "nc", "127.0.0.1"})
}

func TestIncusExecDialerReachesGuestLoopback(t *testing.T) {
	f := needIncus(t)
	x := f.execDialer(t)
	tg := f.newInstance(t, "gd-exec", true)
	waitID(t, x, tg, tg.Instance, 30*time.Second)

	// Many in a row, each answered and each bridge gone after its Close:
	// a leaked nc per connection would pile up in the guest. A bridge that
	// Incus ends before any output is a failed dial its caller makes
	// again (a route's runtime redials); it must say so in those words,
	// and the next dial must work (seen once, in the second round of a run
	// beside stress-ng --cpu 2; it surfaced then as the broken pipe of
	// gorilla's answer to Incus's close).
	for i := range 20 {
		var id string
		var err error
		for attempt := 1; attempt <= 3; attempt++ {
			id, err = fetchID(context.Background(), x, tg)
			ended := errors.Is(err, incus.ErrExecEnded) || errors.Is(err, io.EOF)
			if err == nil || !ended {
				break
			}
			t.Logf("round %d, attempt %d: the bridge ended before any output: %v", i, attempt, err)
		}
		if err != nil || id != tg.Instance {
			t.Fatalf("round %d: id %q, %v", i, id, err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		out, err := incusCLI("exec", "--project", f.project, tg.Instance, "--", "/bin/busybox", "ps")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, "nc 127.0.0.1") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("bridges still running 5 s after their streams closed:\n%s", out)
		}
		time.Sleep(100 * time.Millisecond)
	}

	// Nothing listens on port 1: the stream ends at once and its first
	// Read says why, in nc's words.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := x.DialContext(ctx, Target{Instance: tg.Instance, Port: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = io.ReadAll(c)
	if !errors.Is(err, incus.ErrExecEnded) {
		t.Fatalf("read from a refused bridge: %v, want ErrExecEnded", err)
	}
}

func TestIncusExecDialerRefusesStoppedInstance(t *testing.T) {
	f := needIncus(t)
	x := f.execDialer(t)
	tg := f.newInstance(t, "gd-exec-stopped", false)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	c, err := x.DialContext(ctx, tg)
	if err == nil {
		c.Close()
		t.Fatal("exec dial of a stopped instance succeeded")
	}
	t.Logf("stopped: %v after %s", err, time.Since(start))
}
