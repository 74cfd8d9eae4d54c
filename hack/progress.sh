#!/usr/bin/env bash
# progress.sh LABEL COMMAND...: runs COMMAND, and while it runs prints a line
# every PROGRESS_INTERVAL seconds (default 30) with LABEL, the time so far and
# the packages Go's compiler is compiling, so that a first build that takes
# minutes says what it is doing. A run that ends sooner prints nothing more.
set -uo pipefail
label=$1
shift
interval=${PROGRESS_INTERVAL:-30}
start=$SECONDS
parent=$$
(
	# sleep's output is not make's: a sleep left when the ticker is killed
	# must not hold make's output open.
	while sleep "$interval" >/dev/null 2>&1; do
		kill -0 "$parent" 2>/dev/null || exit 0
		# The compiler's command line names its package after -p.
		pkgs=$(ps -eo args= 2>/dev/null | sed -n 's|^[^ ]*/compile .* -p \([^ ]*\) .*|\1|p' | sort -u | head -3 | paste -sd ' ' -)
		elapsed=$((SECONDS - start))
		doing="compiling $pkgs"
		[ -n "$pkgs" ] || doing="no package compiling now (downloading modules, linking, vetting or testing)"
		printf '    ... %s: %dm%02ds so far; %s\n' "$label" $((elapsed / 60)) $((elapsed % 60)) "$doing"
	done
) &
ticker=$!
trap 'kill "$ticker" 2>/dev/null' EXIT
"$@"
