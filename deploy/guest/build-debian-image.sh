#!/usr/bin/env bash
# Builds a production-shaped Lightspeed guest image and imports it into Incus:
# a Debian root filesystem from the Debian mirror (debootstrap), systemd as
# PID 1, and the data-plane daemon as a systemd service on the guest's
# loopback. This is the recipe for baking the real lightspeed-envd; by
# default it bakes lsenvd-dev (cmd/lsenvd-dev), its development stand-in, so
# that the recipe is built and booted by `make test-image`.
#
# Usage: deploy/guest/build-debian-image.sh
#
# Environment:
#   GUEST_IMAGE_ALIAS  alias to (re)point (default lightspeed-debian-guest)
#   INCUS_PROJECT      Incus project to import into (default: the default project)
#   DAEMON             the daemon binary to bake in, static or linked against
#                      Debian's libc (default: lsenvd-dev, built here)
#   DAEMON_PORT        the guest loopback port it serves the data plane on
#                      (default 19091, the provider's default daemonPort)
#   DAEMON_ARGS        its arguments (default "--listen 127.0.0.1:DAEMON_PORT",
#                      as lsenvd-dev takes them; give the real daemon's own)
#   DEBIAN_SUITE       default bookworm
#   DEBIAN_MIRROR      default: the first Debian URI of this machine's apt
#                      sources, else http://deb.debian.org/debian
#   CACHE_DIR          where the debootstrapped base is kept between runs
#                      (default /var/cache/incus-provider/debian-guest)
#   GO                 Go toolchain command (default go)
#
# What the image does, and why:
# - systemd is PID 1, as in the distribution images operators already run.
#   It brings lo up itself at boot, before any unit; the guest has no other
#   interface (the provider reaches the daemon through the container's
#   network namespace, a proxy device or exec: never a guest network).
# - lightspeed-envd.service runs the daemon, bound to 127.0.0.1:DAEMON_PORT,
#   restarted half a second after it dies, stopped with SIGTERM and at most
#   3 s later with SIGKILL.
# - A graceful `incus stop` powers the guest off cleanly. Incus (liblxc)
#   sends the container's PID 1 SIGRTMIN+3 when that is systemd, which halts
#   it; SIGPWR, sent otherwise, is linked to poweroff.target as well.
# - Units that cannot work or should not run in a container without a
#   network are masked (getty on a console nobody reads, apt's timers,
#   udev), so that boot and shutdown are short.
# - No identity is baked in: /etc/machine-id is empty (systemd writes a new
#   one at each instance's first boot) and the daemon's state directory,
#   /var/lib/lightspeed-envd, is absent from the image and checked so: a
#   daemon identity must never be cloned into two targets.
# - Re-runs are cheap: the debootstrapped base is cached, keyed by suite,
#   mirror and package list; and when the alias already points at an image
#   with the same content hash nothing is imported (see image-lib.sh).
#
# A virtual machine (Incus type virtual-machine) needs more than this
# container image: a kernel and boot loader (Incus's VM images carry them),
# and incus-agent, through which the provider's exec dialer reaches the
# daemon (a VM has no network namespace on the host to enter, and a proxy
# device on a VM needs a guest network). The provider is tested here with
# containers only.
#
# Output: one line on stdout, "<alias> <fingerprint>". Everything else goes to
# stderr. On failure: a sentence on stderr and a non-zero exit status.

set -euo pipefail

alias_name=${GUEST_IMAGE_ALIAS:-lightspeed-debian-guest}
project=${INCUS_PROJECT:-}
daemon=${DAEMON:-}
daemon_port=${DAEMON_PORT:-19091}
suite=${DEBIAN_SUITE:-bookworm}
cache_dir=${CACHE_DIR:-/var/cache/incus-provider/debian-guest}
go_cmd=${GO:-go}
hash_property=lightspeed.content_hash
# systemd and its sysv links for PID 1; dbus for systemctl; nothing else:
# the daemon is a static binary and the guest has no network.
packages=systemd,systemd-sysv,dbus

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

exec 3>&1 1>&2 # stdout is for the result line only

fail() {
	echo "build-debian-image.sh: $*" >&2
	exit 1
}

# shellcheck source=deploy/guest/image-lib.sh
. "$here/image-lib.sh"

case $daemon_port in
'' | *[!0-9]*) fail "DAEMON_PORT must be a port number, not \"$daemon_port\"." ;;
esac
[ "$daemon_port" -ge 1 ] && [ "$daemon_port" -le 65535 ] || fail "DAEMON_PORT must be from 1 to 65535, not $daemon_port."
daemon_args=${DAEMON_ARGS:---listen 127.0.0.1:$daemon_port}
case $daemon_args in
*[\\\$\`\"\'\;\&\|]*) fail "DAEMON_ARGS may hold words and spaces only (it goes on a systemd ExecStart line)." ;;
esac

if [ -z "${DEBIAN_MIRROR:-}" ]; then
	# Either file may be missing (grep then fails): the default stands.
	DEBIAN_MIRROR=$({ grep -rhoE '^(URIs:|deb) *https?://[^ ]+/debian/?' /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null || true; } |
		head -n1 | sed -E 's/^(URIs:|deb) *//')
	DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
fi

[ "$(id -u)" = 0 ] || fail "run as root: debootstrap and the image's file ownership need it."
if ! command -v debootstrap >/dev/null 2>&1; then
	command -v apt-get >/dev/null 2>&1 || fail "debootstrap is needed and there is no apt-get to install it."
	echo "installing debootstrap" >&2
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >&2 || fail "apt-get could not install debootstrap."
fi
for tool in incus tar sha256sum; do
	command -v "$tool" >/dev/null 2>&1 || fail "the command $tool is needed but not installed."
done
image_check_incus

image_arch
debarch=$goarch # Debian names them as Go does

work=$(mktemp -d "${TMPDIR:-/tmp}/lightspeed-debian-guest.XXXXXX")
trap 'rm -rf "$work"' EXIT

if [ -z "$daemon" ]; then
	command -v "$go_cmd" >/dev/null 2>&1 || fail "Go ($go_cmd) is needed to build lsenvd-dev; or set DAEMON."
	build_lsenvd_dev "$work/daemon"
	daemon=$work/daemon
	daemon_name=lsenvd-dev
else
	[ -f "$daemon" ] && [ -x "$daemon" ] || fail "DAEMON=$daemon is not an executable file."
	daemon_name=$(basename "$daemon")
fi

# The base: debootstrap once per suite, mirror and package list.
base_key=$(printf '%s\n' "$suite" "$DEBIAN_MIRROR" "$packages" "$debarch" "minbase" | sha256sum | cut -c1-16)
base=$cache_dir/base-$suite-$base_key.tar
if [ ! -s "$base" ]; then
	echo "debootstrap $suite ($packages) from $DEBIAN_MIRROR; cached as $base" >&2
	mkdir -p "$cache_dir"
	boot=$work/debootstrap
	debootstrap --variant=minbase --arch="$debarch" --include="$packages" "$suite" "$boot" "$DEBIAN_MIRROR" >&2 ||
		fail "debootstrap failed (its log: $boot/debootstrap/debootstrap.log)."
	chroot "$boot" apt-get clean >&2 || true
	rm -rf "$boot/var/lib/apt/lists/"* "$boot/var/cache/apt/"*.bin
	tar -C "$boot" --numeric-owner -cf "$base.partial" . || fail "packing the debootstrapped base failed."
	mv "$base.partial" "$base"
	rm -rf "$boot"
fi

content_hash=$(
	{
		sha256sum <"$base"
		sha256sum <"$daemon"
		echo "$daemon_port $daemon_args"
		sha256sum <"$here/build-debian-image.sh"
		sha256sum <"$here/image-lib.sh"
	} | sha256sum | cut -d' ' -f1
)
echo "content hash $content_hash" >&2
if image_current "$alias_name" "$content_hash"; then
	echo "the alias $alias_name already points at an image with this content" >&2
	echo "$alias_name $image_target" >&3
	exit 0
fi

echo "assembling the root filesystem" >&2
img=$work/img
root=$img/rootfs
mkdir -p "$root"
tar -C "$root" --numeric-owner -xf "$base" || fail "unpacking the cached base $base failed (delete it to rebuild)."

install -m 0755 "$daemon" "$root/usr/local/bin/lightspeed-envd"
cat >"$root/etc/systemd/system/lightspeed-envd.service" <<UNIT
[Unit]
Description=Lightspeed data-plane daemon ($daemon_name), on the guest's loopback only
After=local-fs.target

[Service]
Type=simple
ExecStart=/usr/local/bin/lightspeed-envd $daemon_args
WorkingDirectory=/root
Restart=always
RestartSec=500ms
KillSignal=SIGTERM
TimeoutStopSec=3s

[Install]
WantedBy=multi-user.target
UNIT
mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
ln -sf ../lightspeed-envd.service "$root/etc/systemd/system/multi-user.target.wants/lightspeed-envd.service"
# SIGPWR starts sigpwr.target: make it a power-off.
ln -sf /lib/systemd/system/poweroff.target "$root/etc/systemd/system/sigpwr.target"
for unit in console-getty.service getty@.service serial-getty@.service getty.target \
	apt-daily.timer apt-daily-upgrade.timer systemd-udevd.service systemd-udevd-control.socket \
	systemd-udevd-kernel.socket systemd-networkd-wait-online.service e2scrub_all.timer fstrim.timer; do
	ln -sf /dev/null "$root/etc/systemd/system/$unit"
done
# No identity in the image.
: >"$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id" "$root/etc/hostname"
rm -rf "$root/var/lib/lightspeed-envd"
[ ! -e "$root/var/lib/lightspeed-envd" ] || fail "the daemon's state directory is in the image."
printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n' >"$root/etc/hosts"
# A locked root: nothing logs in; the provider uses the daemon, an operator incus exec.
sed -i 's/^root:[^:]*:/root:*:/' "$root/etc/shadow"

cat >"$img/metadata.yaml" <<META
architecture: $arch
creation_date: $(date +%s)
properties:
  description: Lightspeed guest, Debian $suite with systemd ($daemon_name on 127.0.0.1:$daemon_port, data plane v5)
  os: debian
  release: "$suite"
  $hash_property: "$content_hash"
META

# Uncompressed: packing and unpacking a gzip of this size cost more here
# than the bytes it saves on a local import.
tar -C "$img" --numeric-owner -cf "$work/guest.tar" metadata.yaml rootfs ||
	fail "packing the image tarball failed."
image_import "$work/guest.tar" "$alias_name" "Lightspeed guest (Debian $suite, systemd)"
echo "$alias_name $image_fingerprint" >&3
