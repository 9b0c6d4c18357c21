#!/usr/bin/env bash
# Create → active and create → opened, the runtime's way, of this tree
# against a baseline build, in one run (issue 27): incus-provider is built
# from the current tree and from CREATEBENCH_BASE (default 568fd0f, the
# issue's starting point, in a throwaway git worktree), and cmd/createbench
# measures both in turn beside Incus's own create and start, then follows
# this tree's pool sized by demand through a burst (the timeline).
#
# Needs root, Incus at /var/lib/incus/unix.socket and the development guest
# image (built when missing). Exits non-zero only when it cannot measure.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}
base=${CREATEBENCH_BASE:-568fd0f}

if [ "$(id -u)" != 0 ]; then
	echo "createbench: run as root (the provider's guest dialer enters the guests' namespaces)" >&2
	exit 1
fi
[ -S /var/lib/incus/unix.socket ] || deploy/dev/incus-up.sh
incus image info lightspeed-dev-guest >/dev/null 2>&1 || deploy/guest/build-image.sh >/dev/null

work=$(mktemp -d /tmp/createbench.XXXXXX)
cleanup() {
	git worktree remove --force "$work/base" >/dev/null 2>&1 || true
	git worktree prune
	rm -rf "$work"
}
trap cleanup EXIT

echo "createbench: building incus-provider at $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with local changes)') and at $base" >&2
go build -o "$work/new" ./cmd/incus-provider
git worktree add --quiet --detach "$work/base" "$base"
(cd "$work/base" && go build -o "$work/old" ./cmd/incus-provider)
echo "== $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) at the start"
go run ./cmd/createbench -build "old=$work/old" -build "new=$work/new" -timeline new "$@"
