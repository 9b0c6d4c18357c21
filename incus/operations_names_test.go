package incus

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// Every op a request names in this package's source is in Operations, so
// that the metrics start it at zero.
func TestOperationsNamesEveryCall(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	lit := regexp.MustCompile(`\bop:\s*"([a-z.]+)"`)
	found := 0
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range lit.FindAllStringSubmatch(string(src), -1) {
			found++
			if !slices.Contains(Operations(), m[1]) {
				t.Errorf("%s: op %q is not in Operations()", f, m[1])
			}
		}
	}
	if found < len(Operations()) {
		t.Errorf("found %d op literals for %d operations; a listed operation is no longer made, or this test misses a form", found, len(Operations()))
	}
}
