#!/bin/sh
# /sbin/init of the Lightspeed development guest: PID 1 of a BusyBox
# container that runs lsenvd-dev, the development data-plane daemon.
#
# - Brings the loopback up: in a bare container it starts down, and the
#   daemon listens on 127.0.0.1:19091.
# - Runs the daemon and restarts it, half a second later, whenever it dies.
# - On SIGPWR (what `incus stop` sends a container's PID 1), SIGTERM or
#   SIGINT: asks the daemon to stop (it closes its connections and stops its
#   process groups within 300 ms), waits at most 0.7 s for it, and exits.
#   When PID 1 exits the kernel kills whatever is left in the container, so
#   a graceful stop takes no longer than that.
# - Reaps orphans: while this shell waits, BusyBox ash reaps every child,
#   the ones it adopted included.
#
# BusyBox's own init was measured too: its shutdown sleeps between SIGTERM and
# SIGKILL, and `incus stop` took 2.6 s with it against 0.6 s with this script.

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
HOME=/root
export PATH HOME
DAEMON=/usr/local/bin/lsenvd-dev

if [ -c /dev/console ] && : 2>/dev/null >/dev/console; then
	exec </dev/null >/dev/console 2>&1
fi

log() { echo "init: $*"; }

stopping=
daemon=

stop() {
	stopping=1
	log "$1: stopping"
	if [ -n "$daemon" ]; then
		kill -TERM "$daemon" 2>/dev/null
		(sleep 0.7; kill -KILL "$daemon" 2>/dev/null) &
		wait "$daemon"
	fi
	log "stopped"
	exit 0
}
trap 'stop SIGPWR' PWR
trap 'stop SIGTERM' TERM
trap 'stop SIGINT' INT
trap '' HUP

ip link set lo up || log "cannot bring the loopback up"

while [ -z "$stopping" ]; do
	"$DAEMON" &
	daemon=$!
	wait "$daemon"
	status=$?
	daemon=
	[ -n "$stopping" ] && break
	log "lsenvd-dev exited with status $status; restarting it in 0.5 s"
	# In the background, so a stop signal interrupts the pause at once.
	sleep 0.5 &
	wait $!
done
