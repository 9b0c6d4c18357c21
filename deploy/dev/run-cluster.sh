#!/usr/bin/env bash
# `make run-cluster`: the provider as a cluster operator runs it, on this
# machine. Brings up the three-member Incus cluster rig
# (deploy/dev/incus-cluster-up.sh), starts two provider replicas on it (on
# members lsm1 and lsm2, every member's URL in INCUS_URL) and HAProxy in
# front of them (deploy/haproxy/incus-provider.cfg, and -edge.cfg for the
# public ingress edge every replica serves under one base URL), prints the
# controller URL and the ingress base as `make run` does, and runs in the
# foreground. Ctrl-C or SIGTERM
# stops the replicas and HAProxy, and removes the rig if this run made it.
#
# The environment is honoured as by `make run`, for every replica
# (PROVIDER_CREDENTIAL_FILE, PROVIDER_TEMPLATES, PROVIDER_LOG_LEVEL, ...);
# PROVIDER_LISTEN is where HAProxy listens (default 127.0.0.1:8480), and
# PROVIDER_INGRESS_LISTEN where its edge does (default 127.0.0.1:8482;
# PROVIDER_INGRESS_BASE_URL defaults to http://{label}.localhost:8482).
# INCUS_PROJECT defaults to lsc-dev on the rig (created if missing; the
# rig's projects start with lsc-).
set -euo pipefail
cd "$(dirname "$0")/../.."
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
say() { printf 'run-cluster: %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || fail "run me as root: the rig's members are system daemons."
[ -z "${PROVIDER_TLS_CERT:-}${PROVIDER_TLS_KEY:-}" ] || fail "PROVIDER_TLS_CERT/KEY are not supported here: HAProxy would have to terminate TLS; run the replicas with TLS behind your own TLS-terminating balancer."
case ${INCUS_PROJECT:=lsc-dev} in lsc-*) ;; *) fail "INCUS_PROJECT=$INCUS_PROJECT: on the rig, use a project named lsc-… (its teardown and cgroup names rely on it)." ;; esac
LB_LISTEN=${PROVIDER_LISTEN:-127.0.0.1:8480}
EDGE_LISTEN=${PROVIDER_INGRESS_LISTEN:-127.0.0.1:8482}
edge_base="http://{label}.localhost:${EDGE_LISTEN##*:}" # braces inside ${:-} would end it early
export PROVIDER_INGRESS_BASE_URL=${PROVIDER_INGRESS_BASE_URL:-$edge_base}
export PROVIDER_TEMPLATES=${PROVIDER_TEMPLATES:-deploy/templates.dev.yaml}

if ! command -v haproxy >/dev/null 2>&1; then
  say "installing HAProxy from Debian"
  DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy >>"$STATE_DIR/apt.log" 2>&1 || fail "apt-get install haproxy failed; see $STATE_DIR/apt.log"
fi
mkdir -p "$STATE_DIR" bin
go build -o bin/incus-provider ./cmd/incus-provider
deploy/dev/incus-up.sh
deploy/guest/build-image.sh >/dev/null
made_rig=0
[ -f "$STATE_DIR/cluster/cluster.env" ] || made_rig=1
deploy/dev/incus-cluster-up.sh

work=$(mktemp -d)
pids=()
cleanup() {
  trap - INT TERM EXIT
  say "stopping"
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ "$made_rig" = 1 ]; then deploy/dev/incus-cluster-down.sh || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

export INCUS_CONF=$STATE_DIR/cluster/client
INCUS_DIR=/var/lib/incus-lsm1 incus project show "$INCUS_PROJECT" >/dev/null 2>&1 ||
  INCUS_DIR=/var/lib/incus-lsm1 incus project create "$INCUS_PROJECT" -c features.images=false -c features.profiles=false >/dev/null

members=(lsm1 lsm2)
# Each replica serves its member's guests to the other on its member's
# address (PROVIDER_PEER_LISTEN); both read one peer list and one secret.
# Guests on lsm3, which has no replica here, are reached through exec.
if [ -z "${PROVIDER_PEER_SECRET_FILE:-}" ]; then
  PROVIDER_PEER_SECRET_FILE=$work/peer.secret
  (umask 077; od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$PROVIDER_PEER_SECRET_FILE")
fi
export PROVIDER_PEER_SECRET_FILE
export PROVIDER_PEERS=${PROVIDER_PEERS:-lsm1=127.0.0.2:18500,lsm2=127.0.0.3:18500}
for i in 0 1; do
  n=$((i + 1))
  (
    set -a; . "$STATE_DIR/cluster/cluster.env"; set +a
    # The rig's own lists are not the provider's settings, which it would refuse.
    unset INCUS_CLUSTER_MEMBERS INCUS_CLUSTER_SOCKETS INCUS_CLUSTER_PIDS
    # Each replica serves the edge under the one base URL HAProxy answers.
    PROVIDER_LISTEN=127.0.0.1:$((18490 + n)) PROVIDER_METRICS_LISTEN=127.0.0.1:$((19490 + n)) PROVIDER_INGRESS_LISTEN=127.0.0.1:$((18493 + n)) PROVIDER_DRAIN_DELAY=${PROVIDER_DRAIN_DELAY:-2s} \
      PROVIDER_INCUS_MEMBER=${members[$i]} PROVIDER_REPLICA_ID=replica$n PROVIDER_PEER_LISTEN=127.0.0.$((n + 1)):18500 \
      exec bin/incus-provider >"$work/replica$n.out" 2>"$work/replica$n.log"
  ) &
  pids+=("$!")
done
for n in 1 2; do
  for _ in $(seq 1 150); do grep -q '^controller URL' "$work/replica$n.out" 2>/dev/null && break; sleep 0.1; done
  grep -q '^controller URL' "$work/replica$n.out" || { cat "$work/replica$n.log" >&2; fail "replica $n did not start"; }
done
LB_LISTEN=$LB_LISTEN REPLICA1=127.0.0.1:18491 REPLICA2=127.0.0.1:18492 REPLICA1_CHECK_PORT=19491 REPLICA2_CHECK_PORT=19492 \
  EDGE_LISTEN=$EDGE_LISTEN REPLICA1_EDGE=127.0.0.1:18494 REPLICA2_EDGE=127.0.0.1:18495 \
  haproxy -db -f deploy/haproxy/incus-provider.cfg -f deploy/haproxy/incus-provider-edge.cfg >"$work/haproxy.log" 2>&1 &
pids+=("$!")
lb=$!
sleep 0.5
kill -0 "$lb" 2>/dev/null || { cat "$work/haproxy.log" >&2; fail "HAProxy did not start"; }

say "replicas on members ${members[*]} (logs: $work/replica1.log, $work/replica2.log), forwarding to each other ($PROVIDER_PEERS), HAProxy on $LB_LISTEN and, for the edge, $EDGE_LISTEN"
echo "controller URL: ws://$LB_LISTEN/control"
grep '^templates:' "$work/replica1.out"
echo "public ingress: $PROVIDER_INGRESS_BASE_URL (edge on $EDGE_LISTEN)"
# In the foreground until Ctrl-C, SIGTERM, or a process ends.
wait -n "${pids[@]}" || true
say "a replica or HAProxy ended; stopping the rest"
