package incus

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"time"
)

// Project is an Incus project.
type Project struct {
	Name        string            `json:"name"`
	Description string            `json:"description"`
	Config      map[string]string `json:"config"`
	UsedBy      []string          `json:"used_by"`
}

// forceDeleteTimeout bounds the single call of a forced project delete.
const forceDeleteTimeout = 5 * time.Minute

func projectPath(name string) string { return "/1.0/projects/" + escape(name) }

// CreateProject creates a project. Useful config keys: features.images and
// features.profiles ("false" shares the default project's images and
// profiles instead of giving the project its own). An existing name is an
// error matching ErrConflict.
func (c *Client) CreateProject(ctx context.Context, name string, config map[string]string) error {
	body := struct {
		Name   string            `json:"name"`
		Config map[string]string `json:"config,omitempty"`
	}{name, config}
	resp, err := c.do(ctx, request{op: "project.create", method: http.MethodPost, path: "/1.0/projects", body: body})
	if err != nil {
		return fmt.Errorf("incus: create project %q: %w", name, err)
	}
	return c.finish(ctx, "project.create", resp, func(err error) error {
		return fmt.Errorf("incus: create project %q: %w", name, err)
	})
}

// GetProject fetches a project.
func (c *Client) GetProject(ctx context.Context, name string) (*Project, error) {
	p, _, err := get[Project](ctx, c, request{op: "project.get", path: projectPath(name)}, fmt.Sprintf("get project %q", name))
	return p, err
}

// GetProjectETag is GetProject with the ETag that UpdateProjectIf takes.
func (c *Client) GetProjectETag(ctx context.Context, name string) (*Project, string, error) {
	p, resp, err := get[Project](ctx, c, request{op: "project.get", path: projectPath(name)}, fmt.Sprintf("get project %q", name))
	if err != nil {
		return nil, "", err
	}
	return p, resp.etag, nil
}

// UpdateProjectIf replaces a project's description and config (PUT),
// only while the project is as GetProjectETag answered etag (empty:
// always); otherwise the error matches ErrPreconditionFailed. There is no
// partial write: Incus's PATCH of a project replaces its whole config, as
// a PUT does (measured on 6.0.4: a PATCH of one key dropped the others).
func (c *Client) UpdateProjectIf(ctx context.Context, name, description string, config map[string]string, etag string) error {
	body := struct {
		Description string            `json:"description"`
		Config      map[string]string `json:"config"`
	}{description, config}
	resp, err := c.do(ctx, request{op: "project.put", method: http.MethodPut, path: projectPath(name), body: body, etag: etag})
	if err != nil {
		return fmt.Errorf("incus: update project %q: %w", name, err)
	}
	return c.finish(ctx, "project.put", resp, func(err error) error {
		return fmt.Errorf("incus: update project %q: %w", name, err)
	})
}

// DeleteProject deletes an empty project. Incus refuses a project that
// still holds instances (or anything else) with a plain 500 ("Only empty
// projects can be removed."), not a conflict.
func (c *Client) DeleteProject(ctx context.Context, name string) error {
	return c.deleteProject(ctx, name, false)
}

// ForceDeleteProject deletes a project and everything in it: instances
// (running ones are killed first), profiles, volumes. Meant for cleaning up
// throwaway projects (tests); needs the projects_force_delete extension.
// The server does all of it inside the one call, so that call may run for
// up to 5 minutes instead of CallTimeout (ctx still bounds it).
//
// A project with features.profiles=false shares the default project's
// profiles, and Incus 6.0.4's forced delete empties the profile it calls
// the project's default, which is then the default project's own: every
// later instance created without a root device fails ("No root device
// could be found"). Seen here, and reported upstream as lxc/incus#2416.
// Such a project is never force-deleted: its instances are killed and
// deleted one by one, then the empty project is deleted plainly (anything
// else left in it fails that delete, loudly).
func (c *Client) ForceDeleteProject(ctx context.Context, name string) error {
	p, err := c.GetProject(ctx, name)
	if err != nil {
		return fmt.Errorf("incus: delete project %q: %w", name, err)
	}
	if p.Config["features.profiles"] == "true" {
		return c.deleteProject(ctx, name, true)
	}
	in := c.WithProject(name)
	insts, err := in.ListInstances(ctx)
	if err != nil {
		return fmt.Errorf("incus: delete project %q: %w", name, err)
	}
	for i := range insts {
		if err := in.killAndDelete(ctx, insts[i].Name); err != nil {
			return fmt.Errorf("incus: delete project %q: %w", name, err)
		}
	}
	return c.DeleteProject(ctx, name)
}

// killAndDelete stops an instance at once, whatever its state, and deletes it.
func (c *Client) killAndDelete(ctx context.Context, name string) error {
	// A stopped instance refuses the stop: the delete below says whether
	// anything is really wrong.
	if op, err := c.UpdateInstanceState(ctx, name, InstanceStatePut{Action: ActionStop, Force: true}); err == nil {
		_, _ = c.Wait(ctx, op)
	}
	op, err := c.DeleteInstance(ctx, name)
	if err == nil {
		_, err = c.Wait(ctx, op)
	}
	if err != nil && !errors.Is(err, ErrNotFound) {
		return err
	}
	return nil
}

func (c *Client) deleteProject(ctx context.Context, name string, force bool) error {
	r := request{op: "project.delete", method: http.MethodDelete, path: projectPath(name)}
	if force {
		r.query = url.Values{"force": {"true"}}
		r.timeout = max(c.callTimeout, forceDeleteTimeout)
	}
	resp, err := c.do(ctx, r)
	if err != nil {
		return fmt.Errorf("incus: delete project %q: %w", name, err)
	}
	return c.finish(ctx, "project.delete", resp, func(err error) error {
		return fmt.Errorf("incus: delete project %q: %w", name, err)
	})
}

// Profile is an Incus profile.
type Profile struct {
	Name        string                       `json:"name"`
	Description string                       `json:"description"`
	Config      map[string]string            `json:"config"`
	Devices     map[string]map[string]string `json:"devices"`
}

// GetProfile fetches a profile of the client's project (of the default
// project's, for a project that shares its profiles).
func (c *Client) GetProfile(ctx context.Context, name string) (*Profile, error) {
	p, _, err := get[Profile](ctx, c, request{op: "profile.get", scoped: true, path: "/1.0/profiles/" + escape(name)},
		fmt.Sprintf("get profile %q", name))
	return p, err
}
