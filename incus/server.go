package incus

import (
	"context"
	"slices"
)

// Server is what GET /1.0 says about the server and about us.
type Server struct {
	APIExtensions []string          `json:"api_extensions"`
	APIStatus     string            `json:"api_status"`
	APIVersion    string            `json:"api_version"`
	Auth          string            `json:"auth"` // "trusted" or "untrusted"
	AuthMethods   []string          `json:"auth_methods"`
	Public        bool              `json:"public"`
	Config        map[string]string `json:"config"`
	Environment   ServerEnvironment `json:"environment"`
}

// ServerEnvironment is the part of Server describing the host.
type ServerEnvironment struct {
	Architectures   []string `json:"architectures"`
	Driver          string   `json:"driver"`
	DriverVersion   string   `json:"driver_version"`
	Firewall        string   `json:"firewall"`
	Kernel          string   `json:"kernel"`
	KernelVersion   string   `json:"kernel_version"`
	OSName          string   `json:"os_name"`
	OSVersion       string   `json:"os_version"`
	Project         string   `json:"project"`
	Server          string   `json:"server"` // "incus"
	ServerClustered bool     `json:"server_clustered"`
	ServerName      string   `json:"server_name"`
	ServerPID       int      `json:"server_pid"`
	ServerVersion   string   `json:"server_version"`
	Storage         string   `json:"storage"`
	StorageVersion  string   `json:"storage_version"`
}

// HasExtension reports whether the server announces API extension name.
func (s *Server) HasExtension(name string) bool {
	return slices.Contains(s.APIExtensions, name)
}

// GetServer fetches the server description. It is also the cheapest way to
// check that the server is reachable and trusts us (Auth == "trusted").
func (c *Client) GetServer(ctx context.Context) (*Server, error) {
	s, _, err := get[Server](ctx, c, request{op: "server.get", path: "/1.0"}, "get server")
	return s, err
}
