#!/usr/bin/env bash
# Removes Incus (and LXD) projects that test runs create (lsit-*, lsconform-*) and that a
# killed run left behind, with everything in them. Touches nothing else.
set -euo pipefail
for p in $(incus project list --format csv -c n 2>/dev/null | sed 's/ (current)//' | grep -E '^(lsit-|lsconform-)' || true); do
  for i in $(incus list --project "$p" --format csv -c n); do
    incus delete --force --project "$p" "$i" >/dev/null 2>&1 || true
  done
  incus project delete "$p" >/dev/null 2>&1 || echo "clean: could not delete project $p" >&2
done
# The same on the LXD of deploy/dev/lxd-up.sh (lsit-*, lsx-conform-*), if it runs.
export LXD_DIR=/var/lib/lxd LXD_CONF=${STATE_DIR:-/run/incus-provider-dev}/lxd-client
if command -v lxc >/dev/null 2>&1 && [ -S "$LXD_DIR/unix.socket" ]; then
  for p in $(lxc project list --format csv -c n 2>/dev/null | sed 's/ (current)//' | grep -E '^(lsit-|lsx-conform-)' || true); do
    for i in $(lxc list --project "$p" --format csv -c n); do
      lxc delete --force --project "$p" "$i" >/dev/null 2>&1 || true
    done
    lxc project delete "$p" >/dev/null 2>&1 || echo "clean: could not delete LXD project $p" >&2
  done
fi
