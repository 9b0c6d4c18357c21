#!/usr/bin/env bash
# Brings up a three-member Incus cluster on this machine, beside the ordinary
# daemon (which it never touches), for the cluster tests and `make
# run-cluster`. Safe to run again: a rig that answers is left as it is.
#
# Members lsm1, lsm2, lsm3 listen on 127.0.0.2-4:8443 (loopback only, so no
# packet can leave the machine), keep their state in /var/lib/incus-lsmN and
# are started with INCUS_SKIP_INSTANCE_TYPES=1 (otherwise each looks up the
# public image server). Each member's PID is recorded in $CLUSTER_DIR and
# deploy/dev/incus-cluster-down.sh stops exactly those processes.
#
# The dev guest image is copied from the ordinary daemon (run
# deploy/guest/build-image.sh first) and imported once; the cluster
# replicates it to every member.
#
# Output: $CLUSTER_DIR/cluster.env, a file of shell assignments a provider
# (or a test) sources to reach the cluster over HTTPS with a client
# certificate the cluster trusts and the cluster certificate pinned:
#   INCUS_URL, INCUS_CLIENT_CERT, INCUS_CLIENT_KEY, INCUS_SERVER_CERT,
#   INCUS_CLUSTER_MEMBERS (names), INCUS_CLUSTER_SOCKETS (unix sockets, in the
#   same order), INCUS_CLUSTER_PIDS (daemon PIDs, same order).
#
# Instance names: LXC names each container's cgroup lxc.payload.<name>
# (lxc.payload.<project>_<name> outside the default project) on the whole
# host, shared with the ordinary daemon, so anything created on the rig goes
# into a project of its own (the tests make one per test, prefixed lsc-).
set -euo pipefail

STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
CLUSTER_DIR=${CLUSTER_DIR:-$STATE_DIR/cluster}
IMAGE_ALIAS=${GUEST_IMAGE_ALIAS:-lightspeed-dev-guest}
MEMBERS=(lsm1 lsm2 lsm3)
ADDRS=(127.0.0.2 127.0.0.3 127.0.0.4)
PORT=8443
say() { printf 'incus-cluster-up: %s\n' "$*" >&2; }
fail() { say "$*"; exit 1; }

[ "$(id -u)" = 0 ] || fail "run me as root: the members are system daemons."
INCUSD=$(command -v incusd || echo /usr/libexec/incus/incusd)
[ -x "$INCUSD" ] || fail "incusd is not installed; run deploy/dev/incus-up.sh first."
command -v openssl >/dev/null 2>&1 || fail "openssl is needed to make the rig's client certificate."
mkdir -p "$CLUSTER_DIR"
chmod 0700 "$CLUSTER_DIR"
# The rig's own client configuration: root's client certificates stay untouched.
export INCUS_CONF=$CLUSTER_DIR/client

dir_of() { echo "/var/lib/incus-$1"; }
on() { # on MEMBER incus-args...: the CLI against that member's unix socket
  local m=$1; shift
  INCUS_DIR=$(dir_of "$m") incus "$@"
}
answering() { INCUS_DIR=$(dir_of "$1") timeout 5 incus query /1.0 >/dev/null 2>&1; }
pid_alive() { # pid_alive MEMBER: the recorded PID is that member's incusd
  local f pid
  f=$(dir_of "$1")/rig.pid
  [ -f "$f" ] || return 1
  read -r pid < "$f"
  kill -0 "$pid" 2>/dev/null && tr '\0' ' ' < "/proc/$pid/environ" 2>/dev/null | grep -q "INCUS_DIR=$(dir_of "$1")"
}

formed() {
  [ -f "$CLUSTER_DIR/cluster.env" ] || return 1
  for m in "${MEMBERS[@]}"; do pid_alive "$m" && answering "$m" || return 1; done
  [ "$(on lsm1 cluster list -f csv -c n 2>/dev/null | wc -l)" = 3 ]
}

if formed; then
  say "the cluster answers already (members ${MEMBERS[*]}; $CLUSTER_DIR/cluster.env)"
  exit 0
fi

# Anything half made before is cleared first: a member that once joined
# another cluster cannot be initialised again.
"$(dirname "$0")/incus-cluster-down.sh" >/dev/null 2>&1 || true

for i in 0 1 2; do
  if ss -Hltn "sport = :$PORT" | awk '{print $4}' | grep -qx "${ADDRS[$i]}:$PORT"; then
    fail "${ADDRS[$i]}:$PORT is taken by something else; the rig needs it."
  fi
done

start=$(date +%s%N)
for m in "${MEMBERS[@]}"; do
  "$(dirname "$0")/incus-cluster-member.sh" start "$m"
done

on lsm1 admin init --preseed >/dev/null <<EOF
config:
  core.https_address: ${ADDRS[0]}:$PORT
storage_pools:
- name: data
  driver: dir
profiles:
- name: default
  devices:
    root:
      type: disk
      path: /
      pool: data
cluster:
  server_name: lsm1
  enabled: true
EOF
for i in 1 2; do
  m=${MEMBERS[$i]}
  tok=$(on lsm1 cluster add "$m" --quiet)
  on "$m" admin init --preseed >/dev/null <<EOF
cluster:
  enabled: true
  server_name: $m
  server_address: ${ADDRS[$i]}:$PORT
  cluster_token: $tok
  member_config:
  - entity: storage-pool
    name: data
    key: source
    value: ""
EOF
done

# A client certificate of the rig's own, trusted by the cluster, for the
# provider's HTTPS connections (what a cluster operator gives a provider).
if [ ! -f "$CLUSTER_DIR/client.crt" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
    -subj "/CN=incus-provider-rig" -keyout "$CLUSTER_DIR/client.key" -out "$CLUSTER_DIR/client.crt" >/dev/null 2>&1
  chmod 0600 "$CLUSTER_DIR/client.key"
fi
on lsm1 config trust add-certificate "$CLUSTER_DIR/client.crt" --name incus-provider-rig >/dev/null
# Every member presents the cluster certificate: one pin covers them all.
cp "$(dir_of lsm1)/cluster.crt" "$CLUSTER_DIR/server.crt"

if ! incus image show "$IMAGE_ALIAS" >/dev/null 2>&1; then
  fail "the ordinary daemon has no image $IMAGE_ALIAS; run deploy/guest/build-image.sh first."
fi
img=$(mktemp -d)
trap 'rm -rf "$img"' EXIT
incus image export "$IMAGE_ALIAS" "$img/guest" >/dev/null
on lsm1 image import "$img"/guest* --alias "$IMAGE_ALIAS" >/dev/null

urls=() socks=() pids=()
for i in 0 1 2; do
  urls+=("https://${ADDRS[$i]}:$PORT")
  socks+=("$(dir_of "${MEMBERS[$i]}")/unix.socket")
  pids+=("$(cat "$(dir_of "${MEMBERS[$i]}")/rig.pid")")
done
join() { local IFS=,; echo "$*"; }
cat > "$CLUSTER_DIR/cluster.env.new" <<EOF
INCUS_URL=$(join "${urls[@]}")
INCUS_CLIENT_CERT=$CLUSTER_DIR/client.crt
INCUS_CLIENT_KEY=$CLUSTER_DIR/client.key
INCUS_SERVER_CERT=$CLUSTER_DIR/server.crt
INCUS_CLUSTER_MEMBERS=$(join "${MEMBERS[@]}")
INCUS_CLUSTER_SOCKETS=$(join "${socks[@]}")
INCUS_CLUSTER_PIDS=$(join "${pids[@]}")
EOF
mv "$CLUSTER_DIR/cluster.env.new" "$CLUSTER_DIR/cluster.env"
ms=$(( ($(date +%s%N) - start) / 1000000 ))
say "cluster of ${MEMBERS[*]} formed in ${ms} ms, image $IMAGE_ALIAS imported; settings in $CLUSTER_DIR/cluster.env"
