package bearer

import (
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
)

func allows(c Credential, token string) bool {
	r := httptest.NewRequest("GET", "/control", nil)
	if token != "" {
		r.Header.Set("Authorization", "Bearer "+token)
	}
	return c.Allows(r)
}

// TestReloadRotatesEveryCopy: a reload is seen through every copy of the
// credential (each handler holds one), the old secret stops passing, and a
// file that cannot be used leaves the credential in force as it was.
func TestReloadRotatesEveryCopy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "credential")
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("old-secret\n")
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	copyHeld := c
	if !allows(copyHeld, "old-secret") || allows(copyHeld, "") || allows(copyHeld, "new-secret") {
		t.Fatal("before the reload only the old secret passes")
	}
	write(" new-secret \n")
	if err := c.Reload(path); err != nil {
		t.Fatal(err)
	}
	if !allows(copyHeld, "new-secret") || allows(copyHeld, "old-secret") {
		t.Fatal("after the reload a copy still checks the old secret")
	}
	write("   \n")
	if err := c.Reload(path); err == nil {
		t.Fatal("an empty file was taken")
	}
	if err := c.Reload(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("a missing file was taken")
	}
	if !allows(copyHeld, "new-secret") {
		t.Fatal("a refused reload changed the credential in force")
	}
	var none Credential
	if none.Reload(path) == nil || none.Enabled() || !allows(none, "") {
		t.Fatal("no credential configured: a reload must not turn one on")
	}
}
