package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
)

// testVersion is stamped into the binary the tests run, so that --version
// and the build_info gauge are seen to carry the build's own version.
const testVersion = "9.8.7-test"

var built struct {
	once sync.Once
	dir  string
	bin  string
	err  error
}

// providerBinary builds cmd/incus-provider once per test run, as it
// ships (static, no race detector, whose shadow memory would swamp what
// the tests measure), and returns its path.
func providerBinary(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		built.dir, built.err = os.MkdirTemp("", "incus-provider-bin-")
		if built.err != nil {
			return
		}
		built.bin = filepath.Join(built.dir, "incus-provider")
		build := exec.Command("go", "build", "-ldflags", "-X github.com/lightspeed-dev/incus-provider/internal/buildinfo.Version="+testVersion, "-o", built.bin, ".")
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			built.err = fmt.Errorf("go build: %w\n%s", err, out)
		}
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.bin
}

func TestMain(m *testing.M) {
	code := m.Run()
	if built.dir != "" {
		_ = os.RemoveAll(built.dir)
	}
	os.Exit(code)
}
