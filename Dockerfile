# incus-provider as a container image: a static binary on an empty base.
#
# Built offline, from nothing but this repository and the host's own Go
# toolchain and module cache, lent to the build as read-only volumes (no
# base image is pulled; both stages start FROM scratch):
#
#   podman build --pull=never \
#     -v /usr/local/go:/usr/local/go:ro -v "$(go env GOMODCACHE)":/gomod:ro \
#     -t localhost/incus-provider .
#
# docs/operations.md ("As a container") gives the run line and why each flag is there.

# The build stage has no shell: go is static and RUN uses the exec form.
FROM scratch AS build
# RUN's exec form expands nothing, so the version reaches the linker
# through GOFLAGS, which ENV does expand. Unset, the binary says the
# release's version with -dev (internal/buildinfo/VERSION).
ARG VERSION=
ENV PATH=/usr/local/go/bin HOME=/tmp GOCACHE=/tmp/gocache GOMODCACHE=/gomod \
    GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0 \
    GOFLAGS="-mod=mod -trimpath -buildvcs=false -ldflags=-X=github.com/lightspeed-dev/incus-provider/internal/buildinfo.Version=${VERSION}"
WORKDIR /tmp
WORKDIR /src
COPY . .
RUN ["/usr/local/go/bin/go", "build", "-o", "/out/incus-provider", "./cmd/incus-provider"]

FROM scratch
COPY --from=build /out/incus-provider /incus-provider
COPY deploy/templates.dev.yaml /etc/incus-provider/templates.yaml
# The netns guest dialer (the default on a standalone Incus) enters each
# container's network namespace: CAP_SYS_ADMIN and CAP_SYS_PTRACE over the
# host's processes, which only root in the host's user namespace holds, and
# the local Incus socket is root's. With PROVIDER_GUEST_DIALER=exec and an
# Incus reached over HTTPS (INCUS_URL), run it as any user: --user 65532.
USER 0:0
# Listen on every address of the network it is given; the metrics too. The
# controller listener then needs PROVIDER_CREDENTIAL_FILE (a mounted file),
# or the provider refuses to start (PROVIDER_ALLOW_NO_CREDENTIAL).
ENV PROVIDER_LISTEN=0.0.0.0:8480 PROVIDER_METRICS_LISTEN=0.0.0.0:9480
EXPOSE 8480 9480
ENTRYPOINT ["/incus-provider"]
