#!/usr/bin/env bash
# Runs every policy on every pod trace in a trace directory, and on the
# variants derived from its default trace (VARIANTS), seeds 42-51 unless
# SEEDS says otherwise, and writes one JSON line per run to
# OUT/runs.jsonl, then docs/placement.md's table (mean allocation at 130% arrived
# per policy and trace, with the study's published FGD mean and our
# margin over it) to OUT/table.md.
set -euo pipefail
traces=${1:?usage: hack/sim-table.sh TRACE_DIR [OUT]}
out=${2:-_output/sim}
seeds=${SEEDS:-42-51}
bin=${GPUFRAC:-bin/gpufrac}
mkdir -p "$out"
: > "$out/runs.jsonl"
for pods in "$traces"/openb_pod_list_*.csv; do
	name=$(basename "$pods" .csv)
	echo "== $name" >&2
	"$bin" sim --nodes "$traces/openb_node_list_gpu_node.csv" --pods "$pods" --policy all --seeds "$seeds" --json |
		sed "s/^{/{\"trace\":\"$name\",/" >> "$out/runs.jsonl"
done
# Our own mixes beyond the study's heaviest (gpufrac sim --variant; pkg/sim/variant.go).
for variant in ${VARIANTS:-multigpu50 multigpu70 cpuonly50 cpuonly60}; do
	echo "== default+$variant" >&2
	"$bin" sim --nodes "$traces/openb_node_list_gpu_node.csv" --pods "$traces/openb_pod_list_default.csv" --variant "$variant" \
		--policy all --seeds "$seeds" --json | sed "s/^{/{\"trace\":\"default+$variant\",/" >> "$out/runs.jsonl"
done
go run ./hack/simtable --runs "$out/runs.jsonl" --published "$traces/fgd-atc23-expected-results/analysis_allo_discrete.csv" > "$out/table.md"
cat "$out/table.md"
