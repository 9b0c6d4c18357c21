package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/lightspeed-dev/incus-provider/guest"
	"github.com/lightspeed-dev/incus-provider/incus"
)

// checkSeesIncus refuses the netns dialer where it cannot work although it
// starts: in another PID namespace than Incus's (a container run without
// --pid=host), the init PIDs Incus reports name other processes or none,
// and every route to a running target would answer 503 booting with
// nothing said. Incus gives its own PID; over the local socket that
// process must be incusd (or lxd) here too.
func checkSeesIncus(cfg config, server *incus.Server, kind string) error {
	if (kind != guest.KindNetns && kind != guest.KindMember) || cfg.IncusURL != "" || server.Environment.ServerPID <= 0 {
		return nil
	}
	pid := server.Environment.ServerPID
	comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	name := strings.TrimSpace(string(comm))
	if err == nil && (name == "incusd" || name == "lxd") {
		return nil
	}
	seen := "no such process"
	if err == nil {
		seen = fmt.Sprintf("process %q", name)
	}
	return badSetting(fmt.Errorf("PROVIDER_GUEST_DIALER=%q (%s) cannot reach guests from here: Incus runs as PID %d, but this process sees %s there, so it is in another PID namespace than Incus; run it in the host's (podman/docker --pid=host), or use PROVIDER_GUEST_DIALER=exec",
		cfg.GuestDialer, kind, pid, seen))
}
