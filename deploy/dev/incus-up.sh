#!/usr/bin/env bash
# Makes sure a local Incus answers on its unix socket, installing and
# starting it when it does not. Safe to run again: it changes nothing that
# is already in place and never touches an instance.
#
# On a machine where this script started incusd it writes the daemon's PID to
# $STATE_DIR/incusd.pid; deploy/dev/incus-down.sh stops exactly that daemon.
# Debian 12 (bookworm), as root; Incus 6.0 LTS comes from bookworm-backports.
set -euo pipefail

STATE_DIR=${STATE_DIR:-/run/incus-provider-dev}
SOCKET=${INCUS_SOCKET:-/var/lib/incus/unix.socket}
LOG=${INCUSD_LOG:-/var/log/incusd.log}
say() { printf 'incus-up: %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then
  say "run me as root: installing and starting Incus needs it."
  exit 1
fi

mkdir -p "$STATE_DIR"
if ! command -v curl >/dev/null 2>&1; then
  apt-get update >>"$STATE_DIR/apt.log" 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y curl >>"$STATE_DIR/apt.log" 2>&1
fi
answering() { curl -fsS --max-time 3 --unix-socket "$SOCKET" http://incus/1.0 >/dev/null 2>&1; }

if ! command -v incusd >/dev/null 2>&1 && [ ! -x /usr/libexec/incus/incusd ]; then
  say "installing Incus from bookworm-backports (about 30 s)"
  # On a machine run by systemd, the package starts incus.service (and
  # incus.socket) itself: the drop-in gives that daemon the same setting as
  # the one started below, before it can first start.
  if [ -d /run/systemd/system ]; then
    mkdir -p /etc/systemd/system/incus.service.d
    printf '[Service]\nEnvironment=INCUS_SKIP_INSTANCE_TYPES=1\n' > /etc/systemd/system/incus.service.d/skip-instance-types.conf
    systemctl daemon-reload >/dev/null 2>&1 || true
  fi
  if [ ! -f /etc/apt/sources.list.d/bookworm-backports.sources ] && ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d; then
    cat > /etc/apt/sources.list.d/bookworm-backports.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  apt-get update >>"$STATE_DIR/apt.log" 2>&1 || apt-get update >>"$STATE_DIR/apt.log" 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -t bookworm-backports incus >>"$STATE_DIR/apt.log" 2>&1 || {
    say "apt-get install incus failed; see $STATE_DIR/apt.log"; exit 1; }
fi
# A daemon of this socket's data directory that is running but slow (a
# loaded machine took over 3 s to answer) is waited for, never doubled: a
# second incusd on the same directory was started so once, beside the first.
daemon_running() { pgrep -f -x '(/usr/(lib|libexec)/incus/)?incusd --group root --logfile '"$LOG" >/dev/null 2>&1; }
if ! answering && daemon_running; then
  say "incusd is running but slow to answer; waiting for it"
  incus admin waitready --timeout=120 >/dev/null 2>&1 || { say "the running incusd did not answer within 120 s; see $LOG"; exit 1; }
fi
if ! answering; then
  INCUSD=$(command -v incusd || echo /usr/libexec/incus/incusd)
  [ -x "$INCUSD" ] || INCUSD=/usr/libexec/incus/incusd
  say "starting incusd (log: $LOG)"
  # Its own session, and no inherited output: a daemon holding the caller's
  # pipe open would keep a CI run from ever ending. INCUS_SKIP_INSTANCE_TYPES
  # keeps incusd from looking up the public image server's instance types at
  # start: nothing here may leave this machine.
  INCUS_SKIP_INSTANCE_TYPES=1 setsid "$INCUSD" --group root --logfile "$LOG" </dev/null >>"$LOG.out" 2>&1 &
  # The start instant makes each start's record unique, even if a PID repeats.
  echo "$! $(date +%s%N)" > "$STATE_DIR/incusd.pid"
  if ! incus admin waitready --timeout=60 >/dev/null 2>&1; then
    say "incusd did not become ready within 60 s; see $LOG"
    exit 1
  fi
fi

# Storage: `incus admin init --minimal` cannot pick a bridge subnet here, and
# the provider needs no bridge (guests are reached through their own
# namespace), so only a pool and the default profile's root disk are made.
if ! incus storage show default >/dev/null 2>&1; then
  incus storage create default dir >/dev/null
fi
if ! incus profile device show default 2>/dev/null | grep -q '^root:'; then
  incus profile device add default root disk path=/ pool=default >/dev/null
fi
say "Incus answers on $SOCKET"
