#!/usr/bin/env bash
# Tears down what deploy/dev/incus-cluster-up.sh made, and only that: the
# rig's instances, its three incusd processes (by their recorded PIDs, never
# by name), their mounts and state directories. The ordinary daemon is left
# alone. Safe to run when nothing is up.
set -euo pipefail
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
CLUSTER_DIR=${CLUSTER_DIR:-$STATE_DIR/cluster}
MEMBERS=(lsm1 lsm2 lsm3)
export INCUS_CONF=$CLUSTER_DIR/client
say() { printf 'incus-cluster-down: %s\n' "$*" >&2; }
dir_of() { echo "/var/lib/incus-$1"; }

recorded_pid() { # prints the member's incusd PID if the record still names it
  local d f pid
  d=$(dir_of "$1"); f=$d/rig.pid
  [ -f "$f" ] || return 1
  read -r pid < "$f"
  kill -0 "$pid" 2>/dev/null || return 1
  tr '\0' ' ' < "/proc/$pid/environ" 2>/dev/null | grep -q "INCUS_DIR=$d" || return 1
  echo "$pid"
}

# Instances first, through any member that answers: once the daemons are
# gone, the containers' own monitors would keep them running.
for m in "${MEMBERS[@]}"; do
  recorded_pid "$m" >/dev/null || continue
  export INCUS_DIR; INCUS_DIR=$(dir_of "$m")
  timeout 5 incus query /1.0 >/dev/null 2>&1 || continue
  for p in $(timeout 10 incus project list -f csv -c n 2>/dev/null | sed 's/ (current)$//'); do
    for i in $(timeout 10 incus list --project "$p" -f csv -c n 2>/dev/null); do
      timeout 30 incus delete --force --project "$p" "$i" >/dev/null 2>&1 || true
    done
    [ "$p" = default ] || timeout 10 incus project delete "$p" >/dev/null 2>&1 || true
  done
  break
done
unset INCUS_DIR

for m in "${MEMBERS[@]}"; do
  d=$(dir_of "$m")
  if pid=$(recorded_pid "$m"); then
    INCUS_DIR=$d timeout 15 incus admin shutdown --timeout 10 >/dev/null 2>&1 || kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
done

# Whatever a dead member left running: the LXC monitors and forkproxies
# name the member's directory on their command line; the containers' own
# processes sit in cgroups of the rig's projects (lsc-*).
for p in /proc/[0-9]*; do
  cmd=$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null) || continue
  case $cmd in *"/var/lib/incus-lsm"[123]*) kill -9 "${p#/proc/}" 2>/dev/null || true ;; esac
done
for cg in /sys/fs/cgroup/lxc.payload.lsc-* /sys/fs/cgroup/lxc.monitor.lsc-*; do
  [ -d "$cg" ] || continue
  echo 1 > "$cg/cgroup.kill" 2>/dev/null || true
  for _ in $(seq 1 20); do rmdir "$cg" 2>/dev/null && break; sleep 0.1; done
done

for m in "${MEMBERS[@]}"; do
  d=$(dir_of "$m")
  [ -d "$d" ] || continue
  # Deepest first; lazily, since a dead daemon's mounts may still be busy.
  { grep -o " $d[^ ]*" /proc/self/mounts || true; } | sort -r | while read -r mnt; do umount -l "$mnt" 2>/dev/null || true; done
  rm -rf "$d"
done
rm -rf "$CLUSTER_DIR"

left=$(grep -c ' /var/lib/incus-lsm' /proc/self/mounts || true)
[ "$left" = 0 ] || say "warning: $left mounts under /var/lib/incus-lsm* remain"
if ss -Hltn | awk '{print $4}' | grep -Eq '^127\.0\.0\.[234]:8443$'; then say "warning: something still listens on the rig's addresses"; fi
say "cluster rig removed"
