#!/usr/bin/env bash
# The systemd unit (deploy/systemd/incus-provider.service) under a real
# systemd: this machine has none as PID 1, so the unit runs in a privileged
# container of the production-shaped Debian image, whose PID 1 is systemd
# 252, with the host's Incus socket passed in by a proxy device. Checked:
# the hardened unit starts the provider and serves lsconform; `systemctl
# reload` reloads the templates in the same process; `systemctl stop` ends it
# cleanly; a refused setting (exit 2) is not restarted; and systemd's own
# online security score.
#
# The provider reaches guests with the exec dialer here: the container has
# its own PID namespace, so the host PIDs the netns dialer enters are not
# visible in it. The netns path under the unit's capability bounding and
# system call filter is what the container image's test covers on the host.
#
# Usage: deploy/dev/unit-in-systemd.sh IMAGE_ALIAS (as deploy/dev/test-image.sh runs it)
set -euo pipefail
cd "$(dirname "$0")/../.."
alias=${1:?usage: unit-in-systemd.sh IMAGE_ALIAS}
tag=$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')
host_project="lsunit-$tag"       # the container holding systemd and the unit
target_project="lsunit-t-$tag"   # the provider's targets
work=$(mktemp -d)
# shellcheck source=deploy/dev/lib.sh
. deploy/dev/lib.sh
cleanup() {
  status=$?
  drop_incus_project "$host_project"
  drop_incus_project "$target_project"
  rm -rf "$work"
  exit $status
}
trap cleanup EXIT
fail() { echo "unit-in-systemd: $*" >&2; exit 1; }
in_box() { incus --project "$host_project" exec box -- "$@"; }
push() { incus --project "$host_project" file push --quiet "$@"; }

for p in "$host_project" "$target_project"; do
  incus project create "$p" -c features.images=false -c features.profiles=false >/dev/null
done
incus --project "$host_project" init "$alias" box -c security.privileged=true -c security.nesting=true >/dev/null
incus --project "$host_project" config device add box incus-sock proxy \
  listen=unix:/run/incus-host.sock connect=unix:/var/lib/incus/unix.socket bind=instance mode=0600 >/dev/null
incus --project "$host_project" start box >/dev/null 2>&1
for _ in $(seq 1 100); do
  state=$(in_box systemctl is-system-running 2>/dev/null || true)
  case $state in running | degraded) break ;; esac
  sleep 0.1
done
echo "systemd in the container: $(in_box systemctl --version | head -n1) ($state)"

mkdir -p "$work/bin"
go build -o "$work/bin/incus-provider" ./cmd/incus-provider
go build -o "$work/bin/lsconform" ./cmd/lsconform
push --mode 0755 "$work/bin/incus-provider" box/usr/local/bin/incus-provider
push --mode 0755 "$work/bin/lsconform" box/usr/local/bin/lsconform
push deploy/systemd/incus-provider.service box/etc/systemd/system/incus-provider.service
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$work/credential"
cat > "$work/provider.env" <<ENV
INCUS_SOCKET=/run/incus-host.sock
INCUS_PROJECT=$target_project
PROVIDER_GUEST_DIALER=exec
PROVIDER_TEMPLATES=/etc/incus-provider/templates.yaml
PROVIDER_CREDENTIAL_FILE=/etc/incus-provider/credential
PROVIDER_LISTEN=127.0.0.1:8480
PROVIDER_METRICS_LISTEN=127.0.0.1:9480
PROVIDER_INGRESS_LISTEN=127.0.0.1:8482
PROVIDER_GRACEFUL_STOP=5s
ENV
in_box mkdir -p -m 0700 /etc/incus-provider
for f in credential provider.env; do push --mode 0600 "$work/$f" "box/etc/incus-provider/$f"; done
push --mode 0600 deploy/templates.dev.yaml box/etc/incus-provider/templates.yaml
in_box systemctl daemon-reload

echo "start"
in_box systemctl start incus-provider
for _ in $(seq 1 100); do
  in_box journalctl -u incus-provider --no-pager -o cat 2>/dev/null | grep -q '^controller URL' && break
  sleep 0.1
done
[ "$(in_box systemctl is-active incus-provider)" = active ] || { in_box journalctl -u incus-provider --no-pager -n 30 >&2; fail "the unit did not start"; }
pid=$(in_box systemctl show -p MainPID --value incus-provider)

echo "lsconform through the unit's provider"
in_box lsconform -url ws://127.0.0.1:8480/control -credential-file /etc/incus-provider/credential -universe u-unit -idle-grace 5s ||
  { in_box journalctl -u incus-provider --no-pager -n 50 >&2; fail "lsconform failed against the provider under systemd"; }

echo "reload"
in_box systemctl reload incus-provider ||
  { in_box journalctl -u incus-provider --no-pager -n 20 >&2; fail "systemctl reload failed"; }
in_box journalctl -u incus-provider --no-pager -o cat | grep -q 'SIGHUP: templates reloaded' || fail "the reload did not reload the templates"
[ "$(in_box systemctl show -p MainPID --value incus-provider)" = "$pid" ] || fail "the reload replaced the process"

echo "reload a changed log level from provider.env"
echo 'PROVIDER_LOG_LEVEL=debug' | incus --project "$host_project" exec box -- sh -c 'cat >> /etc/incus-provider/provider.env'
in_box systemctl reload incus-provider || fail "systemctl reload failed"
for _ in $(seq 1 50); do
  in_box journalctl -u incus-provider --no-pager -o cat | grep -q 'SIGHUP: the log level is now debug' && break
  sleep 0.1
done
in_box journalctl -u incus-provider --no-pager -o cat | grep -q 'SIGHUP: the log level is now debug' ||
  { in_box journalctl -u incus-provider --no-pager -n 20 >&2; fail "the reload did not apply provider.env's log level"; }
[ "$(in_box systemctl show -p MainPID --value incus-provider)" = "$pid" ] || fail "the reload replaced the process"

echo "security score (online, systemd's own)"
in_box systemd-analyze security incus-provider --no-pager | tail -n1

echo "stop"
in_box systemctl stop incus-provider
result=$(in_box systemctl show -p Result --value incus-provider)
code=$(in_box systemctl show -p ExecMainStatus --value incus-provider)
[ "$result" = success ] && [ "$code" = 0 ] || fail "the stop ended with result $result, exit status $code"

echo "a refused setting: exit 2, not restarted"
echo 'PROVIDER_GUEST_DIALER=bogus' | incus --project "$host_project" exec box -- sh -c 'cat >> /etc/incus-provider/provider.env'
in_box systemctl start incus-provider || true
sleep 7 # past RestartSec=5s: a restart would have come by now
status=$(in_box systemctl show -p ExecMainStatus --value incus-provider)
restarts=$(in_box systemctl show -p NRestarts --value incus-provider)
[ "$status" = 2 ] || fail "a bad setting exited $status, want 2"
[ "$restarts" = 0 ] || fail "a bad setting was restarted $restarts times"
in_box journalctl -u incus-provider --no-pager -o cat | grep -q 'PROVIDER_GUEST_DIALER' || fail "the refusal names no setting"
echo "unit-in-systemd: passed"
