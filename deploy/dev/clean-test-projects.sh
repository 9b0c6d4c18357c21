#!/usr/bin/env bash
# Removes Incus projects that test runs create (lsit-*, lsconform-*) and that a
# killed run left behind, with everything in them. Touches nothing else.
set -euo pipefail
for p in $(incus project list --format csv -c n 2>/dev/null | sed 's/ (current)//' | grep -E '^(lsit-|lsconform-)' || true); do
  for i in $(incus list --project "$p" --format csv -c n); do
    incus delete --force --project "$p" "$i" >/dev/null 2>&1 || true
  done
  incus project delete "$p" >/dev/null 2>&1 || echo "clean: could not delete project $p" >&2
done
