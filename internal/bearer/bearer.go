// Package bearer guards HTTP endpoints with the provider's optional bearer
// credential, before any WebSocket upgrade.
package bearer

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
)

// Credential is the secret the runtime presents. The zero value means none
// is configured and every request passes. Copies share one secret, so a
// Reload through any of them is seen by every handler that holds one.
type Credential struct {
	cur *atomic.Pointer[[sha256.Size]byte] // nil: none configured
}

// Load reads the credential from a file (surrounding white space trimmed).
// An empty path means no credential.
func Load(path string) (Credential, error) {
	if path == "" {
		return Credential{}, nil
	}
	digest, err := read(path)
	if err != nil {
		return Credential{}, err
	}
	c := Credential{cur: new(atomic.Pointer[[sha256.Size]byte])}
	c.cur.Store(digest)
	return c, nil
}

func read(path string) (*[sha256.Size]byte, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read credential file: %w", err)
	}
	secret := strings.TrimSpace(string(raw))
	if secret == "" {
		return nil, fmt.Errorf("credential file %s is empty", path)
	}
	// Comparing digests keeps the comparison constant-time whatever the
	// presented length, and keeps the secret itself out of memory we pass around.
	digest := sha256.Sum256([]byte(secret))
	return &digest, nil
}

// New makes a credential from its secret.
func New(secret string) Credential {
	c := Credential{cur: new(atomic.Pointer[[sha256.Size]byte])}
	digest := sha256.Sum256([]byte(secret))
	c.cur.Store(&digest)
	return c
}

// Reload reads path again and makes what it holds the credential every
// later request is checked against: a rotation without a restart. A file
// that cannot be read, or is empty, leaves the credential as it was. A
// credential that was never configured stays so: turning one on is a
// setting, changed by a restart.
func (c Credential) Reload(path string) error {
	if c.cur == nil {
		return errors.New("no credential is configured; set one and restart")
	}
	digest, err := read(path)
	if err != nil {
		return err
	}
	c.cur.Store(digest)
	return nil
}

// Enabled says whether requests must carry the credential.
func (c Credential) Enabled() bool { return c.cur != nil }

// Allows reports whether the request carries the credential.
func (c Credential) Allows(r *http.Request) bool {
	if c.cur == nil {
		return true
	}
	digest := c.cur.Load()
	h := r.Header.Get("Authorization")
	scheme, token, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		token = ""
	}
	presented := sha256.Sum256([]byte(strings.TrimSpace(token)))
	return subtle.ConstantTimeCompare(presented[:], digest[:]) == 1 && token != ""
}

// Require answers 401 before next runs when the request lacks the credential.
// onRefuse, when set, is told of each refusal (for metrics).
func (c Credential) Require(next http.Handler, onRefuse func(r *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !c.Allows(r) {
			if onRefuse != nil {
				onRefuse(r)
			}
			w.Header().Set("WWW-Authenticate", `Bearer realm="incus-provider"`)
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			w.WriteHeader(http.StatusUnauthorized)
			_, _ = w.Write([]byte("This endpoint needs the provider's bearer credential in an Authorization: Bearer header.\n"))
			return
		}
		next.ServeHTTP(w, r)
	})
}
