#!/usr/bin/env bash
# Runs every fuzz target for a number of executions (default 10^7), one at a
# time, with one fuzzing worker, niced, and prints a table of what each run
# did. Not part of `make test`: at 10^7 executions a run takes about three
# and a half hours on this project's 2-core machine, most of it
# FuzzServeFrame's and the relay's. BENCHMARKS.md ("Fuzzing") records the
# latest table.
#
#   deploy/dev/fuzz.sh                      # every target, 10^7 each
#   deploy/dev/fuzz.sh -n 100000            # every target, 10^5 each
#   deploy/dev/fuzz.sh FuzzParsePath ...    # only these targets
#   deploy/dev/fuzz.sh -t 15m FuzzServeFrame # a time budget instead of a count
#   deploy/dev/fuzz.sh -k FuzzDecode        # keep the new corpus entries
#
# Environment: FUZZ_PARALLEL (workers, default 1), FUZZ_NICE (default 10),
# FUZZ_LOGS (a directory to keep each target's output in; default a
# temporary one, removed afterwards).
#
# New corpus entries go to the fuzz cache ($GOCACHE/fuzz); with -k, those a
# run wrote are copied to the package's testdata/fuzz/<target>, to be
# committed, so that the corpus outlives the cache and every `go test` runs
# it. Only a run's own entries are copied: the cache may hold entries of a
# target's older signature, which go test would refuse as seeds.
# A failing input is written by the fuzzer to the package's testdata/fuzz;
# commit it with the fix and its regression test. Exits non-zero when any
# target found a failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
export GOFLAGS=${GOFLAGS:--mod=mod}
command -v go >/dev/null 2>&1 || export PATH=$PATH:/usr/local/go/bin

# package target, in the order they run (cheapest first).
TARGETS=(
  "./internal/wsframe/ FuzzParseHeader"
  "./internal/routepath/ FuzzParsePath"
  "./internal/wire/ FuzzDecode"
  "./internal/wire/ FuzzNesting"
  "./internal/jsonrpc/ FuzzDecodeFrame"
  "./routes/ FuzzRelayForwardsAPrefix"
  "./internal/jsonrpc/ FuzzServeFrame"
)

count=10000000
budget=""
keep=""
while getopts n:t:kh opt; do
  case $opt in
    n) count=$OPTARG ;;
    t) budget=$OPTARG ;;
    k) keep=1 ;;
    *) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
case $count in '' | *[!0-9]*) echo "fuzz: -n wants a whole number, not '$count'" >&2; exit 2 ;; esac
fuzztime=${budget:-${count}x}

selected=()
if [ $# -eq 0 ]; then
  selected=("${TARGETS[@]}")
else
  for want in "$@"; do
    found=""
    for t in "${TARGETS[@]}"; do
      if [ "${t#* }" = "$want" ]; then found=$t; fi
    done
    if [ -z "$found" ]; then echo "fuzz: no target $want (known: $(printf '%s ' "${TARGETS[@]#* }"))" >&2; exit 2; fi
    selected+=("$found")
  done
fi

logs=${FUZZ_LOGS:-}
if [ -z "$logs" ]; then
  logs=$(mktemp -d)
  trap 'rm -rf "$logs"' EXIT
fi
mkdir -p "$logs"

# seconds turns the fuzzer's elapsed time (1h2m3s, 4m0s, 59s) into seconds.
seconds() {
  awk -v d="$1" 'BEGIN {
    s = 0
    while (match(d, /^[0-9.]+[hms]/)) {
      n = substr(d, 1, RLENGTH - 1); u = substr(d, RLENGTH, 1)
      s += n * (u == "h" ? 3600 : u == "m" ? 60 : 1)
      d = substr(d, RLENGTH + 1)
    }
    print s
  }'
}

rows=()
failed=0
for t in "${selected[@]}"; do
  pkg=${t% *}
  name=${t#* }
  log="$logs/$name.log"
  echo "fuzz: $name in $pkg, -fuzztime $fuzztime ..." >&2
  cache="$(go env GOCACHE)/fuzz/$(go list -f '{{.ImportPath}}' "$pkg")/$name"
  before="$logs/$name.cache-before"
  { ls "$cache" 2>/dev/null || true; } | sort >"$before"
  status=0
  # -timeout 0: go test's default 10-minute timeout applies to fuzzing too.
  nice -n "${FUZZ_NICE:-10}" go test -run '^$' -fuzz "^$name\$" -fuzztime "$fuzztime" -timeout 0 \
    -parallel "${FUZZ_PARALLEL:-1}" "$pkg" >"$log" 2>&1 || status=$?
  # The fuzzer's last progress line: elapsed, executions, new corpus entries.
  last=$(grep -E '^fuzz: elapsed: .*execs: ' "$log" | tail -n 1 || true)
  elapsed=$(sed -nE 's/^fuzz: elapsed: ([0-9hms.]+),.*/\1/p' <<<"$last")
  execs=$(sed -nE 's/.*execs: ([0-9]+) .*/\1/p' <<<"$last")
  fresh=$(sed -nE 's/.*new interesting: ([0-9]+) .*/\1/p' <<<"$last")
  secs=$(seconds "${elapsed:-0s}")
  rate=$(awk -v e="${execs:-0}" -v s="$secs" 'BEGIN { if (s > 0) printf "%.0f", e / s; else print "-" }')
  finding="none"
  if [ "$status" -ne 0 ]; then
    failed=1
    input=$(sed -nE 's/.*Failing input written to (testdata\/fuzz\/[^ ]+).*/\1/p' "$log" | tail -n 1)
    finding="FAILED${input:+: $pkg${input}}"
    grep -E -m 3 -- '--- FAIL|^ +[a-z_]+_test\.go:[0-9]+:' "$log" >&2 || tail -n 20 "$log" >&2
  fi
  kept=""
  if [ -n "$keep" ]; then
    dir="${pkg%/}/testdata/fuzz/$name"
    mkdir -p "$dir"
    n=0
    while IFS= read -r f; do
      cp -n "$cache/$f" "$dir/" && n=$((n + 1))
    done < <({ ls "$cache" 2>/dev/null || true; } | sort | comm -13 "$before" -)
    kept=", $n kept in $dir"
  fi
  rows+=("$(printf '| %s | %s | %s | %s | %s | %s |' "$name" "${execs:-0}" "${elapsed:-?}" "$rate" "${fresh:-0}" "$finding")")
  echo "fuzz: $name: ${execs:-0} executions in ${elapsed:-?} ($rate/s), ${fresh:-0} new corpus entries$kept, finding: $finding" >&2
done

echo
echo "$(date -u +%Y-%m-%d) $(go env GOVERSION) $(nproc) cores, -fuzztime $fuzztime -parallel ${FUZZ_PARALLEL:-1}, nice ${FUZZ_NICE:-10}"
echo
echo "| target | executions | duration | execs/s | new corpus entries | findings |"
echo "| --- | ---: | ---: | ---: | ---: | --- |"
printf '%s\n' "${rows[@]}"
exit $failed
