#!/usr/bin/env bash
# The ingress edge beside its peers, in one run (issue 29): installs
# Debian's nginx (nginx-light where the release has it) and Caddy, HAProxy
# when missing, with none of their system services enabled or left
# listening, then builds cmd/ingressbench and runs it with -peers: direct,
# the edge, nginx, HAProxy and Caddy, each peer a reverse proxy in front of
# the bench's byte relay into the guest, in turns. Arguments go to
# ingressbench (e.g. -gets 1000 -gib 1 -conns 1000 -conns-for 5s).
#
# Needs root, Incus at /var/lib/incus/unix.socket and the development guest
# image (built when missing). Exits non-zero only when it cannot measure.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}

if [ "$(id -u)" != 0 ]; then
	echo "ingresspeers: run as root (the netns GuestDialer enters the guest's namespace; apt-get)" >&2
	exit 1
fi
[ -S /var/lib/incus/unix.socket ] || deploy/dev/incus-up.sh
incus image info lightspeed-dev-guest >/dev/null 2>&1 || deploy/guest/build-image.sh >/dev/null

# The peers' packages. Their maintainer scripts would enable and start a
# service on port 80 (nginx's default site, Caddy's Caddyfile): a
# policy-rc.d that refuses every start keeps invoke-rc.d from doing so
# while apt runs, and the units are disabled and stopped afterwards where
# systemd runs.
pkgs=()
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] ||
	if apt-cache show nginx-light >/dev/null 2>&1; then pkgs+=(nginx-light); else pkgs+=(nginx); fi
command -v caddy >/dev/null || pkgs+=(caddy)
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || pkgs+=(haproxy)
if [ ${#pkgs[@]} -gt 0 ]; then
	echo "ingresspeers: installing ${pkgs[*]}" >&2
	policy=/usr/sbin/policy-rc.d
	own_policy=0
	if [ ! -e "$policy" ]; then
		printf '#!/bin/sh\nexit 101\n' >"$policy"
		chmod 755 "$policy"
		own_policy=1
	fi
	trap '[ "$own_policy" = 1 ] && rm -f "$policy"' EXIT
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null
	[ "$own_policy" = 1 ] && rm -f "$policy"
	own_policy=0
	trap - EXIT
fi
if [ -d /run/systemd/system ]; then
	for unit in nginx caddy caddy-api haproxy; do
		systemctl disable --now "$unit" >/dev/null 2>&1 || true
	done
fi
# Nothing of theirs may be left on port 80 or 443 (the bench's peers listen
# on loopback ports of their own, started and ended by the bench).
if ss -Hltnp 'sport = :80 or sport = :443' 2>/dev/null | grep -Eq '"(nginx|caddy|haproxy)"'; then
	echo "ingresspeers: a system nginx, Caddy or HAProxy is listening on port 80 or 443; stop it first:" >&2
	ss -Hltnp 'sport = :80 or sport = :443' >&2
	exit 1
fi

work=$(mktemp -d /tmp/ingresspeers.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "ingresspeers: building ingressbench at $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with local changes)')" >&2
go build -o "$work/ingressbench" ./cmd/ingressbench
echo "== $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) at the start;" \
	"nginx $(nginx -v 2>&1 | sed 's/.*nginx\///'), HAProxy $(haproxy -v 2>/dev/null | sed -n '1s/^HAProxy version \([^ ]*\).*/\1/p'), Caddy $(caddy version 2>/dev/null | cut -d' ' -f1)"
"$work/ingressbench" -peers -wakes 0 -flood 0 "$@"
