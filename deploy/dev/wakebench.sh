#!/usr/bin/env bash
# Wake latency of this tree against a baseline build, in one run (issue 25):
# routebench is built from the current tree and from WAKEBENCH_BASE (default
# 568fd0f, the issue's starting point, in a throwaway git worktree), and the
# two run in turns, old first, WAKEBENCH_ROUNDS times each with
# WAKEBENCH_WAKES wakes from paused and from stopped per run, so that the
# machine's drift falls on both alike. Prints each run's figures, then per
# build the mean of the runs' p50 and p95, the ratios new/old, the goals
# (paused ≤ 0.6×, stopped ≤ 0.9×, every first dial upgraded) and the new
# build's breakdown of each wake (wake.Trace).
#
# Needs root, Incus at /var/lib/incus/unix.socket and the development guest
# image (built when missing). Exits non-zero only when it cannot measure.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}
base=${WAKEBENCH_BASE:-568fd0f}
wakes=${WAKEBENCH_WAKES:-20}
rounds=${WAKEBENCH_ROUNDS:-2}

if [ "$(id -u)" != 0 ]; then
	echo "wakebench: run as root (the netns GuestDialer enters the guests' namespaces)" >&2
	exit 1
fi
[ -S /var/lib/incus/unix.socket ] || deploy/dev/incus-up.sh
incus image info lightspeed-dev-guest >/dev/null 2>&1 || deploy/guest/build-image.sh >/dev/null
command -v socat >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q socat >/dev/null

work=$(mktemp -d /tmp/wakebench.XXXXXX)
cleanup() {
	git worktree remove --force "$work/base" >/dev/null 2>&1 || true
	git worktree prune
	rm -rf "$work"
}
trap cleanup EXIT

echo "wakebench: building routebench at $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with local changes)') and at $base" >&2
go build -o "$work/routebench-new" ./cmd/routebench
git worktree add --quiet --detach "$work/base" "$base"
(cd "$work/base" && go build -o "$work/routebench-old" ./cmd/routebench)

# The old routebench has no -only: it measures everything. These flags make
# the rest as short as it goes (one round-trip block per path, throughput
# slices of about a millisecond, one idle relay, no socat floor); its
# pause → wake → pause cycles (-wakes of them) come before its wakes, as
# ever. The new one measures the wakes alone.
old_flags=(-wakes "$wakes" -rtt 1 -seconds 10ms -idle-relays 1 -socat '')
new_flags=(-wakes "$wakes" -only wakes)

runs=()
for ((i = 1; i <= rounds; i++)); do
	for build in old new; do
		out=$work/$build-$i.txt
		if [ "$build" = old ]; then flags=("${old_flags[@]}"); else flags=("${new_flags[@]}"); fi
		echo "wakebench: run $i of $rounds, $build build" >&2
		"$work/routebench-$build" "${flags[@]}" >"$out"
		runs+=("$build-$i")
	done
done

# A wake row (report.go, printWakeRows) is, in columns of two or more
# spaces: "<from> → upgraded (first dial upgraded k/n)", n, p50, p95, …
rows() { # file from → "k n p50ms p95ms"
	awk -F '  +' -v from="$2" '
		index($1, from " → upgraded (first dial upgraded ") == 1 {
			split($1, a, "upgraded "); split(a[3], kn, "[/)]")
			p50 = $3; sub(/ ms/, "", p50); p95 = $4; sub(/ ms/, "", p95)
			print kn[1], kn[2], p50, p95
		}' "$1"
}

echo
echo "== wakes, build $base (old) against $(git rev-parse --short HEAD) (new), $rounds runs each in turns, $wakes wakes per run, $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
# The load around each run says which figures a busy machine bent.
load() { sed -n 's/.*load average \([^ ]*\) at the start, \([^ ]*\) at the end.*/\1 → \2/p' "$1"; }
printf '%-8s %-8s %-22s %-11s %-11s %-16s %s\n' run from "first dials upgraded" p50 p95 "load average" "new/old p50, this pair"
for r in "${runs[@]}"; do
	for from in paused stopped; do
		read -r k n p50 p95 < <(rows "$work/$r.txt" "$from")
		pair=""
		if [ "${r%-*}" = new ]; then
			read -r _ _ o50 _ < <(rows "$work/old-${r#*-}.txt" "$from")
			pair=$(awk -v a="$p50" -v b="$o50" 'BEGIN { printf "%.2f×", a / b }')
		fi
		printf '%-8s %-8s %-22s %-11s %-11s %-16s %s\n' "$r" "$from" "$k/$n" "$p50 ms" "$p95 ms" "$(load "$work/$r.txt")" "$pair"
	done
done

echo
printf '%-8s %-14s %-14s %-14s %-14s %-10s %-22s %s\n' from "old p50" "new p50" "old p95" "new p95" "new/old" goal result
for from in paused stopped; do
	goal=0.9
	[ "$from" = paused ] && goal=0.6
	summary=$(for r in "${runs[@]}"; do
		printf '%s ' "${r%-*}"
		rows "$work/$r.txt" "$from"
	done | awk -v goal="$goal" '
		{ k[$1] += $2; n[$1] += $3; p50[$1] += $4; p95[$1] += $5; c[$1]++ }
		END {
			o50 = p50["old"] / c["old"]; n50 = p50["new"] / c["new"]
			q = n50 / o50
			ok = (q <= goal && k["new"] == n["new"]) ? "met" : "MISSED"
			printf "%-14s %-14s %-14s %-14s %-10s %-22s %s (new first dials %d/%d, old %d/%d)\n",
				sprintf("%.1f ms", o50), sprintf("%.1f ms", n50),
				sprintf("%.1f ms", p95["old"] / c["old"]), sprintf("%.1f ms", p95["new"] / c["new"]),
				sprintf("%.2f×", q), "≤ " goal "×, all upgraded", ok, k["new"], n["new"], k["old"], n["old"]
		}')
	printf '%-8s %s\n' "$from" "$summary"
done
echo "(p50 and p95 are the means of the runs' own; the ratio is of the mean p50s; each pair's ratio is above)"

echo
echo "== the new build's wakes divided by the provider's own clock, per run (wake.Trace)"
for ((i = 1; i <= rounds; i++)); do
	sed -n '/^wake breakdown/,/^from stopped/p' "$work/new-$i.txt"
done
sed -n '/^Each upgraded first dial/,/^not add up/p' "$work/new-1.txt"
