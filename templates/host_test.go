package templates

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/lightspeed-dev/incus-provider/incus"
	"github.com/lightspeed-dev/incus-provider/internal/incustest"
)

func TestHostOf(t *testing.T) {
	srv := &incus.Server{APIExtensions: []string{"migration_stateful"}}
	srv.Environment.Server, srv.Environment.ServerVersion = "incus", "6.0.4"
	srv.Environment.Driver = "lxc"
	if h := HostOf(srv); h.VirtualMachines || h.StatefulStop || h.Server != "incus 6.0.4" {
		t.Fatalf("lxc only: %+v", h)
	}
	srv.Environment.Driver = "lxc | qemu"
	if h := HostOf(srv); !h.VirtualMachines || !h.StatefulStop {
		t.Fatalf("lxc | qemu with migration_stateful: %+v", h)
	}
	srv.APIExtensions = nil
	if h := HostOf(srv); !h.VirtualMachines || h.StatefulStop {
		t.Fatalf("qemu without migration_stateful: %+v", h)
	}
}

const vmTemplates = `templates:
  - templateId: small
    displayName: Small container
    powerStates: [running, paused, stopped]
    imageAlias: img
  - templateId: big-vm
    displayName: Big VM
    instanceType: virtual-machine
    powerStates: [running, paused, suspended, stopped]
    imageAlias: img
`

func TestCheckHostRefusesWhatTheHostCannotDo(t *testing.T) {
	containers := strings.SplitN(vmTemplates, "  - templateId: big-vm", 2)[0]
	c, err := Load(write(t, "t.yaml", containers))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.CheckHost(Host{Server: "incus 6.0.4"}); err != nil {
		t.Fatalf("containers need nothing more: %v", err)
	}

	path := write(t, "templates.yaml", vmTemplates)
	c, err = Load(path)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		host Host
		want string
	}{
		{Host{Server: "incus 6.0.4"}, `template "big-vm" offers the power state suspended, but incus 6.0.4 cannot do a stateful stop here (it runs no virtual machines)`},
		{Host{Server: "incus 6.0.4", VirtualMachines: true}, `template "big-vm" offers the power state suspended, but incus 6.0.4 cannot do a stateful stop here (it lacks migration.stateful`},
	}
	for _, tc := range cases {
		err := c.CheckHost(tc.host)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
			t.Fatalf("host %+v: want a sentence with %q and the file, got %v", tc.host, tc.want, err)
		}
		if strings.Count(err.Error(), ". ") > 0 || strings.Contains(err.Error(), "\n") {
			t.Fatalf("one sentence, got %q", err)
		}
	}
	if err := c.CheckHost(Host{Server: "incus 6.0.4", VirtualMachines: true, StatefulStop: true}); err != nil {
		t.Fatalf("a host that can do a stateful stop serves suspended: %v", err)
	}
	// A virtual machine that does not offer suspended still needs VMs.
	vmOnly := strings.Replace(vmTemplates, "paused, suspended, stopped", "paused, stopped", 1)
	c, err = Load(write(t, "vm.yaml", vmOnly))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.CheckHost(Host{Server: "incus 6.0.4"}); err == nil || !strings.Contains(err.Error(), `template "big-vm" is a virtual machine, but incus 6.0.4 cannot run virtual machines`) {
		t.Fatalf("a VM template on a host without VMs: %v", err)
	}
}

// TestCheckHostOnThisIncus reads the real server's facts: this machine's
// Incus runs containers only, so a template offering suspended is refused
// at start-up, naming it.
func TestCheckHostOnThisIncus(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	srv, err := incustest.Server(t).GetServer(ctx)
	if err != nil {
		t.Fatal(err)
	}
	h := HostOf(srv)
	t.Logf("host facts: %+v (driver %q)", h, srv.Environment.Driver)
	c, err := Load(write(t, "templates.yaml", vmTemplates))
	if err != nil {
		t.Fatal(err)
	}
	err = c.CheckHost(h)
	if h.StatefulStop != (err == nil) {
		t.Fatalf("stateful stop %v, CheckHost: %v", h.StatefulStop, err)
	}
	if err != nil && !strings.Contains(err.Error(), `template "big-vm" offers the power state suspended`) {
		t.Fatalf("the refusal must name the template: %v", err)
	}
	t.Logf("CheckHost: %v", err)
}
