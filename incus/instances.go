package incus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// Instance is a container or virtual machine as GET /1.0/instances/{name}
// returns it.
type Instance struct {
	Name         string                       `json:"name"`
	Type         string                       `json:"type"` // "container" or "virtual-machine"
	Status       InstanceStatus               `json:"status"`
	StatusCode   StatusCode                   `json:"status_code"`
	Description  string                       `json:"description"`
	Architecture string                       `json:"architecture"`
	Config       map[string]string            `json:"config"`
	Devices      map[string]map[string]string `json:"devices"`
	Profiles     []string                     `json:"profiles"`
	Stateful     bool                         `json:"stateful"`
	Ephemeral    bool                         `json:"ephemeral"`
	Location     string                       `json:"location"`
	Project      string                       `json:"project"`
	CreatedAt    time.Time                    `json:"created_at"`
	LastUsedAt   time.Time                    `json:"last_used_at"`
	// Incus also sends expanded_config and expanded_devices (Config and
	// Devices with the profiles applied). Nothing here acts on them, and at
	// 10,000 instances decoding them was half of every listing's memory and
	// CPU: they are read only by GetInstanceExpanded.
}

// ExpandedInstance is an instance with its profiles applied.
type ExpandedInstance struct {
	Instance
	ExpandedConfig  map[string]string            `json:"expanded_config"`
	ExpandedDevices map[string]map[string]string `json:"expanded_devices"`
}

// Writable returns the instance's writable fields, ready to be changed and
// sent back with UpdateInstance. Config includes the volatile.* keys, which a
// PUT must carry: Incus refuses a PUT that drops them.
func (i *Instance) Writable() InstancePut {
	return InstancePut{
		Architecture: i.Architecture,
		Config:       cloneMap(i.Config),
		Devices:      cloneDevices(i.Devices),
		Profiles:     append([]string(nil), i.Profiles...),
		Description:  i.Description,
		Ephemeral:    i.Ephemeral,
		Stateful:     i.Stateful,
	}
}

// InstanceState is the runtime state of an instance.
type InstanceState struct {
	Status     InstanceStatus                  `json:"status"`
	StatusCode StatusCode                      `json:"status_code"`
	Pid        int64                           `json:"pid"`
	Processes  int64                           `json:"processes"`
	StartedAt  time.Time                       `json:"started_at"`
	CPU        InstanceStateCPU                `json:"cpu"`
	Memory     InstanceStateMemory             `json:"memory"`
	Disk       map[string]InstanceStateDisk    `json:"disk"`
	Network    map[string]InstanceStateNetwork `json:"network"`
}

// InstanceStateCPU is CPU time used, in nanoseconds.
type InstanceStateCPU struct {
	Usage int64 `json:"usage"`
}

// InstanceStateMemory is memory use in bytes.
type InstanceStateMemory struct {
	Usage     int64 `json:"usage"`
	UsagePeak int64 `json:"usage_peak"`
	Total     int64 `json:"total"`
}

// InstanceStateDisk is the use of one disk device in bytes.
type InstanceStateDisk struct {
	Usage int64 `json:"usage"`
}

// InstanceStateNetwork is one network interface inside the instance.
type InstanceStateNetwork struct {
	Addresses []InstanceStateAddress `json:"addresses"`
	HostName  string                 `json:"host_name"`
	Hwaddr    string                 `json:"hwaddr"`
	MTU       int                    `json:"mtu"`
	State     string                 `json:"state"`
	Type      string                 `json:"type"`
}

// InstanceStateAddress is one address of an interface.
type InstanceStateAddress struct {
	Family  string `json:"family"` // inet, inet6
	Address string `json:"address"`
	Netmask string `json:"netmask"`
	Scope   string `json:"scope"` // global, link, local
}

// InstanceSource says where a new instance's root filesystem comes from.
type InstanceSource struct {
	Type        string `json:"type"` // "image" or "none"
	Fingerprint string `json:"fingerprint,omitempty"`
	Alias       string `json:"alias,omitempty"`
}

// InstancesPost is the body of an instance create.
type InstancesPost struct {
	Name    string                       `json:"name"`
	Type    string                       `json:"type,omitempty"` // default "container"
	Source  InstanceSource               `json:"source"`
	Config  map[string]string            `json:"config,omitempty"`
	Devices map[string]map[string]string `json:"devices,omitempty"`
	// Profiles: nil means the project's "default" profile; an empty,
	// non-nil slice means no profile at all.
	Profiles    []string `json:"profiles"`
	Start       bool     `json:"start"`
	Description string   `json:"description,omitempty"`
	// Target places the instance on a cluster member, or a cluster group
	// as "@name" (sent as ?target=, not in the body); empty lets Incus's
	// scheduler choose.
	Target string `json:"-"`
}

// InstancePut is the writable part of an instance. A PUT replaces all of it;
// build one with Instance.Writable.
type InstancePut struct {
	Architecture string                       `json:"architecture,omitempty"`
	Config       map[string]string            `json:"config"`
	Devices      map[string]map[string]string `json:"devices"`
	Profiles     []string                     `json:"profiles"`
	Description  string                       `json:"description"`
	Ephemeral    bool                         `json:"ephemeral"`
	Stateful     bool                         `json:"stateful"`
}

// StateAction is a change of an instance's state that Incus carries out as
// an operation.
type StateAction string

// The state actions the provider asks for.
const (
	ActionStart    StateAction = "start"
	ActionStop     StateAction = "stop"
	ActionRestart  StateAction = "restart"
	ActionFreeze   StateAction = "freeze"
	ActionUnfreeze StateAction = "unfreeze"
)

// InstanceStatePut asks for a state change.
type InstanceStatePut struct {
	Action StateAction `json:"action"`

	// Timeout is how many seconds a clean "stop"/"restart" may take. After
	// that the operation fails and the instance keeps running; it is not
	// killed. Zero is not sent, which lets the server choose (it waits up to
	// 600 s); Incus itself would read an explicit 0 as "kill at once", which
	// is what Force is for here.
	Timeout int `json:"timeout,omitempty"`

	// Force kills instead of asking the instance to shut down.
	Force bool `json:"force"`

	// Stateful stops with / starts from a saved runtime state.
	Stateful bool `json:"stateful"`
}

func instancePath(name string) string { return "/1.0/instances/" + escape(name) }

// GetInstance fetches an instance and its ETag (for UpdateInstance).
// A missing instance gives an error matching ErrNotFound.
func (c *Client) GetInstance(ctx context.Context, name string) (*Instance, string, error) {
	inst, resp, err := get[Instance](ctx, c, request{op: "instance.get", scoped: true, path: instancePath(name)},
		fmt.Sprintf("get instance %q", name))
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			c.eps.learnLocation(c.project, name, "")
		}
		return nil, "", err
	}
	c.eps.learnLocation(c.project, name, inst.Location)
	return inst, resp.etag, nil
}

// GetInstanceExpanded reads an instance with the expanded config and
// devices that GetInstance leaves out.
func (c *Client) GetInstanceExpanded(ctx context.Context, name string) (*ExpandedInstance, error) {
	inst, _, err := get[ExpandedInstance](ctx, c, request{op: "instance.get", scoped: true, path: instancePath(name)},
		fmt.Sprintf("get instance %q", name))
	if err != nil {
		return nil, err
	}
	c.eps.learnLocation(c.project, name, inst.Location)
	return inst, nil
}

// ListInstances returns all instances of the client's project. Incus does
// not check the project on list calls: a project that does not exist lists
// as empty, not as an error (Incus 6.0.4; ListOperations alike).
func (c *Client) ListInstances(ctx context.Context) ([]Instance, error) {
	out, _, err := get[[]Instance](ctx, c, request{op: "instance.list", scoped: true,
		path: "/1.0/instances", query: url.Values{"recursion": {"1"}}, patient: true}, "list instances")
	if err != nil {
		return nil, err
	}
	c.eps.learnList(c.project, placementsOf(*out))
	return *out, nil
}

// ListInstancesKept lists the instances of the client's project as
// ListInstances does, decoding them one at a time from the answer as it
// arrives and holding only what keep returns for each (nil: nothing):
// the full listing is never in memory at once, neither as bytes nor
// decoded. keep may be called for an instance more than once (a listing
// cut short is read again from the next endpoint); only the last
// listing's results are returned.
func (c *Client) ListInstancesKept(ctx context.Context, keep func(*Instance) *Instance) ([]*Instance, error) {
	var (
		out    []*Instance
		placed []placement
	)
	sink := func(dec *json.Decoder) error {
		var got []*Instance
		var at []placement
		err := decodeArray(dec, func(inst *Instance) {
			at = append(at, placement{inst.Name, inst.Location})
			if k := keep(inst); k != nil {
				got = append(got, k)
			}
		})
		if err == nil {
			out, placed = got, at
		}
		return err
	}
	r := request{op: "instance.list", method: http.MethodGet, scoped: true, path: "/1.0/instances",
		query: url.Values{"recursion": {"1"}}, patient: true, metadata: sink}
	if _, err := c.do(ctx, r); err != nil {
		return nil, fmt.Errorf("incus: list instances: %w", err)
	}
	c.eps.learnList(c.project, placed)
	return out, nil
}

// ListInstancesWithConfig lists the instances whose config key holds
// value, filtered by Incus: an answer the size of the match, not of the
// project (Incus still reads every instance to filter them). The key and
// value must need no quoting in Incus's filter language.
func (c *Client) ListInstancesWithConfig(ctx context.Context, key, value string) ([]Instance, error) {
	if key == "" || value == "" || strings.ContainsAny(key+value, " \t\"'()") {
		return nil, fmt.Errorf("incus: list instances with config %q=%q: not a plain filter term", key, value)
	}
	return c.listWhere(ctx, "instance.list", "config."+key+" eq "+value,
		fmt.Sprintf("list instances with config %s=%s", key, value),
		func(inst *Instance) bool { return inst.Config[key] == value })
}

// listWhere lists the instances Incus's filter selects, keeping those
// match also accepts: the filter is Incus's, and what it selects is
// checked here all the same.
func (c *Client) listWhere(ctx context.Context, op, filter, what string, match func(*Instance) bool) ([]Instance, error) {
	out, _, err := get[[]Instance](ctx, c, request{op: op, scoped: true, path: "/1.0/instances",
		query: url.Values{"recursion": {"1"}, "filter": {filter}}}, what)
	if err != nil {
		return nil, err
	}
	matched := (*out)[:0]
	for i := range *out {
		if match(&(*out)[i]) {
			matched = append(matched, (*out)[i])
		}
	}
	return matched, nil
}

// FindInstance lists the one instance of that name (nil when there is
// none). On a cluster it still answers while the member holding the
// instance is unreachable, where GetInstance fails or hangs: the list is
// served from the cluster database, and such an instance has the status
// Error and its member as Location.
func (c *Client) FindInstance(ctx context.Context, name string) (*Instance, error) {
	found, err := c.listWhere(ctx, "instance.find", "name eq "+name, fmt.Sprintf("find instance %q", name),
		func(inst *Instance) bool { return inst.Name == name })
	if err != nil || len(found) == 0 {
		return nil, err
	}
	c.eps.learnLocation(c.project, name, found[0].Location)
	return &found[0], nil
}

// GetInstanceState fetches the runtime state of an instance.
func (c *Client) GetInstanceState(ctx context.Context, name string) (*InstanceState, error) {
	st, _, err := get[InstanceState](ctx, c, request{op: "instance.state.get", scoped: true, path: instancePath(name) + "/state"},
		fmt.Sprintf("get instance state %q", name))
	return st, err
}

// CreateInstance starts creating an instance and returns the operation
// without waiting for it; pass it to Wait.
//
// A name that is already taken matches ErrConflict, but where it shows up
// depends on the server. Incus 6.0 (verified against 6.0.4) accepts the
// request (202) and the operation then fails with a database constraint
// error ("UNIQUE constraint failed: instances.project_id, instances.name"),
// so the conflict comes out of Wait, as an *OperationError. Newer releases
// refuse the request at once; then CreateInstance itself returns it, as an
// *Error. The existing instance is left untouched either way.
func (c *Client) CreateInstance(ctx context.Context, req InstancesPost) (*Operation, error) {
	r := request{op: "instance.create", method: http.MethodPost, scoped: true, path: "/1.0/instances", body: req}
	if req.Target != "" {
		r.query = url.Values{"target": {req.Target}}
	}
	resp, err := c.do(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("incus: create instance %q: %w", req.Name, err)
	}
	op, err := operationOf("instance.create", resp)
	if err != nil {
		return nil, fmt.Errorf("incus: create instance %q: %w", req.Name, err)
	}
	return op, nil
}

// UpdateInstanceState starts a state change (start, stop, freeze, ...) and
// returns the operation without waiting for it. Asking for the state the
// instance is already in (starting a running instance) is accepted here and
// fails in the operation.
func (c *Client) UpdateInstanceState(ctx context.Context, name string, req InstanceStatePut) (*Operation, error) {
	resp, err := c.do(ctx, request{op: "instance.state.put", method: http.MethodPut, scoped: true, path: instancePath(name) + "/state", body: req})
	if err != nil {
		return nil, fmt.Errorf("incus: %s instance %q: %w", req.Action, name, err)
	}
	op, err := operationOf("instance.state.put", resp)
	if err != nil {
		return nil, fmt.Errorf("incus: %s instance %q: %w", req.Action, name, err)
	}
	return op, nil
}

// PatchInstanceConfig sets config keys of an instance and leaves every other
// key as it is (PATCH merges: verified against Incus 6.0.4). An empty value
// removes the key. Incus answers a PATCH synchronously; should it ever hand
// back an operation, it is waited for.
func (c *Client) PatchInstanceConfig(ctx context.Context, name string, set map[string]string) error {
	return c.PatchInstanceConfigIf(ctx, name, set, "")
}

// PatchInstanceConfigIf is PatchInstanceConfig applied only while the
// instance is as it was when GetInstance answered etag (empty: always);
// otherwise the error matches ErrPreconditionFailed. This is how a
// read-compare-write of intent stays right across provider replicas.
func (c *Client) PatchInstanceConfigIf(ctx context.Context, name string, set map[string]string, etag string) error {
	if len(set) == 0 {
		return nil
	}
	body := struct {
		Config map[string]string `json:"config"`
	}{set}
	resp, err := c.do(ctx, request{op: "instance.patch", method: http.MethodPatch, scoped: true, path: instancePath(name), body: body, etag: etag})
	if err != nil {
		return fmt.Errorf("incus: patch instance %q: %w", name, err)
	}
	return c.finish(ctx, "instance.patch", resp, func(err error) error {
		return fmt.Errorf("incus: patch instance %q: %w", name, err)
	})
}

// UpdateInstance replaces the writable part of an instance (PUT) and waits
// for the change to be applied. With etag non-empty the update only happens
// if the instance is unchanged since it was read; otherwise the error
// matches ErrPreconditionFailed. Start from GetInstance + Writable: a PUT
// that drops the volatile.* config keys is refused.
func (c *Client) UpdateInstance(ctx context.Context, name string, put InstancePut, etag string) error {
	resp, err := c.do(ctx, request{op: "instance.put", method: http.MethodPut, scoped: true, path: instancePath(name), body: put, etag: etag})
	if err != nil {
		return fmt.Errorf("incus: update instance %q: %w", name, err)
	}
	return c.finish(ctx, "instance.put", resp, func(err error) error {
		return fmt.Errorf("incus: update instance %q: %w", name, err)
	})
}

// DeleteInstance starts deleting an instance and returns the operation
// without waiting for it. A running instance is refused (an *Error with
// status 400, "Instance is running"): stop it first.
func (c *Client) DeleteInstance(ctx context.Context, name string) (*Operation, error) {
	resp, err := c.do(ctx, request{op: "instance.delete", method: http.MethodDelete, scoped: true, path: instancePath(name)})
	if err != nil {
		return nil, fmt.Errorf("incus: delete instance %q: %w", name, err)
	}
	op, err := operationOf("instance.delete", resp)
	if err != nil {
		return nil, fmt.Errorf("incus: delete instance %q: %w", name, err)
	}
	return op, nil
}

// finish completes a call that may have answered sync or async: an async
// answer's operation is waited for.
func (c *Client) finish(ctx context.Context, op string, resp *response, wrap func(error) error) error {
	if resp.Type != "async" {
		return nil
	}
	o, err := operationOf(op, resp)
	if err != nil {
		return wrap(err)
	}
	if _, err := c.wait(ctx, o); err != nil {
		return wrap(err)
	}
	return nil
}

func cloneMap(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func cloneDevices(m map[string]map[string]string) map[string]map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]map[string]string, len(m))
	for k, v := range m {
		out[k] = cloneMap(v)
	}
	return out
}

// InitPID is the host PID of the instance's init process: what a caller
// needs to enter the instance's namespaces. A stopped instance has none (0).
func (c *Client) InitPID(ctx context.Context, name string) (int, error) {
	st, err := c.GetInstanceState(ctx, name)
	if err != nil {
		return 0, err
	}
	return int(st.Pid), nil
}

// located is GET /1.0/instances/{name}?recursion=1: the instance with its
// runtime state, in one call.
type located struct {
	Location string         `json:"location"`
	State    *InstanceState `json:"state"`
}

// LocatedInitPID returns the instance's init PID (0 or -1 when stopped)
// together with the cluster member that holds it, read in one call, so
// that a caller about to enter the PID's namespaces on its own host can
// first check the PID is one of its host's.
func (c *Client) LocatedInitPID(ctx context.Context, name string) (pid int, location string, err error) {
	l, _, err := get[located](ctx, c, request{op: "instance.located", scoped: true, path: instancePath(name),
		query: url.Values{"recursion": {"1"}}}, fmt.Sprintf("get instance %q with its state", name))
	if err != nil {
		return 0, "", err
	}
	c.eps.learnLocation(c.project, name, l.Location)
	if l.State == nil {
		return 0, l.Location, nil
	}
	return int(l.State.Pid), l.Location, nil
}
