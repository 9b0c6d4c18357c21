#!/usr/bin/env bash
# Stops the LXD that deploy/dev/lxd-up.sh started (by its recorded PID) and
# removes its network namespace. Instances, images and /var/lib/lxd stay.
set -euo pipefail
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
export LXD_DIR=/var/lib/lxd LXD_CONF=$STATE_DIR/lxd-client
say() { printf 'lxd-down: %s\n' "$*" >&2; }
[ -f "$STATE_DIR/lxd.pid" ] || { say "no LXD started by lxd-up.sh"; exit 0; }
read -r pid _ < "$STATE_DIR/lxd.pid"
lxd shutdown --timeout=30 >/dev/null 2>&1 || true
if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; sleep 1; kill -9 "$pid" 2>/dev/null || true; fi
# A proxy device's forkproxy outlives an LXD killed before it stopped the
# container (seen after a failed run: seven left listening on their guest
# sockets). This machine's LXD is only the one lxd-up.sh starts, so every
# forkproxy left now is its.
pkill -f '^/usr/bin/lxd forkproxy ' 2>/dev/null || true
rm -f "$STATE_DIR/lxd.pid"
ip netns delete lsp-lxd 2>/dev/null || true
say "stopped"
