#!/usr/bin/env bash
# gofmt, go vet and golangci-lint (installed from the Go module proxy at the
# pinned version when missing), with the repo's .golangci.yml.
set -euo pipefail
cd "$(dirname "$0")/../.."
GOLANGCI_VERSION=v2.15.0
unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
  echo "lint: gofmt would change: $unformatted" >&2
  exit 1
fi
go vet ./...
# The production image's test is built only by make test-image.
go vet -tags imagetest ./provider
bin=$(go env GOPATH)/bin/golangci-lint
if ! [ -x "$bin" ] || ! "$bin" version 2>/dev/null | grep -q "${GOLANGCI_VERSION#v}"; then
  echo "lint: installing golangci-lint $GOLANGCI_VERSION (a few minutes, once)" >&2
  GOFLAGS= go install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$GOLANGCI_VERSION"
fi
"$bin" run ./...
"$bin" run --build-tags imagetest ./provider
