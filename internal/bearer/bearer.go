// Package bearer guards HTTP endpoints with the provider's optional bearer
// credential, before any WebSocket upgrade.
package bearer

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"net/http"
	"os"
	"strings"
)

// Credential is the secret the runtime presents. The zero value means none
// is configured and every request passes.
type Credential struct {
	digest [sha256.Size]byte
	set    bool
}

// Load reads the credential from a file (surrounding white space trimmed).
// An empty path means no credential.
func Load(path string) (Credential, error) {
	if path == "" {
		return Credential{}, nil
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return Credential{}, fmt.Errorf("read credential file: %w", err)
	}
	secret := strings.TrimSpace(string(raw))
	if secret == "" {
		return Credential{}, fmt.Errorf("credential file %s is empty", path)
	}
	return New(secret), nil
}

// New makes a credential from its secret.
func New(secret string) Credential {
	// Comparing digests keeps the comparison constant-time whatever the
	// presented length, and keeps the secret itself out of memory we pass around.
	return Credential{digest: sha256.Sum256([]byte(secret)), set: true}
}

// Enabled says whether requests must carry the credential.
func (c Credential) Enabled() bool { return c.set }

// Allows reports whether the request carries the credential.
func (c Credential) Allows(r *http.Request) bool {
	if !c.set {
		return true
	}
	h := r.Header.Get("Authorization")
	scheme, token, ok := strings.Cut(h, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		token = ""
	}
	presented := sha256.Sum256([]byte(strings.TrimSpace(token)))
	return subtle.ConstantTimeCompare(presented[:], c.digest[:]) == 1 && token != ""
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
