#!/usr/bin/env bash
# Every benchmark the issues name, on the real Incus with the development
# guest, in one run. Prints the figures; BENCHMARKS.md records the latest.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}
deploy/dev/incus-up.sh
deploy/guest/build-image.sh >/dev/null
# The relay's floor in routebench is Debian's socat, a C byte relay.
command -v socat >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q socat >/dev/null
printf '\n== target lifecycle: create → active, close → closed (20 owners)\n'
INCUS_PROVIDER_REQUIRE_INCUS=1 go test -count=1 -run '^$' -bench Lifecycle -benchtime 20x ./targets/ | grep -E 'Benchmark|ok'
printf '\n== instant environments: create → active and → opened, the runtime'"'"'s way, against build 568fd0f and Incus alone (issue 27)\n'
deploy/dev/createbench.sh
printf '\n== warm pools: create → active with and without a warm instance, one at a time and 20 at once, dev image\n'
INCUS_PROVIDER_REQUIRE_INCUS=1 go test -count=1 -timeout 30m -run '^$' -bench WarmCreate -benchtime 20x ./targets/ | grep -E 'Benchmark|ok'
printf '\n== warm pools: a hand-out through the Incus API, kept stopped (rename, start) vs started (stop, rename, start)\n'
INCUS_PROVIDER_REQUIRE_INCUS=1 go test -count=1 -run '^$' -bench WarmStoppedVersusStarted -benchtime 10x ./targets/ | grep -E 'Benchmark|ok'
printf '\n== warm pools: the same with an image of 40,000 small files\n'
GUEST_IMAGE_ALIAS=lightspeed-dev-guest-40k GUEST_EXTRA_FILES=40000 deploy/guest/build-image.sh >/dev/null
INCUS_PROVIDER_BENCH_IMAGE=lightspeed-dev-guest-40k INCUS_PROVIDER_REQUIRE_INCUS=1 \
  go test -count=1 -timeout 30m -run '^$' -bench WarmCreate -benchtime 20x ./targets/ | grep -E 'Benchmark|ok'
printf '\n== data routes: wake latency, relayed vs direct, memory per idle relay\n'
go run ./cmd/routebench
printf '\n== data routes: wake from paused and from stopped against build 568fd0f (issue 25), in turns, each wake divided by its trace in the provider\n'
deploy/dev/wakebench.sh
printf '\n== public ingress: edge vs direct, a 1 GiB download, wake on request, unknown hosts\n'
go run ./cmd/ingressbench
printf '\n== public ingress beside nginx, HAProxy and Caddy (Debian packages, installed when missing), direct and a byte relay, in turns (issue 29)\n'
deploy/dev/ingresspeers.sh
printf '\n== idle loop: 10,000 fake daemons in a process of their own, the default 10 s ceiling, without the observation cache (the baseline)\n'
go run ./cmd/idlebench -cache=false
printf '\n== idle loop: the same with the observation cache, as the provider runs by default\n'
go run ./cmd/idlebench
printf '\n== idle loop: the same with the ceiling of earlier releases, 25 s\n'
go run ./cmd/idlebench -max-interval 25s
printf '\n== target/get: observation cache on and off, 10 and 10,000 targets (fake Incus in a child process), 20 on the real Incus\n'
go run ./cmd/getbench
