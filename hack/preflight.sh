#!/usr/bin/env bash
# Checks, before anything long starts, what every build here needs: the Go
# version go.mod asks for and a C compiler for cgo (go-nvml). Each failure
# is one line that says how to fix it. Prints nothing when all is well.
set -uo pipefail
cd "$(dirname "$0")/.."
go=${GO:-go}

want=$(awk '$1 == "go" { print $2; exit }' go.mod)
if ! go=$(command -v "$go" 2>/dev/null); then
	echo "preflight: no '${GO:-go}' on PATH; gpufrac needs Go $want or newer: install it from https://go.dev/dl/" >&2
	exit 1
fi
# The toolchain on PATH, as it is before go.mod can make it switch.
have=$(cd / && GOTOOLCHAIN=local "$go" env GOVERSION 2>/dev/null)
have=${have#go}
# Go before 1.21 has no `go env GOVERSION`; it cannot build this module either.
if [ -z "$have" ]; then
	have=$("$go" version 2>/dev/null | awk '{ print $3 }')
	have=${have#go}
fi
older() { [ "$1" != "$2" ] && [ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -1)" = "$1" ]; }
if older "$have" "$want"; then
	toolchain=$("$go" env GOTOOLCHAIN 2>/dev/null)
	case "$toolchain" in
	local | "")
		echo "preflight: Go $have is older than the Go $want that go.mod asks for: install Go $want or newer from https://go.dev/dl/, or run with GOTOOLCHAIN=auto to let go fetch it through the module proxy" >&2
		exit 1
		;;
	*)
		echo "preflight: Go $have on PATH, go.mod asks for $want: go will first fetch go$want through the module proxy (GOTOOLCHAIN=$toolchain, once, about 70 MB)" >&2
		;;
	esac
fi

cc=$("$go" env CC 2>/dev/null)
cc=${cc:-gcc}
if ! command -v "${cc%% *}" >/dev/null 2>&1; then
	echo "preflight: cgo needs a C compiler for go-nvml and the nvidia-smi view library, and '$cc' is not on PATH: install one (Debian: apt-get install gcc) or set CC" >&2
	exit 1
fi
