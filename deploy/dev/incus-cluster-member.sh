#!/usr/bin/env bash
# Starts or kills one member of the cluster rig (deploy/dev/incus-cluster-up.sh)
# by name, keeping the rig's PID records true, so that tests can take a
# member down and bring it back as a crash and a restart would.
#
#   deploy/dev/incus-cluster-member.sh start lsm3   # start its incusd, wait until ready
#   deploy/dev/incus-cluster-member.sh kill lsm3    # SIGKILL its incusd (its guests keep running)
set -euo pipefail
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
CLUSTER_DIR=${CLUSTER_DIR:-$STATE_DIR/cluster}
say() { printf 'incus-cluster-member: %s\n' "$*" >&2; }
[ $# = 2 ] || { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
action=$1 member=$2
case $member in lsm1 | lsm2 | lsm3) ;; *) say "no member $member in the rig (lsm1, lsm2, lsm3)"; exit 2 ;; esac
d=/var/lib/incus-$member
INCUSD=$(command -v incusd || echo /usr/libexec/incus/incusd)

recorded() { # the recorded PID, if it is still this member's incusd
  local pid
  [ -f "$d/rig.pid" ] || return 1
  read -r pid < "$d/rig.pid"
  kill -0 "$pid" 2>/dev/null && tr '\0' ' ' < "/proc/$pid/environ" 2>/dev/null | grep -q "INCUS_DIR=$d" && echo "$pid"
}

record_pids() { # rewrite cluster.env's PID list from the members' records
  local env=$CLUSTER_DIR/cluster.env pids=() m
  [ -f "$env" ] || return 0
  for m in lsm1 lsm2 lsm3; do pids+=("$(cat "/var/lib/incus-$m/rig.pid" 2>/dev/null || echo 0)"); done
  local IFS=,
  sed "s/^INCUS_CLUSTER_PIDS=.*/INCUS_CLUSTER_PIDS=${pids[*]}/" "$env" > "$env.new" && mv "$env.new" "$env"
}

case $action in
start)
  if pid=$(recorded); then say "$member runs already (PID $pid)"; exit 0; fi
  mkdir -m 0711 -p "$d"
  # Its own session and no inherited output: a daemon holding the caller's
  # pipe would keep a CI run from ending. INCUS_SKIP_INSTANCE_TYPES keeps it
  # from looking up the public image server.
  INCUS_DIR=$d INCUS_SKIP_INSTANCE_TYPES=1 setsid "$INCUSD" --group root \
    --logfile "$d/incusd.log" </dev/null >>"$d/incusd.out" 2>&1 &
  echo "$!" > "$d/rig.pid"
  record_pids
  INCUS_DIR=$d incus admin waitready --timeout=60 >/dev/null 2>&1 || {
    say "member $member did not become ready within 60 s; see $d/incusd.log"; exit 1; }
  # A member that was in the cluster before answers on its socket at once,
  # but the others forward calls to it only once they see it again (1-14
  # s): wait until another member forwards a call to it three times in a
  # row, so the caller finds the cluster as before.
  if [ -f "$CLUSTER_DIR/cluster.env" ]; then
    export INCUS_CONF=$CLUSTER_DIR/client
    other=lsm1; [ "$member" = lsm1 ] && other=lsm2
    ok=0
    for _ in $(seq 1 600); do
      if INCUS_DIR=/var/lib/incus-$other timeout 5 incus query "/1.0?target=$member" >/dev/null 2>&1; then ok=$((ok + 1)); else ok=0; fi
      [ "$ok" -ge 3 ] && break
      sleep 0.2
    done
    [ "$ok" -ge 3 ] || { say "member $member is not reachable through $other 120 s after its start"; exit 1; }
  fi
  ;;
kill)
  pid=$(recorded) || { say "$member does not run"; exit 0; }
  kill -9 "$pid"
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  ;;
*) say "unknown action $action (start or kill)"; exit 2 ;;
esac
