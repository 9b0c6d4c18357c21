// Package clusterenv reads the settings file deploy/dev/incus-cluster-up.sh
// writes for the cluster rig (KEY=VALUE lines, lists comma-separated), so
// that the tests and routebench read it one way.
package clusterenv

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// DefaultPath is where the rig writes its settings.
const DefaultPath = "/run/incus-provider-dev/cluster/cluster.env"

// Settings are the rig's members, listed in one order, and how to reach
// them over HTTPS.
type Settings struct {
	URLs, Members, Sockets            []string
	PIDs                              []int
	ClientCert, ClientKey, ServerCert string
}

// Read parses the file at path and checks that every member is listed
// whole and the certificates are named.
func Read(path string) (*Settings, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("cluster settings (deploy/dev/incus-cluster-up.sh writes them): %w", err)
	}
	vars := map[string]string{}
	for _, line := range strings.Split(string(raw), "\n") {
		if k, v, ok := strings.Cut(strings.TrimSpace(line), "="); ok {
			vars[k] = v
		}
	}
	list := func(k string) []string {
		if vars[k] == "" {
			return nil
		}
		return strings.Split(vars[k], ",")
	}
	s := &Settings{URLs: list("INCUS_URL"), Members: list("INCUS_CLUSTER_MEMBERS"), Sockets: list("INCUS_CLUSTER_SOCKETS"),
		ClientCert: vars["INCUS_CLIENT_CERT"], ClientKey: vars["INCUS_CLIENT_KEY"], ServerCert: vars["INCUS_SERVER_CERT"]}
	for _, p := range list("INCUS_CLUSTER_PIDS") {
		n, err := strconv.Atoi(p)
		if err != nil {
			return nil, fmt.Errorf("%s: INCUS_CLUSTER_PIDS: %q is not a PID", path, p)
		}
		s.PIDs = append(s.PIDs, n)
	}
	n := len(s.URLs)
	if n == 0 || len(s.Members) != n || len(s.Sockets) != n || len(s.PIDs) != n {
		return nil, fmt.Errorf("%s does not list every member's URL, name, socket and PID", path)
	}
	if s.ClientCert == "" || s.ClientKey == "" || s.ServerCert == "" {
		return nil, fmt.Errorf("%s lacks INCUS_CLIENT_CERT, INCUS_CLIENT_KEY or INCUS_SERVER_CERT", path)
	}
	return s, nil
}
