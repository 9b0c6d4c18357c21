#!/usr/bin/env bash
# The whole test suite on this machine: lint, unit and integration tests
# against a real incusd with the development guest image, then the
# conformance suite against a provider process started here. Installs and
# starts what it needs; stops what it started; leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
began=$(date +%s)
# Each step says when it began, in seconds since the run did.
step() { printf '\n== %s (at %s s)\n' "$*" "$(( $(date +%s) - began ))"; }
# shellcheck source=deploy/dev/lib.sh
. deploy/dev/lib.sh

# We stop incusd at the end only if this run started it: incus-up.sh
# writes a new PID file exactly when it starts the daemon.
pid_before=$(cat "$STATE_DIR/incusd.pid" 2>/dev/null || true)
started_incus=0
started_cluster=0
started_lxd=0
suffix() { head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
conform_project="lsconform-$(suffix)"
cluster_project="lsc-conform-$(suffix)"
lxd_project="lsx-conform-$(suffix)"
declare -A lane_pid=()
work=$(mktemp -d)
cleanup() {
  status=$?
  # A lane still running (this run failed or was stopped) is stopped with
  # everything it started: each is a process group of its own.
  for l in "${!lane_pid[@]}"; do
    if [ -n "${lane_pid[$l]}" ]; then kill -- "-${lane_pid[$l]}" 2>/dev/null || true; wait "${lane_pid[$l]}" 2>/dev/null || true; fi
  done
  drop_incus_project "$conform_project"
  if [ -d /var/lib/incus-lsm1 ]; then
    export INCUS_DIR=/var/lib/incus-lsm1 INCUS_CONF="$STATE_DIR/cluster/client"
    drop_incus_project "$cluster_project"
    unset INCUS_DIR INCUS_CONF
  fi
  if [ -S /var/lib/lxd/unix.socket ]; then
    for i in $(LXD_DIR=/var/lib/lxd LXD_CONF="$STATE_DIR/lxd-client" lxc list --project "$lxd_project" --format csv -c n 2>/dev/null); do
      LXD_DIR=/var/lib/lxd LXD_CONF="$STATE_DIR/lxd-client" lxc delete --force --project "$lxd_project" "$i" >/dev/null 2>&1 || true; done
    LXD_DIR=/var/lib/lxd LXD_CONF="$STATE_DIR/lxd-client" lxc project delete "$lxd_project" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
  if [ "$started_lxd" = 1 ]; then deploy/dev/lxd-down.sh || true; fi
  if [ "$started_cluster" = 1 ]; then deploy/dev/incus-cluster-down.sh || true; fi
  if [ "$started_incus" = 1 ] && [ -f "$STATE_DIR/incusd.pid" ]; then deploy/dev/incus-down.sh || true; fi
  exit $status
}
trap cleanup EXIT

step "Incus"
deploy/dev/incus-up.sh
pid_after=$(cat "$STATE_DIR/incusd.pid" 2>/dev/null || true)
if [ -n "$pid_after" ] && [ "$pid_after" != "$pid_before" ]; then started_incus=1; fi

step "development guest image"
deploy/guest/build-image.sh

step "HAProxy (the load balancer in front of replicas in the cluster tests)"
if ! command -v haproxy >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy >>"$STATE_DIR/apt.log" 2>&1 ||
    { apt-get update >>"$STATE_DIR/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y haproxy >>"$STATE_DIR/apt.log" 2>&1; } ||
    { echo "apt-get install haproxy failed; see $STATE_DIR/apt.log" >&2; exit 1; }
fi
haproxy -v | sed -n 1p # sed reads it all: head would end the pipe early (SIGPIPE under pipefail)

step "alert rules (promtool, from Debian's prometheus package, whose server the live metrics test also runs)"
if ! command -v promtool >/dev/null 2>&1; then
  # Only promtool is wanted: the daemon the package would start is kept
  # from starting (policy-rc.d), and nothing it recommends is installed.
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >>"$STATE_DIR/apt.log" 2>&1 ||
    { apt-get update >>"$STATE_DIR/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus >>"$STATE_DIR/apt.log" 2>&1; } ||
    { [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d; echo "apt-get install prometheus failed; see $STATE_DIR/apt.log" >&2; exit 1; }
  if [ "$made_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi
promtool check rules deploy/prometheus/alerts.yaml
promtool test rules deploy/prometheus/alerts_test.yaml

step "Chromium (the headless browser of the public ingress test)"
if ! command -v chromium >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >>"$STATE_DIR/apt.log" 2>&1 ||
    { apt-get update >>"$STATE_DIR/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >>"$STATE_DIR/apt.log" 2>&1; } ||
    { echo "apt-get install chromium failed; see $STATE_DIR/apt.log" >&2; exit 1; }
fi
chromium --version | sed -n 1p

step "three-member Incus cluster (deploy/dev/incus-cluster-up.sh)"
# Removed at the end only if this run made it.
if [ ! -f "$STATE_DIR/cluster/cluster.env" ]; then started_cluster=1; fi
deploy/dev/incus-cluster-up.sh
export INCUS_PROVIDER_REQUIRE_CLUSTER=1

step "LXD 5.0 (deploy/dev/lxd-up.sh), for its lane below"
lxd_pid_before=$(cat "$STATE_DIR/lxd.pid" 2>/dev/null || true)
deploy/dev/lxd-up.sh
lxd_pid_after=$(cat "$STATE_DIR/lxd.pid" 2>/dev/null || true)
if [ -n "$lxd_pid_after" ] && [ "$lxd_pid_after" != "$lxd_pid_before" ]; then started_lxd=1; fi

step "lint"
deploy/dev/lint.sh

step "build"
mkdir -p bin
go build -o bin/incus-provider ./cmd/incus-provider
go build -o bin/lsconform ./cmd/lsconform
# Every test binary compiled once, in parallel, before the lanes share the
# cores with Incus.
go test -race -count=1 -run '^$' ./... >/dev/null
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/credential"

# The tests run in three lanes. The host lane has the host's Incus: every
# package one at a time (a few of the provider's tests' cases two at a time),
# then conformance and the container image, then LXD's tests and
# conformance. The rigs lane has the three-member cluster's tests and
# conformance, then the balanced package on the host's Incus.
# The light lane has the packages that reach no Incus. Each lane owns what
# it changes (its Incus projects, every test making a throwaway one, and
# its fixed ports), so they can run at once (the default, below). Four
# Incus lanes at once were measured on this 2-core machine: the load
# stayed at 15 to 18 and wakes from stopped outgrew the 5 s hold. A lane's output is kept in a file and shown whole
# when the lane ends, so lanes never interleave.

# serve NAME ENV...: starts bin/incus-provider with the given settings (as
# NAME=VALUE words) and waits for it to serve; its pid is in $served.
serve() {
  local name=$1; shift
  # A name served before (LXD's two dialers) left its files: the shell
  # truncates them in the child, after the fork, so await_provider could
  # read the last process's "controller URL" and the suite would dial a
  # port nothing listens on yet. Measured: CI at 210e55b, conformance on
  # LXD's proxy dialer, 24 checks refused.
  rm -f "$work/$name.out" "$work/$name.log"
  # shellcheck disable=SC2046 # one word per option
  env $(provider_env_unset) "$@" PROVIDER_TEMPLATES=deploy/templates.dev.yaml PROVIDER_CREDENTIAL_FILE="$work/credential" \
    PROVIDER_GRACEFUL_STOP=5s bin/incus-provider >"$work/$name.out" 2>"$work/$name.log" &
  served=$! served_log="$work/$name.log"
  await_provider "$served" "$work/$name.out" "$work/$name.log"
}
stop_served() {
  kill "$served" 2>/dev/null || true; wait "$served" 2>/dev/null || true; served=""
  no_busy_warnings "$served_log"
}

# The host's package the rigs lane runs once its cluster is done, so that
# the two lanes end together: measured at 13f0da1, the host lane took
# 1,285 s and the rigs lane 624 s, and the machine's second core idled for
# the last ten minutes. targets shares no Incus state with the others
# (every test has a throwaway project of its own) and its time fits the gap.
# LXD's tests moved to the host lane for the same reason: at 2b69260 the
# host lane took 674 s and the rigs lane 1,043 s, LXD's part of it about
# 200 s.
balanced=(./targets)

# The packages whose tests reach no Incus at all (fakes, wire, the
# conformance suite against fake controllers): the third lane, "light",
# runs them beside the two from the start. At b27f737 they took 141 s of
# the host lane (conformance alone 96 s, its suite waiting out idle
# policies against fakes) and internal/jsonrpc 41 s of the rigs lane, on
# about half a core.
light=(./cmd/lsconform ./conformance ./controller ./deploy ./idlepolicy ./ingress
  ./internal/clock ./internal/devguest ./internal/fakeincus ./internal/incusfake
  ./internal/incustest ./internal/ingressurl ./internal/jsonrpc ./internal/lazyconn
  ./internal/routepath ./internal/serve ./internal/wire ./internal/wsframe ./relays)

# Lane "host": every package on the host's Incus but the balanced and
# the light ones (the cluster's tests, named TestCluster*, are the rigs
# lane's), then conformance against a running provider and the container
# image, then LXD's tests and conformance.
lane_host() {
  local skip=() p
  for p in "${balanced[@]}" "${light[@]}"; do skip+=(-e "$(go list "$p")"); done
  # shellcheck disable=SC2046 # one word per package
  INCUS_PROVIDER_REQUIRE_INCUS=1 go test -race -count=1 -p 1 -timeout 25m -skip '^TestCluster' $(go list ./... | grep -vxF "${skip[@]}")
  incus project create "$conform_project" -c features.images=false -c features.profiles=false >/dev/null
  serve provider PROVIDER_LISTEN=127.0.0.1:18480 PROVIDER_METRICS_LISTEN=127.0.0.1:19480 \
    PROVIDER_INGRESS_LISTEN=127.0.0.1:18482 PROVIDER_INGRESS_BASE_URL='http://{label}.localhost:18482' \
    INCUS_PROJECT="$conform_project"
  conform ws://127.0.0.1:18480/control "$work/credential" u-conformance "$work/provider.log"
  # The exposition after a conformance run: what Prometheus will scrape.
  curl -fsS --max-time 10 http://127.0.0.1:19480/metrics > "$work/metrics.txt"
  promtool check metrics < "$work/metrics.txt" || { echo "promtool check metrics found problems (above)" >&2; return 1; }
  stop_served
  echo "== container image (Dockerfile, podman build --pull=never) against the host's Incus"
  deploy/dev/container-test.sh
  echo "== LXD 5.0"
  lxd_tests
}

# Lane "rigs": the cluster, then the balanced packages on the host's
# Incus.
lane_rigs() {
  echo "== the three-member cluster"
  rigs_cluster
  echo "== on the host's Incus: ${balanced[*]}"
  INCUS_PROVIDER_REQUIRE_INCUS=1 go test -race -count=1 -p 1 -timeout 25m -skip '^TestCluster' "${balanced[@]}"
}

# Lane "light": the packages that reach no Incus, one at a time, so that
# the lane takes about half a core beside the two others.
lane_light() {
  INCUS_PROVIDER_REQUIRE_INCUS=1 go test -race -count=1 -p 1 -timeout 25m "${light[@]}"
}

# The three-member cluster's tests, then conformance against a provider on
# the cluster rig (all members' URLs, guests reached by member/exec).
rigs_cluster() {
  INCUS_PROVIDER_REQUIRE_INCUS=1 INCUS_PROVIDER_REQUIRE_CLUSTER=1 go test -race -count=1 -timeout 25m -run '^TestCluster' ./provider
  INCUS_DIR=/var/lib/incus-lsm1 INCUS_CONF="$STATE_DIR/cluster/client" \
    incus project create "$cluster_project" -c features.images=false -c features.profiles=false >/dev/null
  # The rig's settings (every member's URL, its certificates) reach only
  # this provider: a subshell of their own.
  (
    set -a; . "$STATE_DIR/cluster/cluster.env"; set +a
    trap '[ -z "$served" ] || { kill "$served" 2>/dev/null; wait "$served" 2>/dev/null; }' EXIT
    serve cluster-provider PROVIDER_LISTEN=127.0.0.1:18481 PROVIDER_METRICS_LISTEN=127.0.0.1:19481 \
      PROVIDER_INGRESS_LISTEN=127.0.0.1:18483 PROVIDER_INGRESS_BASE_URL='http://{label}.localhost:18483' \
      INCUS_PROJECT="$cluster_project" PROVIDER_INCUS_MEMBER=lsm1
    grep -q '"kind":"member","member":"lsm1","clustered":true' "$work/cluster-provider.log" || {
      echo "the provider on the cluster did not choose the member dialer:" >&2; grep 'guest dialer' "$work/cluster-provider.log" >&2; exit 1; }
    conform ws://127.0.0.1:18481/control "$work/credential" u-conformance "$work/cluster-provider.log"
    stop_served
  )
}

# On LXD 5.0, the tests that hold for any Incus-API server (the rest rely
# on Incus's own behaviour: its fault injection, the cluster), and
# conformance, with both dialers.
lxd_tests() {
  local tests='^(TestCacheFollowsEveryTransition|TestCacheStreamCutGoesToIncus|TestCacheManyOwners|TestRoutes|TestActiveMeansStartedAndClosesAtOnce|TestManyOwnersCreateAndObserveAtOnce|TestPowerDownRightAfterAWakingConnection|TestCreateBecomesActiveAndCloseRemovesIt|TestConcurrentCreatesLeaveOneInstance|TestOwnerFencing|TestSetPowerPauseResumeStopStart|TestSetPowerRefusals|TestSetPowerOfAProvisioningTarget|TestIdleActOnIncus|TestWarmHandoutBecomesActiveAndThePoolRefills|TestWarmCrashMidHandout)$'
  # What the dialer decides: reaching the guest's daemon (routes, wakes,
  # readiness, the idle probe). The rest is the same Incus calls whichever
  # dialer, and runs once, with netns.
  local dialed='^(TestRoutes|TestActiveMeansStartedAndClosesAtOnce|TestPowerDownRightAfterAWakingConnection|TestADeadDaemonDeviceIsRestarted|TestIdleActOnIncus|TestWarmHandoutBecomesActiveAndThePoolRefills)$'
  LXD_DIR=/var/lib/lxd LXD_CONF="$STATE_DIR/lxd-client" lxc project create "$lxd_project" -c features.images=false -c features.profiles=false >/dev/null
  for dialer in netns proxy; do
    local run=$tests
    if [ "$dialer" = proxy ]; then run=$dialed; fi
    echo "== LXD, the $dialer dialer"
    INCUS_PROVIDER_TEST_SOCKET=/var/lib/lxd/unix.socket INCUS_PROVIDER_TEST_DIALER=$dialer INCUS_PROVIDER_REQUIRE_INCUS=1 \
      go test -race -count=1 -p 1 -timeout 15m -run "$run" ./provider ./targets
    mkdir -p -m 0700 "$work/lxd-guests"
    serve lxd-provider PROVIDER_LISTEN=127.0.0.1:18487 PROVIDER_METRICS_LISTEN=127.0.0.1:19487 \
      PROVIDER_INGRESS_LISTEN=127.0.0.1:18488 PROVIDER_INGRESS_BASE_URL='http://{label}.localhost:18488' \
      INCUS_SOCKET=/var/lib/lxd/unix.socket INCUS_PROJECT="$lxd_project" \
      PROVIDER_GUEST_DIALER=$dialer PROVIDER_GUEST_SOCKET_DIR="$work/lxd-guests"
    conform ws://127.0.0.1:18487/control "$work/credential" u-conformance "$work/lxd-provider.log"
    stop_served
    # A socket is left behind when its instance is gone; the pool's ready
    # spares (started, so listening) stay, and so do their sockets.
    local left=0 sock inst
    for sock in "$work"/lxd-guests/*.sock; do
      [ -e "$sock" ] || continue
      inst=$(basename "$sock" .sock)
      LXD_DIR=/var/lib/lxd LXD_CONF="$STATE_DIR/lxd-client" lxc info --project "$lxd_project" "$inst" >/dev/null 2>&1 || left=$((left + 1))
    done
    [ "$left" = 0 ] || { echo "the $dialer dialer left $left proxy sockets behind after conformance closed every target" >&2; return 1; }
  done
}

# The lanes run at once by default; TEST_LANES_AT_ONCE=0 runs them one
# after the other (measured here with two lanes: 1,825 s against 1,432 s),
# for a machine with less to spare than this 2-core one.
at_once=${TEST_LANES_AT_ONCE:-1}
lanes=(host rigs light)
if [ "$at_once" = 1 ]; then step "tests in three lanes at once: host, rigs, light"; else step "tests in three lanes, one after the other: host, rigs, light"; fi
declare -A lane_began
failed=()
summary=()
launch() {
  local l=$1
  lane_began[$l]=$(date +%s)
  # Job control gives each lane a process group of its own, so that a
  # failed run stops everything a lane started (cleanup kills the group).
  set -m
  (
    set -euo pipefail
    served=""
    # The lane's own end, for its time: its finish may be read later.
    trap '[ -z "$served" ] || { kill "$served" 2>/dev/null; wait "$served" 2>/dev/null; }; date +%s > "$work/lane-$l.end"' EXIT
    "lane_$l"
  ) >"$work/lane-$l.log" 2>&1 &
  lane_pid[$l]=$!
  set +m
}
finish() {
  local l=$1 status=0 took
  wait "${lane_pid[$l]}" || status=$?
  lane_pid[$l]=""
  took=$(( $(cat "$work/lane-$l.end" 2>/dev/null || date +%s) - lane_began[$l] ))
  if [ "$status" = 0 ]; then summary+=("$l ${took}s ok"); else summary+=("$l ${took}s FAILED ($status)"); failed+=("$l"); fi
  printf '\n== lane %s (%s s, exit %s)\n' "$l" "$took" "$status"
  cat "$work/lane-$l.log"
}
if [ "$at_once" = 1 ]; then
  for l in "${lanes[@]}"; do launch "$l"; done
  for l in "${lanes[@]}"; do finish "$l"; done
else
  for l in "${lanes[@]}"; do launch "$l"; finish "$l"; done
fi
printf '\n== lanes: %s\n' "$(IFS=,; echo "${summary[*]}" | sed 's/,/; /g')"
if [ "${#failed[@]}" -gt 0 ]; then echo "failed lanes: ${failed[*]}" >&2; exit 1; fi
printf '== make test: %s s\n' "$(( $(date +%s) - began ))"
