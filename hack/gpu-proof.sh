#!/usr/bin/env bash
# gpu-proof.sh: what a GPU machine can prove about gpufrac's node side, run
# on one (`run` on the device machine; about 2 minutes). It prints one
# "RESULT <check>: PASS|FAIL|SKIP <why>" line per check and writes the
# details under $GPU_PROOF_OUT (default: $OUT, else ./gpu-proof-out).
#
# On a driver before r615 (the machines lent so far run r580) it checks:
#   inventory   NVML's inventory, read by `gpufrac inventory`, equals nvidia-smi -L;
#   capability  the node's enforcement is mps-pinned, not driver: the driver's
#               per-cgroup limits (SetMemoryLimits_v1) need r615 and CUDA 13.4;
#   pinned      an MPS client cannot allocate past CUDA_MPS_PINNED_DEVICE_MEM_LIMIT,
#               and can below it;
#   overlap     two clients of one MPS server run kernels at once; two plain
#               processes (separate contexts) are time-sliced, one after the other;
#   view        nvidia-smi through gpufrac's view library shows the limit as total.
# Not yet here (they need a kube-apiserver on the machine): the agent
# publishing the inventory, and the driver backend's not-Ready reason.
#
# Exit status: 0 every check passed or was skipped with a reason, 1 a check
# failed, 2 no GPU here (nothing is measured).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${GPU_PROOF_OUT:-${OUT:-$PWD/gpu-proof-out}}
mkdir -p "$out"
failed=0
result() { # check status why
  printf 'RESULT %s: %s %s\n' "$1" "$2" "$3" | tee -a "$out/results.txt"
  [ "$2" = FAIL ] && failed=1
  return 0
}

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$out/nvidia-smi-L.txt" 2>&1; then
  echo "gpu-proof: no NVIDIA GPU here (nvidia-smi is missing or fails): nothing to prove" >&2
  exit 2
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
echo "gpu-proof: driver $driver; details in $out"

# The probe (CUDA driver API through dlopen) and the view library are C:
# built here when a compiler is, else taken from build/ if carried there.
build=$root/build/gpu-proof
mkdir -p "$build"
if command -v cc >/dev/null 2>&1; then
  cc -std=c11 -D_POSIX_C_SOURCE=200809L -O2 -o "$build/probe" "$root/hack/gpu-proof/csrc/probe.c" -ldl
fi
probe=$build/probe
gpufrac=$root/bin/gpufrac
if [ ! -x "$gpufrac" ] && command -v go >/dev/null 2>&1; then
  (cd "$root" && CGO_ENABLED=1 go build -o "$gpufrac" ./cmd/gpufrac) >"$out/build.log" 2>&1
fi
shim=$root/bin/shim/libnvidia-ml.so.1
if [ ! -f "$shim" ] && command -v go >/dev/null 2>&1; then
  (cd "$root" && go run ./shim/cmd/build-shim "$root/bin/shim") >>"$out/build.log" 2>&1
fi

# inventory, capability
if [ -x "$gpufrac" ]; then
  "$gpufrac" inventory >"$out/inventory.txt" 2>&1
  # "GPU 0: NAME (UUID: GPU-…) 81559 MiB" against nvidia-smi's "GPU 0: NAME (UUID: GPU-…)".
  sed -E 's/\) [0-9]+ MiB( MIG)?$/)/' "$out/inventory.txt" | grep '^GPU ' >"$out/inventory-as-L.txt"
  if diff -u "$out/nvidia-smi-L.txt" "$out/inventory-as-L.txt" >"$out/inventory.diff"; then
    result inventory PASS "$(grep -c '^GPU ' "$out/inventory.txt") GPU(s), as nvidia-smi -L lists them"
  else
    result inventory FAIL "NVML's inventory differs from nvidia-smi -L (inventory.diff)"
  fi
  capability=$(sed -nE '1s/.*enforcement ([a-z-]+)$/\1/p' "$out/inventory.txt")
  major=${driver%%.*}
  if [ "$major" -lt 615 ] && [ "$capability" = mps-pinned ]; then
    result capability PASS "driver $driver: mps-pinned (driver limits need r615 and CUDA 13.4)"
  elif [ "$major" -ge 615 ] && [ "$capability" = driver ]; then
    result capability PASS "driver $driver: driver limits"
  else
    result capability FAIL "driver $driver, enforcement $capability"
  fi
else
  result inventory SKIP "no bin/gpufrac and no Go toolchain to build it"
  result capability SKIP "no bin/gpufrac"
fi

if [ ! -x "$probe" ]; then
  result pinned SKIP "no C compiler and no carried build/gpu-proof/probe"
  result overlap SKIP "no probe"
else
  "$probe" info >"$out/probe-info.txt" 2>&1
  total=$(awk '/^device 0 /{print $4; exit}' "$out/probe-info.txt")
  # An MPS control daemon of our own, in a private pipe directory.
  export CUDA_MPS_PIPE_DIRECTORY=$out/mps/pipe CUDA_MPS_LOG_DIRECTORY=$out/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! nvidia-cuda-mps-control -d >"$out/mps-start.txt" 2>&1; then
    result pinned SKIP "nvidia-cuda-mps-control -d failed (mps-start.txt)"
    result overlap SKIP "no MPS daemon"
  else
    # pinned: 4 GiB allowed; 3 GiB fits, 5 GiB must not.
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M "$probe" alloc 3072 >"$out/pinned-below.txt" 2>&1
    below=$?
    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M "$probe" alloc 5120 >"$out/pinned-above.txt" 2>&1
    above=$?
    if [ $below -eq 0 ] && [ $above -eq 3 ]; then
      result pinned PASS "limit 4096M: 3072 MiB allocated, 5120 MiB refused ($(cat "$out/pinned-above.txt" | tr '\n' ' '))"
    else
      result pinned FAIL "limit 4096M: 3072 MiB exit $below, 5120 MiB exit $above (pinned-*.txt)"
    fi
    # overlap: two clients of one server, each one block spinning 2 s.
    t0=$(date +%s%N)
    "$probe" spin 2000 >"$out/overlap-mps-1.txt" 2>&1 &
    "$probe" spin 2000 >"$out/overlap-mps-2.txt" 2>&1 &
    wait
    mps_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    sleep 2
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    # Without MPS: two contexts, which the GPU time-slices.
    t0=$(date +%s%N)
    "$probe" spin 2000 >"$out/overlap-plain-1.txt" 2>&1 &
    "$probe" spin 2000 >"$out/overlap-plain-2.txt" 2>&1 &
    wait
    plain_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    # Context creation and module load take a moment too: one server is
    # concurrent when it takes well under the 4 s that one after the other needs.
    if [ $mps_ms -lt 3500 ] && [ $plain_ms -ge 3500 ]; then
      result overlap PASS "two 2 s kernels: ${mps_ms} ms as clients of one MPS server, ${plain_ms} ms as two plain processes"
    else
      result overlap FAIL "two 2 s kernels: ${mps_ms} ms with one MPS server, ${plain_ms} ms without (overlap-*.txt)"
    fi
  fi
fi

# view: nvidia-smi with gpufrac's library in front of the real one.
if [ -f "$shim" ]; then
  real=$(ldconfig -p | awk '/libnvidia-ml.so.1 /{print $NF; exit}')
  GPUFRAC_REAL_NVML=$real NVIDIA_GPU_MEMORY_LIMIT=20480 LD_LIBRARY_PATH=$(dirname "$shim") \
    nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 >"$out/view.txt" 2>&1
  shown=$(head -1 "$out/view.txt" | tr -d ' ')
  if [ "$shown" = 20480 ]; then
    result view PASS "nvidia-smi shows 20480 MiB total with a 20480 MiB limit (the GPU has ${total:-?} MiB)"
  else
    result view FAIL "nvidia-smi shows '$shown' with a 20480 MiB limit (view.txt)"
  fi
else
  result view SKIP "no bin/shim/libnvidia-ml.so.1 and no Go toolchain to build it"
fi

exit $failed
