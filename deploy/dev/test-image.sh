#!/usr/bin/env bash
# make test-image: builds the production-shaped guest image
# (deploy/guest/build-debian-image.sh: a Debian root filesystem from the
# Debian mirror, systemd as PID 1, the daemon as a service on the guest's
# loopback) and boots it through the provider: the image's own test
# (go test -tags imagetest) and the conformance suite against a provider
# whose templates use it; then the systemd unit under the image's own
# systemd (deploy/dev/unit-in-systemd.sh). Slower than make test by the debootstrap of a
# first run (about 1.5 minutes here; later runs reuse the cached base).
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}
export PATH=$PATH:/usr/local/go/bin
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
step() { printf '\n== %s\n' "$*"; }
# shellcheck source=deploy/dev/lib.sh
. deploy/dev/lib.sh

pid_before=$(cat "$STATE_DIR/incusd.pid" 2>/dev/null || true)
started_incus=0
provider_pid=""
project="lsimage-$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')"
work=$(mktemp -d)
cleanup() {
  status=$?
  if [ -n "$provider_pid" ]; then kill "$provider_pid" 2>/dev/null || true; wait "$provider_pid" 2>/dev/null || true; fi
  drop_incus_project "$project"
  rm -rf "$work"
  if [ "$started_incus" = 1 ] && [ -f "$STATE_DIR/incusd.pid" ]; then deploy/dev/incus-down.sh || true; fi
  exit $status
}
trap cleanup EXIT

step "Incus"
deploy/dev/incus-up.sh
pid_after=$(cat "$STATE_DIR/incusd.pid" 2>/dev/null || true)
if [ -n "$pid_after" ] && [ "$pid_after" != "$pid_before" ]; then started_incus=1; fi

step "production-shaped guest image (debootstrap, systemd, the daemon as a service)"
read -r alias _ < <(deploy/guest/build-debian-image.sh)

step "the image through the provider (go test -tags imagetest)"
INCUS_PROVIDER_REQUIRE_INCUS=1 INCUS_PROVIDER_TEST_DEBIAN_IMAGE="$alias" \
  go test -tags imagetest -count=1 -timeout 15m -run '^TestDebianGuestImage$' -v ./provider

step "conformance against a provider whose templates use the image"
mkdir -p bin
go build -o bin/incus-provider ./cmd/incus-provider
go build -o bin/lsconform ./cmd/lsconform
incus project create "$project" -c features.images=false -c features.profiles=false >/dev/null
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/credential"
sed "s/imageAlias: lightspeed-dev-guest/imageAlias: $alias/" deploy/templates.dev.yaml > "$work/templates.yaml"
grep -q "imageAlias: $alias" "$work/templates.yaml" || { echo "test-image: no template of deploy/templates.dev.yaml names lightspeed-dev-guest any more" >&2; exit 1; }
# shellcheck disable=SC2046 # one word per option
env $(provider_env_unset) PROVIDER_LISTEN=127.0.0.1:18490 PROVIDER_METRICS_LISTEN=127.0.0.1:19490 \
  PROVIDER_INGRESS_LISTEN=127.0.0.1:18491 PROVIDER_INGRESS_BASE_URL='http://{label}.localhost:18491' \
  PROVIDER_TEMPLATES="$work/templates.yaml" PROVIDER_CREDENTIAL_FILE="$work/credential" \
  INCUS_PROJECT="$project" PROVIDER_GRACEFUL_STOP=10s \
  bin/incus-provider >"$work/provider.out" 2>"$work/provider.log" &
provider_pid=$!
await_provider "$provider_pid" "$work/provider.out" "$work/provider.log"
conform ws://127.0.0.1:18490/control "$work/credential" u-image "$work/provider.log"
kill "$provider_pid" 2>/dev/null || true; wait "$provider_pid" 2>/dev/null || true; provider_pid=""

step "the systemd unit under systemd 252 (a privileged container of the image)"
deploy/dev/unit-in-systemd.sh "$alias"
echo "test-image: passed"
