# The two commands a newcomer runs (as root, on Debian 12): `make run` and
# `make test`. Both install and start what they need and are safe to repeat.
SHELL := /bin/bash
# Go lives in /usr/local/go on these machines; keep it reachable from a bare PATH.
export PATH := $(PATH):/usr/local/go/bin
GO ?= go
BIN := bin
export GOFLAGS ?= -mod=mod

.PHONY: run run-cluster test test-image build lint unit bench fuzz clean-test-projects

# The version a build prints (--version, build_info, serverInfo):
# internal/buildinfo/VERSION's at the tag vVERSION, and VERSION-dev anywhere
# else (docs/operations.md).
VERSION_STAMP := $(shell v=$$(cat internal/buildinfo/VERSION); if git describe --exact-match --tags HEAD 2>/dev/null | grep -qx "v$$v"; then echo "$$v"; else echo "$$v-dev"; fi)

build:
	@mkdir -p $(BIN)
	$(GO) build -ldflags "-X github.com/lightspeed-dev/incus-provider/internal/buildinfo.Version=$(VERSION_STAMP)" -o $(BIN)/incus-provider ./cmd/incus-provider
	$(GO) build -o $(BIN)/lsconform ./cmd/lsconform

# Brings up a local Incus, builds and imports the development guest image,
# and runs the provider in the foreground on 127.0.0.1:8480.
run: build
	@deploy/dev/incus-up.sh
	@deploy/guest/build-image.sh >/dev/null
	PROVIDER_TEMPLATES=$${PROVIDER_TEMPLATES:-deploy/templates.dev.yaml} $(BIN)/incus-provider

# The provider as on a cluster: a three-member Incus cluster rig, two
# replicas and HAProxy in front, serving 127.0.0.1:8480 in the foreground.
run-cluster:
	@deploy/dev/run-cluster.sh

# The whole suite: lint, unit, integration on the real Incus, conformance
# against a running provider.
test:
	@deploy/dev/test.sh

# The production-shaped guest image (deploy/guest/build-debian-image.sh),
# built from the Debian mirror and booted through the provider; CI runs it
# after make test.
test-image:
	@deploy/dev/test-image.sh

lint:
	@deploy/dev/lint.sh

bench:
	@deploy/dev/bench.sh

# Every fuzz target, one at a time, for FUZZ_COUNT executions each (default
# 10^7, about three and a half hours here); not part of `make test`.
fuzz:
	@deploy/dev/fuzz.sh $(if $(FUZZ_COUNT),-n $(FUZZ_COUNT))

clean-test-projects:
	@deploy/dev/clean-test-projects.sh
