#!/usr/bin/env bash
# The main job under load: RUNS (default 20) consecutive `make demo` runs on
# a fresh clone of this checkout's HEAD, with `go build -race -a` looping
# beside them to load the machine. Prints one line per run and the counts;
# exits 1 if any run failed (its log is kept in OUT).
#   hack/demo-stress.sh [RUNS] [OUT]
set -u
runs=${1:-20}
out=${2:-$(mktemp -d /tmp/demo-stress.XXXXXX)}
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel) || exit 1
clone=$out/clone
mkdir -p "$out" && rm -rf "$clone" && git clone -q "$repo" "$clone" || exit 1
cd "$clone" || exit 1
( while true; do go build -race -a -o /dev/null ./cmd/gpufrac >/dev/null 2>&1; done ) &
load=$!
trap 'kill $load 2>/dev/null; pkill -f "go build -race -a -o /dev/null" 2>/dev/null' EXIT
pass=0
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  if make demo >"$out/run$i.log" 2>&1; then pass=$((pass + 1)); r=pass; else r=FAIL; fi
  echo "run $i: $r $(($(date +%s) - start))s load average $(cut -d' ' -f1 /proc/loadavg)"
done
echo "$(git log -1 --format=%h): $pass of $runs passed (logs in $out)"
[ "$pass" -eq "$runs" ]
