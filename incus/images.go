package incus

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Image is an image in the server's store.
type Image struct {
	Fingerprint  string            `json:"fingerprint"`
	Aliases      []ImageAliasEntry `json:"aliases"`
	Architecture string            `json:"architecture"`
	Type         string            `json:"type"` // "container" or "virtual-machine"
	Filename     string            `json:"filename"`
	Size         int64             `json:"size"`
	Properties   map[string]string `json:"properties"`
	Profiles     []string          `json:"profiles"`
	Public       bool              `json:"public"`
	Cached       bool              `json:"cached"`
	AutoUpdate   bool              `json:"auto_update"`
	Project      string            `json:"project"`
	CreatedAt    time.Time         `json:"created_at"`
	UploadedAt   time.Time         `json:"uploaded_at"`
	LastUsedAt   time.Time         `json:"last_used_at"`
	ExpiresAt    time.Time         `json:"expires_at"`
}

// ImageAliasEntry is an alias as listed on an image.
type ImageAliasEntry struct {
	Name        string `json:"name"`
	Description string `json:"description"`
}

// GetImage fetches an image by fingerprint (a unique prefix is enough) in the
// client's project. In a project with features.images=false that is the
// default project's image store.
func (c *Client) GetImage(ctx context.Context, fingerprint string) (*Image, error) {
	img, _, err := get[Image](ctx, c, request{op: "image.get", scoped: true, path: "/1.0/images/" + escape(fingerprint)},
		fmt.Sprintf("get image %q", fingerprint))
	return img, err
}

// GetImageAlias resolves an image alias in the client's project to the
// fingerprint it points at.
func (c *Client) GetImageAlias(ctx context.Context, alias string) (string, error) {
	a, resp, err := get[struct {
		Target string `json:"target"`
	}](ctx, c, request{op: "image.alias.get", scoped: true, path: "/1.0/images/aliases/" + escape(alias)},
		fmt.Sprintf("get image alias %q", alias))
	if err != nil {
		return "", err
	}
	if a.Target == "" {
		return "", fmt.Errorf("incus: get image alias %q: %w", alias, &Error{Op: "image.alias.get", Status: resp.httpStatus, Err: fmt.Errorf("%w: alias without target", ErrMalformedResponse)})
	}
	return a.Target, nil
}

// ImageExists says whether the image is in the client's project.
func (c *Client) ImageExists(ctx context.Context, fingerprint string) (bool, error) {
	_, err := c.GetImage(ctx, fingerprint)
	if errors.Is(err, ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, nil
}
