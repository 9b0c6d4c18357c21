//go:build !linux

package guest

import (
	"context"
	"errors"
	"fmt"
	"net"
)

var errNetnsUnsupported = errors.New("network namespaces exist only on Linux")

type netnsDialer struct{}

// NewNetns returns a Dialer that always fails: network namespaces exist only
// on Linux.
func NewNetns(PIDLookup) Dialer { return netnsDialer{} }

func (netnsDialer) Name() string                                { return KindNetns }
func (netnsDialer) Devices(Target) map[string]map[string]string { return nil }
func (netnsDialer) Forget(string)                               {}
func (netnsDialer) DialContext(_ context.Context, t Target) (net.Conn, error) {
	return nil, fmt.Errorf("guest: netns dial %s: %w", t, errNetnsUnsupported)
}

func netnsSupported() error { return errNetnsUnsupported }
