// Package buildinfo stamps what this binary is: its version, the git
// revision it was built from, and the platform it targets.
package buildinfo

import (
	_ "embed" // the release this tree is on
	"runtime"
	"runtime/debug"
	"strings"
)

// release is the version of the release this tree leads to, VERSION's
// (docs/operations.md, "Versions"); CHANGELOG.md says what it holds.
//
//go:embed VERSION
var release string

// Release is the version this tree's releases carry, MAJOR.MINOR.PATCH.
func Release() string { return strings.TrimSpace(release) }

// Version is set by the build (-ldflags "-X …buildinfo.Version=…"): make
// build sets the release's at its tag, and the release's with -dev
// elsewhere; any other build falls back to the module version Go
// recorded, else the release's with -dev.
var Version = ""

// Info is a build's description.
type Info struct {
	Version   string
	GitSha    string
	Target    string
	GoVersion string // the toolchain that built it, as runtime.Version
}

// Read returns this binary's build facts.
func Read() Info {
	info := Info{Version: Version, Target: runtime.GOOS + "/" + runtime.GOARCH, GoVersion: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		if info.Version == "" && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
			info.Version = bi.Main.Version
		}
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				info.GitSha = s.Value
			}
		}
	}
	if info.Version == "" {
		info.Version = Release() + "-dev"
	}
	return info
}

// Peer is clientInfo or serverInfo on every plane: a build's description.
// It is descriptive only; nothing selects, gates or authenticates on it.
type Peer struct {
	Name    string `json:"name" wire:"info"`
	Version string `json:"version,omitempty" wire:"info"`
	GitSha  string `json:"gitSha,omitempty" wire:"info"`
	Target  string `json:"target,omitempty" wire:"info"`
}

// Describe is this binary's build as a peer named name.
func Describe(name string) Peer {
	b := Read()
	return Peer{Name: name, Version: b.Version, GitSha: b.GitSha, Target: b.Target}
}
