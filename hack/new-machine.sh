#!/usr/bin/env bash
# new-machine.sh [TARGET...]: runs `make TARGET...` (default: test) as a new
# machine would, on this one: in a fresh clone of this commit, with empty Go
# build and module caches, an empty HOME (golangci-lint's and Helm's caches)
# and no bin/, so nothing an earlier run built or downloaded is used. The node
# tests need no more: they run their node in namespaces of its own, so the
# machine's history (a kubelet that ran before, a killed run) does not reach
# them (docs/node-e2e.md).
#
#   NEW_MACHINE_DIR=dir   where the clone and its caches go (default: a new
#                         directory under /var/tmp). Give the same one again
#                         for a second run on the same "machine": warm caches,
#                         bin/ kept, the clone moved to this commit.
#   NEW_MACHINE_PURGE=1   first remove the Debian packages make test installs
#                         (chromium, runc, busybox-static, the CNI plugins,
#                         iptables), so that their install is tested too; dpkg
#                         refuses if another package needs one of them.
#
# The environment is emptied but for PATH, TERM and a proxy's variables
# (http_proxy, https_proxy, no_proxy, GOPROXY, GONOSUMDB, GOPRIVATE), which
# a new machine behind a proxy would have too.
#
# It prints each run's time and keeps a log (make.log) in the directory.
# docs/development.md says how this was used and what it measured.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=${NEW_MACHINE_DIR:-}
if [ -z "$dir" ]; then
	dir=$(mktemp -d /var/tmp/gpufrac-new-machine.XXXXXX)
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ "${NEW_MACHINE_PURGE:-}" = 1 ]; then
	installed=$(for p in chromium runc busybox-static containernetworking-plugins iptables; do dpkg -s "$p" >/dev/null 2>&1 && echo "$p"; done)
	if [ -n "$installed" ]; then
		echo "new-machine: removing Debian's" $installed
		dpkg --purge $installed >/dev/null
	fi
fi
if [ ! -d "$dir/gpufrac" ]; then
	git clone --quiet --no-hardlinks "$repo" "$dir/gpufrac"
fi
git -C "$dir/gpufrac" fetch --quiet "$repo" HEAD
git -C "$dir/gpufrac" checkout --quiet --detach FETCH_HEAD
mkdir -p "$dir/home" "$dir/gocache" "$dir/gomodcache" "$dir/gopath"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(test)
echo "new-machine: make ${targets[*]} in $dir/gpufrac (commit $(git -C "$dir/gpufrac" rev-parse --short HEAD)), Go caches in $dir"
start=$(date +%s)
set +e
(
	cd "$dir/gpufrac"
	# Only what a new user's shell has: PATH, a proxy's settings, and Go's
	# and make's defaults.
	keep=()
	for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY GOPROXY GONOSUMDB GOPRIVATE; do
		[ -z "${!v:-}" ] || keep+=("$v=${!v}")
	done
	exec env -i PATH="$PATH" HOME="$dir/home" TERM="${TERM:-dumb}" "${keep[@]}" \
		GOCACHE="$dir/gocache" GOMODCACHE="$dir/gomodcache" GOPATH="$dir/gopath" \
		make "${targets[@]}"
) 2>&1 | tee "$dir/make.log"
rc=${PIPESTATUS[0]}
set -e
elapsed=$(($(date +%s) - start))
printf 'new-machine: make %s exited %s after %dm%02ds (log: %s)\n' "${targets[*]}" "$rc" $((elapsed / 60)) $((elapsed % 60)) "$dir/make.log"
exit "$rc"
