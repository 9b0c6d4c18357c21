#!/usr/bin/env bash
# Builds the container image (the top-level Dockerfile) offline with podman
# and runs it against this host's Incus socket, as docs/operations.md ("As a
# container") tells an operator to: the running container must pass lsconform
# and wake a target through its data route (cmd/routecheck), and say ready. Works in an Incus project of its own and removes it, the
# container and the image it built when it ends. Nothing is pulled: both
# stages start FROM scratch, with the host's Go toolchain and module cache
# lent to the build read-only.
#
# Needs root, a running Incus (deploy/dev/incus-up.sh) and the development
# guest image (deploy/guest/build-image.sh); bin/lsconform is built here.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PATH=$PATH:/usr/local/go/bin
STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
mkdir -p "$STATE_DIR" bin
say() { printf 'container-test: %s\n' "$*" >&2; }

if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1; then
  say "installing podman and runc from Debian"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends podman runc >>"$STATE_DIR/apt.log" 2>&1 ||
    { apt-get update >>"$STATE_DIR/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends podman runc >>"$STATE_DIR/apt.log" 2>&1; } ||
    { say "apt-get install podman runc failed; see $STATE_DIR/apt.log"; exit 1; }
fi

suffix=$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')
image=localhost/incus-provider:test-$suffix
name=incus-provider-test-$suffix
project=lscontainer-$suffix
work=$(mktemp -d)
cleanup() {
  status=$?
  podman rm -f -t 5 "$name" >/dev/null 2>&1 || true
  podman rmi -f "$image" >/dev/null 2>&1 || true
  if incus project show "$project" >/dev/null 2>&1; then
    for i in $(incus list --project "$project" --format csv -c n); do incus delete --force --project "$project" "$i" >/dev/null 2>&1 || true; done
    incus project delete "$project" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
  exit $status
}
trap cleanup EXIT

say "podman build --pull=never (no base image; the host's Go and module cache, read-only)"
podman build --pull=never --layers=false --quiet --build-arg VERSION=0.0.0-container-test \
  -v /usr/local/go:/usr/local/go:ro -v "$(go env GOMODCACHE)":/gomod:ro -t "$image" . >/dev/null
podman image inspect "$image" --format 'image {{.Size}} bytes, user {{.Config.User}}, entrypoint {{.Config.Entrypoint}}' >&2
[ "$(podman run --rm --runtime runc --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 "$image" --version)" = \
  "incus-provider 0.0.0-container-test (git unknown, linux/amd64, $(go env GOVERSION))" ] || { say "--version does not name the build"; exit 1; }

# Without --pid=host the netns dialer cannot see guests' processes: the
# provider must refuse to start, in a sentence, rather than serve routes that
# answer 503 booting for ever.
refusal=$(podman run --rm --runtime runc --network host --cap-drop all --cap-add SYS_ADMIN,SYS_PTRACE \
  --ulimit nofile=1024:1024 --ulimit nproc=1024:1024 -e PROVIDER_METRICS_LISTEN=off -e PROVIDER_LISTEN=127.0.0.1:0 \
  -v /var/lib/incus/unix.socket:/var/lib/incus/unix.socket "$image" 2>&1) && code=0 || code=$?
grep -q 'another PID namespace than Incus' <<<"$refusal" && [ "$code" = 2 ] ||
  { echo "$refusal" >&2; say "without --pid=host the container did not refuse to start with exit 2 (it exited $code)"; exit 1; }
say "without --pid=host: exit 2, $(grep -o 'Incus runs as PID.*PID namespace than Incus' <<<"$refusal")"

go build -o bin/lsconform ./cmd/lsconform
go build -o bin/routecheck ./cmd/routecheck
incus project create "$project" -c features.images=false -c features.profiles=false >/dev/null
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/credential"
chmod 0600 "$work/credential"

# The run line of docs/operations.md, with this test's ports, project and
# credential. The open-file ceiling is the host's own hard limit: a runner
# without CAP_SYS_RESOURCE (as here) cannot grant more.
nofile=$(ulimit -Hn)
podman run -d --name "$name" \
  --runtime runc \
  --network host \
  --pid host \
  --cap-drop all --cap-add SYS_ADMIN,SYS_PTRACE \
  --security-opt no-new-privileges \
  --read-only \
  --ulimit nofile="$nofile:$nofile" --ulimit nproc=4096:4096 \
  -v /var/lib/incus/unix.socket:/var/lib/incus/unix.socket \
  -v "$work/credential:/etc/incus-provider/credential:ro" \
  -e PROVIDER_CREDENTIAL_FILE=/etc/incus-provider/credential \
  -e PROVIDER_LISTEN=127.0.0.1:18482 -e PROVIDER_METRICS_LISTEN=127.0.0.1:19482 \
  -e PROVIDER_INGRESS_LISTEN=127.0.0.1:18486 -e 'PROVIDER_INGRESS_BASE_URL=http://{label}.localhost:18486' \
  -e PROVIDER_MAX_CONNECTIONS=$((nofile > 2048 ? nofile - 1024 : 1024)) \
  -e INCUS_PROJECT="$project" -e PROVIDER_GRACEFUL_STOP=5s \
  "$image" >/dev/null
# The log is read whole before grep: grep -q ending the pipe early would
# fail it under pipefail.
serving() { local out; out=$(podman logs "$name" 2>/dev/null); grep -q '^controller URL' <<<"$out"; }
for _ in $(seq 1 150); do
  serving && break
  [ "$(podman inspect -f '{{.State.Running}}' "$name")" = true ] || { podman logs "$name" >&2; say "the container exited before it served"; exit 1; }
  sleep 0.2
done
serving || { podman logs "$name" >&2; say "the container did not serve within 30 s"; exit 1; }
bin/lsconform -url ws://127.0.0.1:18482/control -credential-file "$work/credential" -universe u-container -idle-grace 5s || {
  podman logs "$name" 2>&1 | tail -n 50 >&2; say "lsconform failed against the container"; exit 1; }
bin/routecheck -url ws://127.0.0.1:18482/control -credential-file "$work/credential" || {
  podman logs "$name" 2>&1 | tail -n 50 >&2; say "a data-route wake failed against the container"; exit 1; }
ready=$(curl -fsS --max-time 10 http://127.0.0.1:19482/readyz) || { podman logs "$name" 2>&1 | tail -n 20 >&2; say "/readyz is not ok"; exit 1; }
say "readyz: $(echo "$ready" | tr '\n' ' ')"
logged=$(podman logs "$name" 2>&1)
if grep -E '"level":"(error|warn)"' <<<"$logged" | grep -v 'open-file limit' >&2; then
  say "the container logged errors or warnings (above)"; exit 1
fi
podman stop -t 20 "$name" >/dev/null
code=$(podman inspect -f '{{.State.ExitCode}}' "$name")
[ "$code" = 0 ] || { podman logs "$name" 2>&1 | tail -n 20 >&2; say "the container exited $code on SIGTERM"; exit 1; }
say "passed: lsconform, data-route wakes from paused and stopped, /readyz and a clean SIGTERM, from the container"
