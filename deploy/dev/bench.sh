#!/usr/bin/env bash
# Every benchmark the issues name, on the real Incus with the development
# guest, in one run. Prints the figures; BENCHMARKS.md records the latest.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}
deploy/dev/incus-up.sh
deploy/guest/build-image.sh >/dev/null
printf '\n== target lifecycle: create → active, close → closed (20 owners)\n'
INCUS_PROVIDER_REQUIRE_INCUS=1 go test -count=1 -run '^$' -bench Lifecycle -benchtime 20x ./targets/ | grep -E 'Benchmark|ok'
printf '\n== data routes: wake latency, relayed vs direct, memory per idle relay\n'
go run ./cmd/routebench
printf '\n== public ingress: edge vs direct, a 1 GiB download, wake on request, unknown hosts\n'
go run ./cmd/ingressbench
printf '\n== idle loop: 10,000 in-process fake daemons\n'
go run ./cmd/idlebench
printf '\n== target/get: observation cache on and off, 10 and 10,000 targets (fake Incus in a child process), 20 on the real Incus\n'
go run ./cmd/getbench
