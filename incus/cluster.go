package incus

import (
	"context"
	"errors"
	"net/http"
	"net/url"
)

// ClusterMember is one member of an Incus cluster, from
// GET /1.0/cluster/members?recursion=1.
type ClusterMember struct {
	ServerName string   `json:"server_name"`
	URL        string   `json:"url"`
	Roles      []string `json:"roles"`
	Groups     []string `json:"groups"`
	Status     string   `json:"status"` // Online, Offline, Evacuated, ...
	Message    string   `json:"message"`
}

// ListClusterMembers lists the cluster's members with their state.
func (c *Client) ListClusterMembers(ctx context.Context) ([]ClusterMember, error) {
	list, _, err := get[[]ClusterMember](ctx, c, request{op: "cluster.members.list", path: "/1.0/cluster/members", query: url.Values{"recursion": {"1"}}}, "list cluster members")
	if err != nil {
		return nil, err
	}
	c.eps.learnMembers(*list)
	return *list, nil
}

// ClusterGroupExists reports whether the cluster has a group of that name.
func (c *Client) ClusterGroupExists(ctx context.Context, name string) (bool, error) {
	_, err := c.do(ctx, request{op: "cluster.group.get", method: http.MethodGet, path: "/1.0/cluster/groups/" + escape(name)})
	if err == nil {
		return true, nil
	}
	if errors.Is(err, ErrNotFound) {
		return false, nil
	}
	return false, err
}
