#!/usr/bin/env bash
# Stops the incusd that deploy/dev/incus-up.sh started, and only that one.
set -euo pipefail
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
pidfile="$STATE_DIR/incusd.pid"
[ -f "$pidfile" ] || exit 0
read -r pid _ < "$pidfile"
rm -f "$pidfile"
if kill -0 "$pid" 2>/dev/null && grep -q incusd "/proc/$pid/cmdline" 2>/dev/null; then
  incus admin shutdown --timeout 30 >/dev/null 2>&1 || kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
fi
