# Shared by the test scripts (test.sh, test-image.sh, unit-in-systemd.sh).
# Source it; it defines functions only.

# drop_incus_project P deletes every instance of the Incus project P, then
# the project, with the incus client as the environment points it (the
# cluster rig's INCUS_DIR included). Nothing when there is no such project.
drop_incus_project() {
  incus project show "$1" >/dev/null 2>&1 || return 0
  for i in $(incus list --project "$1" --format csv -c n 2>/dev/null); do
    incus delete --force --project "$1" "$i" >/dev/null 2>&1 || true
  done
  incus project delete "$1" >/dev/null 2>&1 || true
}

# provider_env_unset prints env(1) options that unset the variables a
# provider refuses as not its settings but a test run exports: the test
# harness's own (INCUS_PROVIDER_*, PROVIDER_TEST_*) and the cluster rig's
# (INCUS_CLUSTER_*, from cluster.env). Use: env $(provider_env_unset) ...
provider_env_unset() {
  local v
  for v in $(compgen -e); do
    case $v in INCUS_PROVIDER_* | PROVIDER_TEST_* | INCUS_CLUSTER_MEMBERS | INCUS_CLUSTER_SOCKETS | INCUS_CLUSTER_PIDS) printf -- '-u %s ' "$v" ;; esac
  done
}

# await_provider PID OUT LOG waits up to 10 s for the provider process PID
# to print its controller URL on OUT; if it exits or never does, its LOG is
# shown and the wait fails. OUT must not hold an earlier process's output:
# the child truncates it only once it runs.
await_provider() {
  for _ in $(seq 1 100); do
    grep -q '^controller URL' "$2" 2>/dev/null && return 0
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  echo "the provider did not start serving; its log:" >&2
  tail -n 50 "$3" >&2
  return 1
}

# conform URL CREDENTIAL UNIVERSE LOG runs lsconform against the provider at
# URL, showing the provider's LOG when it fails. Its idle loop acts about
# 0.2 s past a threshold: 5 s of grace, not the suite's 30 s, keeps
# idle-obligations (then about 20 s) near the 17 s the other checks take
# beside it; at 10 s the run took 30 s.
conform() {
  bin/lsconform -url "$1" -credential-file "$2" -universe "$3" -idle-grace 5s || {
    echo "provider log:" >&2; tail -n 50 "$4" >&2; return 1; }
}

# no_busy_warnings LOG fails when the provider's LOG holds an Incus busy
# refusal at warning level or above. Busy from outside the process
# (another replica, an operator) is routine and logged at info; one the
# provider met from its own writes is the defect issue 25 removed.
no_busy_warnings() {
  if grep -i 'busy' "$1" | grep -E '"level":"(warn|error|dpanic|panic|fatal)"' >&2; then
    echo "the provider logged a busy refusal at warning level or above (above), in $1" >&2
    return 1
  fi
}
