#!/usr/bin/env bash
# The whole test suite on this machine: lint, unit and integration tests
# against a real incusd with the development guest image, then the
# conformance suite against a provider process started here. Installs and
# starts what it needs; stops what it started; leaves nothing behind.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
step() { printf '\n== %s\n' "$*"; }
# shellcheck source=deploy/dev/lib.sh
. deploy/dev/lib.sh

# We stop incusd at the end only if this run started it: incus-up.sh
# writes a new PID file exactly when it starts the daemon.
pid_before=$(cat "$STATE_DIR/incusd.pid" 2>/dev/null || true)
started_incus=0
started_cluster=0
started_lxd=0
provider_pid=""
conform_project="lsconform-$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')"
work=$(mktemp -d)
cleanup() {
  status=$?
  if [ -n "$provider_pid" ]; then kill "$provider_pid" 2>/dev/null || true; wait "$provider_pid" 2>/dev/null || true; fi
  drop_incus_project "$conform_project"
  if [ -n "${cluster_project:-}" ]; then
    export INCUS_DIR=/var/lib/incus-lsm1 INCUS_CONF="$STATE_DIR/cluster/client"
    drop_incus_project "$cluster_project"
    unset INCUS_DIR INCUS_CONF
  fi
  if [ -n "${lxd_project:-}" ]; then
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

step "lint"
deploy/dev/lint.sh

step "unit and integration tests (real Incus)"
mkdir -p bin
go build -o bin/incus-provider ./cmd/incus-provider
go build -o bin/lsconform ./cmd/lsconform
# Compile every test binary in parallel first, then run the packages one
# at a time: they share one incusd on two cores, and a daemon starved by
# several packages' containers at once stalls for a minute at a time.
go test -race -count=1 -run '^$' ./... >/dev/null
INCUS_PROVIDER_REQUIRE_INCUS=1 go test -race -count=1 -p 1 -timeout 25m ./...

step "conformance against a running provider"
incus project create "$conform_project" -c features.images=false -c features.profiles=false >/dev/null
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/credential"
PROVIDER_LISTEN=127.0.0.1:18480 PROVIDER_METRICS_LISTEN=127.0.0.1:19480 \
  PROVIDER_INGRESS_LISTEN=127.0.0.1:18482 PROVIDER_INGRESS_BASE_URL='http://{label}.localhost:18482' \
  PROVIDER_TEMPLATES=deploy/templates.dev.yaml PROVIDER_CREDENTIAL_FILE="$work/credential" \
  INCUS_PROJECT="$conform_project" PROVIDER_GRACEFUL_STOP=5s \
  bin/incus-provider >"$work/provider.out" 2>"$work/provider.log" &
provider_pid=$!
await_provider "$provider_pid" "$work/provider.out" "$work/provider.log"
conform ws://127.0.0.1:18480/control "$work/credential" u-conformance "$work/provider.log"
# The exposition after a conformance run: what Prometheus will scrape.
curl -fsS --max-time 10 http://127.0.0.1:19480/metrics > "$work/metrics.txt"
promtool check metrics < "$work/metrics.txt" || { echo "promtool check metrics found problems (above)" >&2; exit 1; }
kill "$provider_pid" 2>/dev/null || true; wait "$provider_pid" 2>/dev/null || true; provider_pid=""

step "container image (Dockerfile, podman build --pull=never) against the host's Incus"
deploy/dev/container-test.sh

step "conformance against a provider on the cluster rig (all members' URLs, guests reached by member/exec)"
cluster_project="lsc-conform-$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')"
INCUS_DIR=/var/lib/incus-lsm1 INCUS_CONF="$STATE_DIR/cluster/client" \
  incus project create "$cluster_project" -c features.images=false -c features.profiles=false >/dev/null
(
  set -a; . "$STATE_DIR/cluster/cluster.env"; set +a
  PROVIDER_LISTEN=127.0.0.1:18481 PROVIDER_METRICS_LISTEN=127.0.0.1:19481 \
    PROVIDER_INGRESS_LISTEN=127.0.0.1:18483 PROVIDER_INGRESS_BASE_URL='http://{label}.localhost:18483' \
    PROVIDER_TEMPLATES=deploy/templates.dev.yaml PROVIDER_CREDENTIAL_FILE="$work/credential" \
    INCUS_PROJECT="$cluster_project" PROVIDER_INCUS_MEMBER=lsm1 PROVIDER_GRACEFUL_STOP=5s \
    exec bin/incus-provider >"$work/cluster-provider.out" 2>"$work/cluster-provider.log"
) &
provider_pid=$!
await_provider "$provider_pid" "$work/cluster-provider.out" "$work/cluster-provider.log"
grep -q '"kind":"member","member":"lsm1","clustered":true' "$work/cluster-provider.log" || {
  echo "the provider on the cluster did not choose the member dialer:" >&2; grep 'guest dialer' "$work/cluster-provider.log" >&2; exit 1; }
conform ws://127.0.0.1:18481/control "$work/credential" u-conformance "$work/cluster-provider.log"
kill "$provider_pid" 2>/dev/null || true; wait "$provider_pid" 2>/dev/null || true; provider_pid=""

step "LXD 5.0 (deploy/dev/lxd-up.sh): lifecycle, power and route tests, and conformance, with both dialers"
lxd_pid_before=$(cat "$STATE_DIR/lxd.pid" 2>/dev/null || true)
deploy/dev/lxd-up.sh
lxd_pid_after=$(cat "$STATE_DIR/lxd.pid" 2>/dev/null || true)
if [ -n "$lxd_pid_after" ] && [ "$lxd_pid_after" != "$lxd_pid_before" ]; then started_lxd=1; fi
# The tests that hold for any Incus-API server; the rest rely on Incus's own
# behaviour (its fault injection, the cluster) and run on Incus above.
lxd_tests='^(TestCacheFollowsEveryTransition|TestCacheStreamCutGoesToIncus|TestCacheManyOwners|TestRoutes|TestActiveMeansStartedAndClosesAtOnce|TestManyOwnersCreateAndObserveAtOnce|TestPowerDownRightAfterAWakingConnection|TestCreateBecomesActiveAndCloseRemovesIt|TestConcurrentCreatesLeaveOneInstance|TestOwnerFencing|TestSetPowerPauseResumeStopStart|TestSetPowerRefusals|TestSetPowerOfAProvisioningTarget|TestIdleActOnIncus|TestWarmHandoutBecomesActiveAndThePoolRefills|TestWarmCrashMidHandout)$'
lxd_project="lsx-conform-$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')"
LXD_DIR=/var/lib/lxd LXD_CONF="$STATE_DIR/lxd-client" lxc project create "$lxd_project" -c features.images=false -c features.profiles=false >/dev/null
for dialer in netns proxy; do
  # Ten power-down cycles per case, not fifty: the races are Incus's own
  # fifty above; here the server is what differs.
  INCUS_PROVIDER_TEST_SOCKET=/var/lib/lxd/unix.socket INCUS_PROVIDER_TEST_DIALER=$dialer INCUS_PROVIDER_REQUIRE_INCUS=1 \
    PROVIDER_TEST_POWER_CYCLES=10 go test -race -count=1 -p 1 -timeout 10m -run "$lxd_tests" ./provider ./targets
  mkdir -p -m 0700 "$work/lxd-guests"
  PROVIDER_LISTEN=127.0.0.1:18487 PROVIDER_METRICS_LISTEN=127.0.0.1:19487 \
    PROVIDER_INGRESS_LISTEN=127.0.0.1:18488 PROVIDER_INGRESS_BASE_URL='http://{label}.localhost:18488' \
    PROVIDER_TEMPLATES=deploy/templates.dev.yaml PROVIDER_CREDENTIAL_FILE="$work/credential" \
    INCUS_SOCKET=/var/lib/lxd/unix.socket INCUS_PROJECT="$lxd_project" PROVIDER_GRACEFUL_STOP=5s \
    PROVIDER_GUEST_DIALER=$dialer PROVIDER_GUEST_SOCKET_DIR="$work/lxd-guests" \
    bin/incus-provider >"$work/lxd-provider.out" 2>"$work/lxd-provider.log" &
  provider_pid=$!
  await_provider "$provider_pid" "$work/lxd-provider.out" "$work/lxd-provider.log"
  conform ws://127.0.0.1:18487/control "$work/credential" u-conformance "$work/lxd-provider.log"
  kill "$provider_pid" 2>/dev/null || true; wait "$provider_pid" 2>/dev/null || true; provider_pid=""
  left=$(find "$work/lxd-guests" -name '*.sock' | wc -l)
  [ "$left" = 0 ] || { echo "the $dialer dialer left $left proxy sockets behind after conformance closed every target" >&2; exit 1; }
done
