package incus

import (
	"context"
	"fmt"
	"net/http"
)

// RenameInstance starts renaming a stopped instance and returns the
// operation without waiting for it. Incus refuses at once (an *Error) a
// running instance (400, "Renaming of running instance not allowed"), a
// new name already in use (409, matching ErrConflict) and a source that is
// gone (404, matching ErrNotFound); the rename itself is one database
// transaction, so of several renames racing to one new name at most one
// ends with an instance under it (verified against Incus 6.0.4).
func (c *Client) RenameInstance(ctx context.Context, name, newName string) (*Operation, error) {
	body := struct {
		Name string `json:"name"`
	}{newName}
	resp, err := c.do(ctx, request{op: "instance.rename", method: http.MethodPost, scoped: true, path: instancePath(name), body: body})
	if err != nil {
		return nil, fmt.Errorf("incus: rename instance %q to %q: %w", name, newName, err)
	}
	op, err := operationOf("instance.rename", resp)
	if err != nil {
		return nil, fmt.Errorf("incus: rename instance %q to %q: %w", name, newName, err)
	}
	return op, nil
}

// PatchInstanceIf merges config keys (an empty value removes one) and
// devices (each named device replaced whole) into an instance, applied only
// while the instance is as it was when GetInstance answered etag (empty:
// always); otherwise the error matches ErrPreconditionFailed.
func (c *Client) PatchInstanceIf(ctx context.Context, name string, config map[string]string, devices map[string]map[string]string, etag string) error {
	if len(config) == 0 && len(devices) == 0 {
		return nil
	}
	body := struct {
		Config  map[string]string            `json:"config,omitempty"`
		Devices map[string]map[string]string `json:"devices,omitempty"`
	}{config, devices}
	resp, err := c.do(ctx, request{op: "instance.patch", method: http.MethodPatch, scoped: true, path: instancePath(name), body: body, etag: etag})
	if err != nil {
		return fmt.Errorf("incus: patch instance %q: %w", name, err)
	}
	return c.finish(ctx, "instance.patch", resp, func(err error) error {
		return fmt.Errorf("incus: patch instance %q: %w", name, err)
	})
}
