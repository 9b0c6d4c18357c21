// Package ingressurl is the public base of the ingress edge: the URL
// template a routed target's endpoint is written from, and the reading of a
// request's Host back to the label it carries. Both the targets (which
// answer endpoints) and the edge (which routes hosts) use the one parse, so
// an endpoint handed out is always a host the edge answers.
package ingressurl

import (
	"crypto/rand"
	"encoding/base32"
	"fmt"
	"net"
	"net/url"
	"strings"
)

// Placeholder is what the base names the label with.
const Placeholder = "{label}"

// DefaultBase is the development base: every browser resolves *.localhost
// to loopback without any DNS (RFC 6761), so make run's endpoints open as
// they are.
const DefaultBase = "http://{label}.localhost:8482"

const standIn = "ingress-label-stand-in"

// Base is a parsed public base.
type Base struct {
	raw      string // canonical: lowercase scheme and host, no trailing slash
	scheme   string // http or https
	pre, suf string // the host around the label, lowercase
}

// Parse checks a base: an http or https URL whose host holds {label} once
// within its first DNS label, with no user, path, query or fragment.
func Parse(s string) (Base, error) {
	// url.Parse refuses braces in a host: parse with a stand-in label.
	u, err := url.Parse(strings.ReplaceAll(s, Placeholder, standIn))
	if err != nil {
		return Base{}, fmt.Errorf("%q is not a URL: %w", s, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return Base{}, fmt.Errorf("%q must be an http or https URL", s)
	}
	if u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		return Base{}, fmt.Errorf("%q must have no user, path, query or fragment", s)
	}
	host := strings.ToLower(u.Hostname())
	i := strings.Index(host, standIn)
	if i < 0 || strings.Count(s, Placeholder) != 1 {
		return Base{}, fmt.Errorf("%q must hold %s exactly once in its host", s, Placeholder)
	}
	pre, suf := host[:i], host[i+len(standIn):]
	if strings.Contains(pre, ".") || (suf != "" && suf[0] != '.') || len(suf) < 2 {
		return Base{}, fmt.Errorf("%q must have %s as a whole DNS label under a domain, such as https://{label}.env.example.com", s, Placeholder)
	}
	// Written back in the URL's canonical case (RFC 3986: scheme and host
	// are case-insensitive, lowercase is canonical), so that an endpoint
	// handed out, and the scheme the edge forwards, are the same whatever
	// case the operator wrote.
	raw := u.Scheme + "://" + strings.Replace(strings.ToLower(u.Host), standIn, Placeholder, 1)
	return Base{raw: raw, scheme: u.Scheme, pre: pre, suf: suf}, nil
}

// Endpoint is the URL of the label's host.
func (b Base) Endpoint(label string) string {
	return strings.Replace(b.raw, Placeholder, label, 1)
}

// String is the base as configured, in canonical case.
func (b Base) String() string { return b.raw }

// Label reads the label out of a request's Host (port ignored, case
// folded); ok is false for a host the base does not shape. It costs the
// same for any host of a given length: no lookup, no allocation beyond the
// lowercase copy.
func (b Base) Label(host string) (string, bool) {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.ToLower(strings.TrimSuffix(host, "."))
	if len(host) <= len(b.pre)+len(b.suf) || !strings.HasPrefix(host, b.pre) || !strings.HasSuffix(host, b.suf) {
		return "", false
	}
	label := host[len(b.pre) : len(host)-len(b.suf)]
	if !Valid(label) {
		return "", false
	}
	return label, true
}

// labelLen is 128 random bits in base32: unguessable, and a DNS label.
const labelLen = 26

var encoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// NewLabel draws a fresh label from crypto/rand: it says nothing of the
// owner or the target.
func NewLabel() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return encoding.EncodeToString(b[:])
}

// Valid says whether s is a label NewLabel could have drawn.
func Valid(s string) bool {
	if len(s) != labelLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < 'a' || c > 'z') && (c < '2' || c > '7') {
			return false
		}
	}
	return true
}

// Scheme is the base's scheme, the X-Forwarded-Proto of every request: the
// public side's, whatever terminates TLS in front of the edge.
func (b Base) Scheme() string {
	if b.scheme == "" {
		return "http" // the zero Base
	}
	return b.scheme
}
