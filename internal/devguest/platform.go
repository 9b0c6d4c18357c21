package devguest

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"time"
)

// bashCandidates are the absolute paths probed for a verified Bash.
var bashCandidates = []string{"/bin/bash", "/usr/bin/bash", "/usr/local/bin/bash"}

var bashVersion = regexp.MustCompile(`^GNU bash, version ([0-9]+\.[0-9]+[0-9A-Za-z.()_-]*)`)

// probeShells runs a bounded `--version` probe of each Bash candidate once,
// at start-up, and lists only the ones that answered as GNU Bash. BusyBox's
// sh is not one of the protocol's shell kinds (bash, powerShell,
// windowsPowerShell, gitBash), so a BusyBox-only guest lists no shell at all
// rather than passing it off as Bash.
func probeShells(ctx context.Context) []Shell {
	var shells []Shell
	seen := map[string]bool{}
	for _, candidate := range bashCandidates {
		real, err := filepath.EvalSymlinks(candidate)
		if err != nil || seen[real] {
			continue
		}
		fi, err := os.Stat(real)
		if err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
			continue
		}
		seen[real] = true
		probeCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
		cmd := exec.CommandContext(probeCtx, candidate, "--version")
		cmd.Env = []string{"PATH=/usr/bin:/bin", "LC_ALL=C"}
		var out limitedBuffer
		out.limit = 4096
		cmd.Stdout = &out
		err = cmd.Run()
		cancel()
		if err != nil {
			continue
		}
		line, _, _ := bytes.Cut(out.Bytes(), []byte("\n"))
		if m := bashVersion.FindSubmatch(line); m != nil {
			shells = append(shells, Shell{Kind: "bash", Path: candidate, Version: string(m[1])})
		}
	}
	return shells
}

type limitedBuffer struct {
	bytes.Buffer
	limit int
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := b.limit - b.Len(); room > 0 {
		b.Buffer.Write(p[:min(room, len(p))])
	}
	return len(p), nil
}

// homeDirectory is the home of the user commands run as (the daemon's own
// user), when it exists as a directory. The filesystem root is "/", so any
// home lies inside it.
func homeDirectory() string {
	home := ""
	if u, err := user.Current(); err == nil {
		home = u.HomeDir
	}
	if home == "" {
		home = os.Getenv("HOME")
	}
	if home == "" || !filepath.IsAbs(home) || checkPath("", home) != nil {
		return ""
	}
	if fi, err := os.Stat(home); err != nil || !fi.IsDir() {
		return ""
	}
	return home
}
