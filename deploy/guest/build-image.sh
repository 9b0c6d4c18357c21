#!/usr/bin/env bash
# Builds the Lightspeed development guest image and imports it into Incus.
#
# The image is a BusyBox root filesystem with lsenvd-dev (cmd/lsenvd-dev, the
# development data-plane daemon, listening on the guest's 127.0.0.1:19091)
# and deploy/guest/init.sh as /sbin/init.
#
# Usage: deploy/guest/build-image.sh
#
# Environment:
#   GUEST_IMAGE_ALIAS  image alias to (re)point (default lightspeed-dev-guest)
#   INCUS_PROJECT      Incus project to import into (default: the default project)
#   BUSYBOX            static BusyBox binary to use (default /bin/busybox; when it
#                      is missing and this runs as root, busybox-static is installed)
#   GO                 Go toolchain command (default go)
#   GUEST_EXTRA_FILES  add this many small files under /opt/filler (default 0):
#                      the warm pool benchmark's stand-in for a distribution image,
#                      whose tens of thousands of files make a create slow on a dir
#                      pool (GUEST_IMAGE_ALIAS=lightspeed-dev-guest-40k GUEST_EXTRA_FILES=40000)
#
# Re-runs are cheap: the image carries the SHA-256 of everything that went
# into it (daemon binary, init, BusyBox, this script) as the property
# lightspeed.content_hash, and when the alias already points at an image with
# the same hash nothing is rebuilt or imported. When the content changed, the
# new image is imported, the alias is moved to it in one request, and the
# superseded image is deleted if this script built it, no other alias names
# it and no instance was created from it. No other image is touched.
#
# Output: one line on stdout, "<alias> <fingerprint>". Everything else goes to
# stderr. On failure: a sentence on stderr and a non-zero exit status.

set -euo pipefail

alias_name=${GUEST_IMAGE_ALIAS:-lightspeed-dev-guest}
project=${INCUS_PROJECT:-}
busybox=${BUSYBOX:-/bin/busybox}
go_cmd=${GO:-go}
extra_files=${GUEST_EXTRA_FILES:-0}
hash_property=lightspeed.content_hash

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

exec 3>&1 1>&2 # stdout is for the result line only

fail() {
	echo "build-image.sh: $*" >&2
	exit 1
}

# shellcheck source=deploy/guest/image-lib.sh
. "$here/image-lib.sh"

for tool in incus tar gzip sha256sum "$go_cmd"; do
	command -v "$tool" >/dev/null 2>&1 || fail "the command $tool is needed but not installed."
done
image_check_incus

is_static() {
	if command -v readelf >/dev/null 2>&1; then
		! readelf -l "$1" 2>/dev/null | grep -q 'program interpreter'
	elif command -v file >/dev/null 2>&1; then
		file -L "$1" | grep -q 'statically linked'
	else
		dpkg -S "$1" 2>/dev/null | grep -q '^busybox-static:'
	fi
}

if [ ! -x "$busybox" ] || ! is_static "$busybox"; then
	if [ "$busybox" = /bin/busybox ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
		echo "installing busybox-static" >&2
		DEBIAN_FRONTEND=noninteractive apt-get install -y busybox-static >&2 ||
			fail "apt-get could not install busybox-static."
	fi
	[ -x "$busybox" ] || fail "no BusyBox at $busybox; install busybox-static (as root this script does it) or set BUSYBOX."
	is_static "$busybox" || fail "$busybox is linked dynamically; the guest needs a static BusyBox (Debian: busybox-static)."
fi

image_arch

work=$(mktemp -d "${TMPDIR:-/tmp}/lightspeed-guest.XXXXXX")
trap 'rm -rf "$work"' EXIT

build_lsenvd_dev "$work/lsenvd-dev"

content_hash=$(
	cd "$work" && {
		sha256sum lsenvd-dev
		sha256sum <"$here/init.sh"
		sha256sum <"$busybox"
		sha256sum <"$here/build-image.sh"
		sha256sum <"$here/image-lib.sh"
		echo "extra files $extra_files"
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
mkdir -p "$root"/{bin,sbin,etc,proc,sys,dev,tmp,root,run,var/log,var/tmp,usr/bin,usr/sbin,usr/local/bin}
chmod 1777 "$root/tmp" "$root/var/tmp"
chmod 0700 "$root/root"
install -m 0755 "$busybox" "$root/bin/busybox"
"$busybox" --list-full | while read -r applet; do
	case $applet in
	sbin/init | linuxrc | bin/busybox) continue ;;
	esac
	[ -e "$root/$applet" ] && continue
	mkdir -p "$root/$(dirname "$applet")"
	# A relative link from the applet's directory to /bin/busybox.
	up=$(dirname "$applet" | sed 's|[^/][^/]*|..|g')
	ln -s "$up/bin/busybox" "$root/$applet"
done
install -m 0755 "$work/lsenvd-dev" "$root/usr/local/bin/lsenvd-dev"
install -m 0755 "$here/init.sh" "$root/sbin/init"
printf 'root:x:0:0:root:/root:/bin/sh\n' >"$root/etc/passwd"
printf 'root:*:0:0:99999:7:::\n' >"$root/etc/shadow"
chmod 0600 "$root/etc/shadow"
printf 'root:x:0:\n' >"$root/etc/group"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n' >"$root/etc/hosts"
case $extra_files in
'' | *[!0-9]*) fail "GUEST_EXTRA_FILES=$extra_files is not a whole number." ;;
esac
if [ "$extra_files" -gt 0 ]; then
	echo "adding $extra_files small files under /opt/filler" >&2
	made=0
	while [ "$made" -lt "$extra_files" ]; do
		dir=$root/opt/filler/d$((made / 200))
		mkdir -p "$dir"
		for _ in $(seq 1 200); do
			[ "$made" -lt "$extra_files" ] || break
			printf 'filler file %d of the benchmark image\n' "$made" >"$dir/f$made"
			made=$((made + 1))
		done
	done
fi

cat >"$img/metadata.yaml" <<EOF
architecture: $arch
creation_date: $(date +%s)
properties:
  description: Lightspeed development guest (lsenvd-dev, data plane v5)
  os: busybox
  release: "$("$busybox" 2>&1 | head -n1 | sed -n 's/^BusyBox v\([^ ]*\).*/\1/p')"
  $hash_property: "$content_hash"
EOF

tar -C "$img" --numeric-owner --owner=0 --group=0 -czf "$work/guest.tar.gz" metadata.yaml rootfs ||
	fail "packing the image tarball failed."

image_import "$work/guest.tar.gz" "$alias_name" "Lightspeed development guest"
echo "$alias_name $image_fingerprint" >&3
