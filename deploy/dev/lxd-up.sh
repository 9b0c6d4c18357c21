#!/usr/bin/env bash
# Makes sure an LXD 5.0 (Debian's) answers on its own unix socket beside
# Incus, for the tests that check the provider against LXD, and that it
# holds the development guest image. Safe to run again.
#
# LXD has no switch like INCUS_SKIP_INSTANCE_TYPES: at start it looks up the
# public image server's instance types. So it runs in a network namespace of
# its own that has nothing but a loopback interface (lsp-lxd): the lookup
# fails at once ("network is unreachable") and nothing leaves this machine.
# Its unix socket, the containers' namespaces and the proxy devices' host
# sockets work across namespaces as usual.
#
# State: /var/lib/lxd (LXD_DIR), client configuration in
# $STATE_DIR/lxd-client (LXD_CONF), the daemon's PID in $STATE_DIR/lxd.pid
# when this script started it; deploy/dev/lxd-down.sh stops exactly that.
# Debian 12, as root. The image is exported from the local Incus
# (deploy/guest/build-image.sh builds it there).
set -euo pipefail

STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
NETNS=lsp-lxd
IMAGE=${GUEST_IMAGE_ALIAS:-lightspeed-dev-guest}
export LXD_DIR=/var/lib/lxd LXD_CONF=$STATE_DIR/lxd-client
SOCKET=$LXD_DIR/unix.socket
say() { printf 'lxd-up: %s\n' "$*" >&2; }

[ "$(id -u)" = 0 ] || { say "run me as root: installing and starting LXD needs it."; exit 1; }
mkdir -p "$STATE_DIR" "$LXD_CONF"
answering() { curl -fsS --max-time 3 --unix-socket "$SOCKET" http://lxd/1.0 >/dev/null 2>&1; }

if ! command -v lxd >/dev/null 2>&1; then
  say "installing LXD 5.0 from Debian (about 20 s)"
  # Not started by the package: this script starts it, in its namespace.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  # The package gives root a second subordinate id range (the one it gives
  # its _lxd user). An incusd started afterwards maps both into every
  # container and none starts ("newuidmap: write to uid_map failed"), so
  # root's ranges are put back as they were.
  cp /etc/subuid "$STATE_DIR/subuid.before-lxd" 2>/dev/null || : > "$STATE_DIR/subuid.before-lxd"
  cp /etc/subgid "$STATE_DIR/subgid.before-lxd" 2>/dev/null || : > "$STATE_DIR/subgid.before-lxd"
  DEBIAN_FRONTEND=noninteractive apt-get install -y lxd >>"$STATE_DIR/apt.log" 2>&1 ||
    { apt-get update >>"$STATE_DIR/apt.log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y lxd >>"$STATE_DIR/apt.log" 2>&1; } ||
    { say "apt-get install lxd failed; see $STATE_DIR/apt.log"; exit 1; }
  rm -f /usr/sbin/policy-rc.d
  trap - EXIT
fi
keep_root_ranges() {
  local file=$1 before=$2
  [ -s "$before" ] && grep -q '^root:' "$before" || return 0
  { grep -v '^root:' "$file" || true; grep '^root:' "$before"; } > "$file.new"
  if ! cmp -s "$file.new" "$file"; then
    cat "$file.new" > "$file"
    say "kept root's subordinate ids in $file as they were before LXD's package"
  fi
  rm -f "$file.new"
}
keep_root_ranges /etc/subuid "$STATE_DIR/subuid.before-lxd"
keep_root_ranges /etc/subgid "$STATE_DIR/subgid.before-lxd"
# A machine where the package already added it: root's second range is the
# _lxd user's own.
lxd_range=$(sed -n 's/^_lxd:\(.*\)$/\1/p' /etc/subuid | head -n1)
if [ -n "$lxd_range" ]; then
  for f in /etc/subuid /etc/subgid; do
    if grep -q "^root:$lxd_range\$" "$f" && [ "$(grep -c '^root:' "$f")" -gt 1 ]; then
      sed -i "/^root:$lxd_range\$/d" "$f"
      say "removed root's second subordinate range ($lxd_range) from $f: an incusd started after it starts no container"
    fi
  done
fi

if ! answering; then
  if ! ip netns list | grep -qw "$NETNS"; then
    ip netns add "$NETNS"
  fi
  ip -n "$NETNS" link set lo up
  # Nothing but loopback: checked, not assumed.
  if ip -n "$NETNS" -o link show | grep -vq ': lo:'; then
    say "network namespace $NETNS has an interface besides lo; refusing to start LXD in it"; exit 1
  fi
  mkdir -p -m 0711 "$LXD_DIR"
  say "starting lxd in network namespace $NETNS (log: $LXD_DIR/lxd.log)"
  # nsenter, not `ip netns exec`: that also remounts /sys for the namespace,
  # which hides the cgroup hierarchies from LXD (no freezer, no memory limits).
  nsenter --net=/run/netns/"$NETNS" setsid lxd --group root --logfile "$LXD_DIR/lxd.log" </dev/null >>"$LXD_DIR/lxd.out" 2>&1 &
  echo "$! $(date +%s%N)" > "$STATE_DIR/lxd.pid"
  if ! lxd waitready --timeout=60 >/dev/null 2>&1; then
    say "lxd did not become ready within 60 s; see $LXD_DIR/lxd.log"; exit 1
  fi
fi

if ! lxc storage show default >/dev/null 2>&1; then
  lxc storage create default dir >/dev/null
fi
if ! lxc profile device show default 2>/dev/null | grep -q '^root:'; then
  lxc profile device add default root disk path=/ pool=default >/dev/null
fi

# The image Incus has under the alias, imported when LXD's differs.
want=$(incus image info "$IMAGE" 2>/dev/null | sed -n 's/^Fingerprint: //p')
[ -n "$want" ] || { say "Incus has no image $IMAGE; run deploy/guest/build-image.sh"; exit 1; }
have=$(lxc image info "$IMAGE" 2>/dev/null | sed -n 's/^Fingerprint: //p' || true)
if [ "$have" != "$want" ]; then
  tmp=$(mktemp -d)
  incus image export "$IMAGE" "$tmp/image" >/dev/null
  lxc image delete "$IMAGE" >/dev/null 2>&1 || true
  lxc image import "$tmp"/image* --alias "$IMAGE" >/dev/null
  rm -rf "$tmp"
  say "imported $IMAGE ($want) into LXD"
fi
say "LXD $(lxc version 2>/dev/null | sed -n 's/^Server version: //p') answers on $SOCKET"
