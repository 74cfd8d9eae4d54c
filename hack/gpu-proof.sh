#!/usr/bin/env bash
# gpu-proof.sh: what a GPU machine can prove about gpufrac's node side, run
# on one (`run` on the device machine; about 2 minutes). It prints one
# "RESULT <check>: PASS|FAIL|SKIP|INFO <why>" line per check (INFO: a fact
# measured for the design, with no right answer) and leaves, in
# $GPU_PROOF_OUT (default: $OUT, else ./gpu-proof-out), results.txt and
# details.tar.gz (every command's output). `make gpu-proof-pack` builds what
# it needs into build/gpu-proof, small enough to travel to a machine
# without Go: gpufrac (stripped, gzipped), the view library, the probe.
#
# On a driver before r615 (the machines lent so far run r580) it checks:
#   inventory   NVML's inventory, read by `gpufrac inventory`, equals
#               nvidia-smi's: names, UUIDs, memory and MIG mode;
#   capability  the node's enforcement is mps-pinned, not driver, with the
#               reason (the driver's per-cgroup limits need r615, CUDA 13.4);
#   mps-daemon  `gpufrac mps-daemon` starts the real nvidia-cuda-mps-control
#               (the legacy interface before r615), restarts it after a
#               SIGKILL and says so in its status file; and stops it cleanly;
#   attach      a process given exactly the environment and mounts that
#               `gpufrac explain` prints for a time-slicing fractional pod is
#               a client of that daemon's server;
#   pinned      ... and cannot allocate past its pinned limit, and can below;
#   overlap     two such clients run the same fixed work at once (in about
#               the time of one); two plain processes (separate contexts)
#               are time-sliced (about twice that);
#   view        nvidia-smi in that environment shows the limit as the total;
#   usage       `gpufrac usage` (the node agent's per-process reading) reports
#               a client holding 3 GiB at about 3 GiB, and SM above 0 for a
#               client whose kernel runs;
#   exclusive   `gpufrac exclusive-process` (the node agent's code) puts the
#               GPU in EXCLUSIVE_PROCESS: with the daemon's server up, a
#               process without the pipe directory cannot create a context,
#               and a second client still can; --restore gives Default back;
# and records, as INFO, whose child an MPS server is and the pipe directory
# in its environment (what the supervisor kills a wedged daemon's servers
# by), what escapes exist in the default compute mode and
# through the control socket (get_server_list, quit), so that the node-side
# hardening is designed on facts.
#
# Exit status: 0 every check passed or was skipped with a reason, 1 a check
# failed, 2 no GPU here (nothing is measured).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${GPU_PROOF_OUT:-${OUT:-$PWD/gpu-proof-out}}
mkdir -p "$out"
work=$(mktemp -d /tmp/gpu-proof.XXXXXX) # packed into details.tar.gz
tools=$(mktemp -d /tmp/gpu-proof-tools.XXXXXX)
: >"$out/results.txt"
failed=0
result() { # check status why
  printf 'RESULT %s: %s %s\n' "$1" "$2" "$3" | tee -a "$out/results.txt"
  [ "$2" = FAIL ] && failed=1
  return 0
}
note() { printf '%s\n' "$*" | tee -a "$out/results.txt"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$work/nvidia-smi-L.txt" 2>&1; then
  echo "gpu-proof: no NVIDIA GPU here (nvidia-smi is missing or fails): nothing to prove" >&2
  rm -rf "$work" "$tools"
  exit 2
fi

# What stays behind on the machine is undone on every way out: the compute
# mode, the mounts, the daemon and its supervisor, the probes.
mounted=()
sup=
cleanup() {
  nvidia-smi -i 0 -c DEFAULT >/dev/null 2>&1
  if [ -n "$sup" ] && kill -0 "$sup" 2>/dev/null; then
    kill -TERM "$sup" 2>/dev/null
    for _ in $(seq 40); do kill -0 "$sup" 2>/dev/null || break; sleep 1; done
    kill -KILL "$sup" 2>/dev/null
  fi
  for m in "${mounted[@]}"; do umount "$m" 2>/dev/null || rm -f "$m"; done
  tar -C "$work" -czf "$out/details.tar.gz" . 2>/dev/null
  rm -rf "$work" "$tools"
}
trap cleanup EXIT

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(uname -a)"
  echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown), carried build from $(cut -c1-7 "$root/build/gpu-proof/commit" 2>/dev/null || echo none)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode,mig.mode.current --format=csv,noheader
  echo "nvidia-smi: $(command -v nvidia-smi); MPS control: $(command -v nvidia-cuda-mps-control || echo none on PATH)"
} >"$work/machine.txt" 2>&1
nvidia-smi >"$work/nvidia-smi.txt" 2>&1
nvidia-smi -q >"$work/nvidia-smi-q.txt" 2>&1
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1 | tr -d ' ')
note "gpu-proof: $(tr '\n' ';' <"$work/machine.txt")"

# What the script runs: carried (make gpu-proof-pack), else built here.
pack=$root/build/gpu-proof
gpufrac=${GPUFRAC:-}
if [ -z "$gpufrac" ]; then
  if [ -f "$pack/gpufrac.gz" ]; then
    gunzip -c "$pack/gpufrac.gz" >"$tools/gpufrac" && chmod +x "$tools/gpufrac" && gpufrac=$tools/gpufrac
  elif [ -x "$root/bin/gpufrac" ]; then
    gpufrac=$root/bin/gpufrac
  elif command -v go >/dev/null 2>&1; then
    (cd "$root" && CGO_ENABLED=1 go build -o "$tools/gpufrac" ./cmd/gpufrac) >"$work/build.log" 2>&1 && gpufrac=$tools/gpufrac
  fi
fi
probe=$pack/probe
if [ ! -x "$probe" ] && command -v cc >/dev/null 2>&1; then
  probe=$tools/probe
  cc -std=c11 -D_POSIX_C_SOURCE=200809L -O2 -o "$probe" "$root/hack/gpu-proof/csrc/probe.c" -ldl >>"$work/build.log" 2>&1
fi
shimdir=$pack/shim
if [ ! -f "$shimdir/libnvidia-ml.so.1" ] && command -v go >/dev/null 2>&1; then
  shimdir=$tools/shim
  (cd "$root" && go run ./shim/cmd/build-shim "$shimdir") >>"$work/build.log" 2>&1
fi
if [ -z "$gpufrac" ] || [ ! -x "$probe" ] || [ ! -f "$shimdir/libnvidia-ml.so.1" ]; then
  result tools FAIL "missing: gpufrac '$gpufrac', probe '$probe', view library '$shimdir' (run make gpu-proof-pack and carry build/gpu-proof)"
  exit 1
fi
"$probe" info >"$work/probe-info.txt" 2>&1
uuid=$(awk '/^device 0 /{print $3; exit}' "$work/probe-info.txt")
total=$(awk '/^device 0 /{print $4; exit}' "$work/probe-info.txt")

# ---- inventory, capability ------------------------------------------------
"$gpufrac" inventory >"$work/inventory.txt" 2>&1
# "GPU 0: NAME (UUID: GPU-…) 81559 MiB[ MIG]" against nvidia-smi -L's "GPU 0: NAME (UUID: GPU-…)",
# and index, UUID, MiB, MIG mode against nvidia-smi's query.
sed -nE 's/^(GPU [0-9]+: .*\)) [0-9]+ MiB( MIG)?$/\1/p' "$work/inventory.txt" >"$work/inventory-as-L.txt"
sed -nE 's/^GPU ([0-9]+): .*\(UUID: ([^)]*)\) ([0-9]+) MiB( MIG)?$/\1,\2,\3,\4/p' "$work/inventory.txt" |
  sed -E 's/, MIG$/,Enabled/; s/,$/,Disabled/' >"$work/inventory-as-query.csv"
nvidia-smi --query-gpu=index,uuid,memory.total,mig.mode.current --format=csv,noheader,nounits |
  tr -d ' ' | sed -E 's/\[N\/A\]$/Disabled/' >"$work/nvidia-smi-query.csv"
if [ -s "$work/inventory-as-L.txt" ] &&
  diff -u "$work/nvidia-smi-L.txt" "$work/inventory-as-L.txt" >"$work/inventory.diff" &&
  diff -u "$work/nvidia-smi-query.csv" "$work/inventory-as-query.csv" >>"$work/inventory.diff"; then
  result inventory PASS "$(wc -l <"$work/inventory-as-L.txt") GPU(s) as nvidia-smi lists them: $(tr '\n' ' ' <"$work/inventory-as-query.csv")"
else
  result inventory FAIL "NVML's inventory differs from nvidia-smi (inventory.diff): $(head -c 400 "$work/inventory.txt" | tr '\n' ' ')"
fi
capability=$(sed -nE '1s/.*enforcement ([a-z-]+)$/\1/p' "$work/inventory.txt")
reason=$(sed -nE 's/^enforcement [a-z-]+: (.*)$/\1/p' "$work/inventory.txt")
major=${driver%%.*}
if [ "$major" -lt 615 ] && [ "$capability" = mps-pinned ] && [ -n "$reason" ]; then
  result capability PASS "driver $driver: mps-pinned, because: $reason"
elif [ "$major" -ge 615 ] && [ "$capability" = driver ]; then
  result capability PASS "driver $driver: driver limits: $reason"
else
  result capability FAIL "driver $driver, enforcement '$capability', reason '$reason'"
fi

# ---- the environment gpufrac gives a time-slicing fractional pod ----------
mpsroot=/tmp/gpufrac-mps # --mps-pipe-dir; short: socket paths are bounded
rm -rf "$mpsroot" # a fresh supervisor: generation 1
mkdir -p "$mpsroot/pipe" "$mpsroot/log"
cat >"$work/pod.yaml" <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: proof
  namespace: team-a
  annotations:
    nvidia.com/container.main.gpus.devices: $uuid
    nvidia.com/container.main.gpu-memory.request: 4Gi
    nvidia.com/container.main.gpu-compute.mode: time-slicing
spec:
  containers: [{name: main, image: cuda}]
EOF
"$gpufrac" explain --memory-limits mps-pinned --mps v2 --mps-pipe-dir "$mpsroot" --nvidia-smi-shim-dir "$shimdir" \
  --simulate-gpus "1xH200@${total}Mi" "$work/pod.yaml" >"$work/explain.txt" 2>&1
envset=()
while IFS= read -r kv; do envset+=("$kv"); done < <(sed -nE 's/^  env set: (.*)$/\1/p' "$work/explain.txt")
# The mounts, made here as the runtime would make them in the container.
while read -r src dst opts; do
  mkdir -p "$dst"
  if mount --bind "$src" "$dst" 2>>"$work/mounts.txt"; then
    case $opts in *ro*) mount -o remount,bind,ro "$dst" 2>>"$work/mounts.txt" ;; esac
    echo "bind $src -> $dst ($opts)" >>"$work/mounts.txt"
  else
    rmdir "$dst" 2>/dev/null
    ln -sfn "$src" "$dst" && echo "symlink $src -> $dst (mount refused)" >>"$work/mounts.txt"
  fi
  mounted+=("$dst")
done < <(sed -nE 's/^  mount: (.*) -> (.*) \(bind, (.*)\)$/\1 \2 \3/p' "$work/explain.txt")
note "gpu-proof: explain says: $(grep -E 'container main|env set|mount' "$work/explain.txt" | sed 's/^ *//' | tr '\n' ';')"
# client: the fractional container; its library path is explain's with the
# host's after it (in a container the NVIDIA runtime puts the driver's
# libraries on the system's path; here they may be on LD_LIBRARY_PATH).
client() {
  local e=() kv
  for kv in "${envset[@]}"; do
    case $kv in LD_LIBRARY_PATH=*) kv="$kv${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;; esac
    e+=("$kv")
  done
  env -i PATH="$PATH" HOME=/root ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH=$LD_LIBRARY_PATH} "${e[@]}" timeout 120 "$@"
}
# outsider: a process on the node without gpufrac's environment (no pipe
# directory: MPS's default, where no daemon listens).
outsider() { env -i PATH="$PATH" HOME=/root ${LD_LIBRARY_PATH:+LD_LIBRARY_PATH=$LD_LIBRARY_PATH} timeout 120 "$@"; }
ctl() { echo "$*" | CUDA_MPS_PIPE_DIRECTORY=$mpsroot/pipe timeout 20 "${mpscontrol:-nvidia-cuda-mps-control}"; }
field() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], ""))' "$mpsroot/daemon.json" "$1" 2>/dev/null; }
until_true() { # seconds command...: poll every 0.2 s
  local end=$((SECONDS + $1)); shift
  until "$@"; do [ $SECONDS -ge $end ] && return 1; sleep 0.2; done
}
running() { [ "$(field running)" = True ]; }
restarted_after() { [ "$(field generation)" -gt "$1" ] 2>/dev/null && running; }
generation_after() { [ "$(field generation)" -gt "$1" ] 2>/dev/null; }
holding() { grep -q '^holding' "$1" 2>/dev/null; }
held_pid() { sed -nE 's/^holding [0-9]+ ms as pid ([0-9]+)$/\1/p' "$1"; }

# ---- view (no daemon needed) ----------------------------------------------
limit=$(printf '%s\n' "${envset[@]}" | sed -n 's/^NVIDIA_GPU_MEMORY_LIMIT=//p')
client nvidia-smi --query-gpu=memory.total,memory.used --format=csv,noheader,nounits -i 0 >"$work/view.txt" 2>&1
client nvidia-smi >"$work/view-nvidia-smi.txt" 2>&1
shown=$(head -1 "$work/view.txt" | cut -d, -f1 | tr -d ' ')
if [ -n "$limit" ] && [ "$shown" = "$limit" ]; then
  result view PASS "nvidia-smi in the pod's environment shows ${shown} MiB total, its ${limit} MiB limit (the GPU has ${total} MiB)"
else
  result view FAIL "nvidia-smi in the pod's environment shows '$(head -1 "$work/view.txt")' with a '${limit}' MiB limit (view.txt)"
fi

# What the real NVML exports that the view library does not forward (each
# is a call nvidia-smi or a tool could make that fails through the view).
realnvml=$(ldconfig -p | awk '/libnvidia-ml.so.1 /{print $NF; exit}')
for d in ${LD_LIBRARY_PATH//:/ }; do [ -z "$realnvml" ] && [ -f "$d/libnvidia-ml.so.1" ] && realnvml=$d/libnvidia-ml.so.1; done
if command -v nm >/dev/null 2>&1 && [ -n "$realnvml" ]; then
  nm -D --defined-only "$realnvml" | awk '$2=="T"{print $3}' | sed 's/@.*//' | sort -u >"$work/nvml-real-symbols.txt"
  nm -D --defined-only "$shimdir/libnvidia-ml.so.1" | awk '$2=="T"{print $3}' | sort -u >"$work/nvml-view-symbols.txt"
  comm -23 "$work/nvml-real-symbols.txt" "$work/nvml-view-symbols.txt" >"$work/nvml-not-forwarded.txt"
  result view-symbols INFO "$realnvml exports $(wc -l <"$work/nvml-real-symbols.txt") functions; the view library lacks $(wc -l <"$work/nvml-not-forwarded.txt"): $(head -20 "$work/nvml-not-forwarded.txt" | tr '\n' ' ')"
else
  result view-symbols INFO "not listed: nm '$(command -v nm)', real NVML '$realnvml'"
fi

# ---- plain processes: two contexts, time-sliced --------------------------
# A fixed amount of work (probe work), not a spin on the clock: an SM's clock
# runs on while another context has the GPU, so two spinning kernels end
# together whether they shared the GPU or took turns (r580: 2000 ms each,
# either way). One alone first, sized to about 1.5 s, as the baseline.
outsider "$probe" work 200000000 >"$work/work-calibrate.txt" 2>&1
cal=$(sed -nE 's/.* took ([0-9]+) ms$/\1/p' "$work/work-calibrate.txt")
iters=$(( 200000000 * 1500 / ${cal:-1500} ))
[ "$iters" -gt 0 ] 2>/dev/null || iters=200000000
outsider "$probe" work "$iters" >"$work/work-alone.txt" 2>&1
alone_ms=$(sed -nE 's/.* took ([0-9]+) ms$/\1/p' "$work/work-alone.txt")
outsider "$probe" work "$iters" >"$work/overlap-plain-1.txt" 2>&1 &
p1=$!
outsider "$probe" work "$iters" >"$work/overlap-plain-2.txt" 2>&1 &
wait $p1 $!
# span: from the first kernel's start to the last one's end, in ms; and
# whether the two kernels' intervals overlapped at all.
span() { cat "$@" | awk '/ start /{s[NR]=$5; e[NR]=$7; if (min=="" || $5<min) min=$5; if ($7>max) max=$7; n++}
  END {if (n != 2) {print "none"; exit}; ov="apart"; for (i in s) for (j in s) if (i<j && s[i]<e[j] && s[j]<e[i]) ov="overlapping"; printf "%d %s\n", (max-min)*1000, ov}'; }
read -r plain_span plain_ov < <(span "$work/overlap-plain-1.txt" "$work/overlap-plain-2.txt")

# ---- mps-daemon: start, SIGKILL, restart -----------------------------------
mpscontrol=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control /usr/bin/nvidia-cuda-mps-control 2>/dev/null | head -1)
"$gpufrac" mps-daemon --mps-pipe-dir "$mpsroot" --mps-control "${mpscontrol:-nvidia-cuda-mps-control}" --driver-version "$driver" --probe-interval 1s >"$work/mps-daemon.log" 2>&1 &
sup=$!
daemon_ok=0
if until_true 30 running; then
  pid1=$(field pid) gen1=$(field generation) proto=$(field protocol)
  comm1=$(ps -o comm= -p "$pid1" 2>/dev/null)
  ctl get_server_list >"$work/ping-1.txt" 2>&1
  ping1=$?
  kill -KILL "$pid1"
  t0=$(date +%s%N)
  if until_true 30 restarted_after "$gen1"; then
    restart_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    pid2=$(field pid)
    cp "$mpsroot/daemon.json" "$work/daemon-after-kill.json"
    if [ "$comm1" = nvidia-cuda-mps ] || [ "$comm1" = nvidia-cuda-mps-control ] && [ $ping1 -eq 0 ] && [ "$pid2" != "$pid1" ]; then
      daemon_ok=1
      result mps-daemon PASS "started $comm1 (pid $pid1, interface $proto, answered get_server_list); after SIGKILL a new one (pid $pid2, generation $(field generation)) in ${restart_ms} ms; status says: $(field lastExit)"
    else
      result mps-daemon FAIL "pid $pid1 is '$comm1', get_server_list exit $ping1, pid after restart $pid2 (mps-daemon.log)"
    fi
  else
    result mps-daemon FAIL "no new daemon within 30 s of SIGKILL: $(cat "$mpsroot/daemon.json" 2>/dev/null)"
  fi
else
  result mps-daemon FAIL "not running within 30 s: $(cat "$mpsroot/daemon.json" 2>/dev/null) $(tail -3 "$work/mps-daemon.log" | tr '\n' ' ')"
fi

if [ $daemon_ok -eq 0 ]; then
  for c in attach pinned overlap usage exclusive; do result $c SKIP "no MPS daemon (mps-daemon failed)"; done
  exit $failed
fi
cp -r "$mpsroot/log" "$work/mps-log-1" 2>/dev/null

# ---- attach, pinned: the fractional pod's process --------------------------
pinned=$(printf '%s\n' "${envset[@]}" | sed -n 's/^CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=\([0-9]*\)M$/\1/p')
below=$((pinned * 3 / 4)) above=$((pinned + pinned / 4))
client "$probe" alloc "$below" 4000 >"$work/pinned-below.txt" 2>&1 &
bg=$!
if until_true 60 holding "$work/pinned-below.txt"; then
  cpid=$(held_pid "$work/pinned-below.txt")
  ctl get_server_list >"$work/servers.txt" 2>&1
  : >"$work/clients.txt"
  for s in $(cat "$work/servers.txt"); do ctl get_client_list "$s" >>"$work/clients.txt" 2>&1; done
  if grep -qx "$cpid" "$work/clients.txt"; then
    result attach PASS "pid $cpid, in the pod's environment, is a client of MPS server $(tr '\n' ' ' <"$work/servers.txt")"
  else
    result attach FAIL "pid $cpid is not among the clients '$(tr '\n' ' ' <"$work/clients.txt")' of servers '$(tr '\n' ' ' <"$work/servers.txt")'"
  fi
  # Whose child a server is, and what pipe directory its environment
  # names: the supervisor kills a wedged daemon's servers by these two
  # marks only (never another stack's), which a GPU must confirm.
  for s in $(cat "$work/servers.txt"); do
    sppid=$(ps -o ppid= -p "$s" 2>/dev/null | tr -d ' ')
    spipe=$(tr '\0' '\n' <"/proc/$s/environ" 2>/dev/null | sed -n 's/^CUDA_MPS_PIPE_DIRECTORY=//p')
    result server-marks INFO "MPS server $s ($(ps -o comm= -p "$s" 2>/dev/null)): parent $sppid (the daemon is $(field pid)); CUDA_MPS_PIPE_DIRECTORY='$spipe' (the daemon's: $mpsroot/pipe)"
  done
else
  result attach FAIL "the client never held its memory: $(tr '\n' ' ' <"$work/pinned-below.txt")"
fi
wait $bg
below_rc=$?
client "$probe" alloc "$above" >"$work/pinned-above.txt" 2>&1
above_rc=$?
if [ $below_rc -eq 0 ] && [ $above_rc -eq 3 ] && grep -q OUT_OF_MEMORY "$work/pinned-above.txt"; then
  result pinned PASS "limit ${pinned}M: ${below} MiB allocated, ${above} MiB refused ($(tr '\n' ' ' <"$work/pinned-above.txt"))"
else
  result pinned FAIL "limit ${pinned}M: ${below} MiB exit $below_rc, ${above} MiB exit $above_rc ($(tr '\n' ' ' <"$work/pinned-above.txt"))"
fi

# ---- overlap: two clients of one server ------------------------------------
client "$probe" work "$iters" >"$work/overlap-mps-1.txt" 2>&1 &
p1=$!
client "$probe" work "$iters" >"$work/overlap-mps-2.txt" 2>&1 &
wait $p1 $! # not a bare wait: the supervisor runs in the background too
read -r mps_span mps_ov < <(span "$work/overlap-mps-1.txt" "$work/overlap-mps-2.txt")
# Two clients of one server run at once: both done in about the time of one.
# Two plain processes take turns: about twice that, however they interleave.
if [ -n "$alone_ms" ] && [ "$mps_span" != none ] && [ "$plain_span" != none ] &&
  [ "$mps_ov" = overlapping ] && [ $((mps_span * 10)) -le $((alone_ms * 13)) ] && [ $((plain_span * 10)) -ge $((alone_ms * 17)) ]; then
  result overlap PASS "the same work ($iters FMAs, ${alone_ms} ms alone): two MPS clients ${mps_span} ms together ($mps_ov), two plain processes ${plain_span} ms ($plain_ov)"
else
  result overlap FAIL "the same work ($iters FMAs, '${alone_ms}' ms alone): two MPS clients ${mps_span} ms ($mps_ov), two plain processes ${plain_span} ms ($plain_ov) (overlap-*.txt)"
fi

# ---- usage: what the node agent measures of a pod's process ---------------
# A client in the pod's environment holds 3 GiB (or 3/4 of its pinned limit,
# if less) while another runs the fixed work: `gpufrac usage` (the agent's
# usage.Sampler: NVML's compute and MPS client lists, process utilisation
# samples) reports the holder with about that memory and the worker with SM
# above 0. Which PID an MPS client's samples name is recorded as INFO.
hold=$(( below < 3072 ? below : 3072 ))
client "$probe" alloc "$hold" 20000 >"$work/usage-hold.txt" 2>&1 &
ubg=$!
if until_true 60 holding "$work/usage-hold.txt"; then
  hpid=$(held_pid "$work/usage-hold.txt")
  client "$probe" work $((iters * 4)) >"$work/usage-work.txt" 2>&1 &
  wbg=$!
  sleep 3
  wpid=$(pgrep -P "$wbg" | head -1)
  "$gpufrac" usage -o json >"$work/usage.json" 2>&1
  "$gpufrac" usage >"$work/usage.txt" 2>&1
  read -r umem usm wsm < <(python3 - "$work/usage.json" "$hpid" "${wpid:-0}" <<'PY'
import json, sys
procs = json.load(open(sys.argv[1])) or []
def of(pid):
    return next((p for p in procs if p["pid"] == int(pid)), None)
h, w = of(sys.argv[2]), of(sys.argv[3])
sm = lambda p: p.get("smPercent", "unknown") if p else "absent"
mem = h.get("memoryBytes") if h else None
print(mem >> 20 if mem is not None else -1, sm(h), sm(w))
PY
)
  note "usage: holder pid $hpid: ${umem} MiB (SM $usm); worker pid ${wpid:-?}: SM $wsm ($(tr '\n' ';' <"$work/usage.txt"))"
  if [ "${umem:--1}" -ge "$hold" ] 2>/dev/null && [ "$umem" -le $((hold + 1024)) ] && [ "${wsm:-0}" != unknown ] && [ "${wsm:-0}" != absent ] && [ "${wsm:-0}" -gt 0 ] 2>/dev/null; then
    result usage PASS "the pod's process holding ${hold} MiB is reported at ${umem} MiB; the one computing at SM ${wsm}%"
  else
    result usage FAIL "want the holder at ${hold}..$((hold + 1024)) MiB and the worker's SM above 0: holder ${umem} MiB, worker SM '${wsm}' (usage.json)"
  fi
  wait "$wbg"
else
  result usage FAIL "the client never held its memory: $(tr '\n' ' ' <"$work/usage-hold.txt")"
fi
kill "$ubg" 2>/dev/null
wait "$ubg" 2>/dev/null

# ---- escapes in the default compute mode (facts) ----------------------------
client "$probe" alloc 1024 4000 >"$work/escape-client.txt" 2>&1 &
bg=$!
until_true 60 holding "$work/escape-client.txt"
outsider "$probe" alloc "$above" >"$work/escape-default.txt" 2>&1
rc=$?
result escape-default INFO "compute mode $(nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader), MPS server up: a process without the pipe directory allocating ${above} MiB (over the pod's ${pinned}M): exit $rc, $(tr '\n' ' ' <"$work/escape-default.txt")"
ls -la "$mpsroot/pipe" >"$work/pipe-ls.txt" 2>&1
sock=$(stat -c '%A %U' "$mpsroot/pipe/control" 2>/dev/null)
echo get_server_list | client "$mpscontrol" >"$work/control-root.txt" 2>&1
rc_root=$?
# Legacy MPS's quit waits for the clients to finish: let the one holding end first.
wait $bg
echo "escape client: exit $?" >>"$work/escape-client.txt"
# As an unprivileged user (a container's uid), through the pod's mount.
asnobody() { command -v setpriv >/dev/null 2>&1 && setpriv --reuid=65534 --regid=65534 --clear-groups "$@"; }
echo get_server_list | asnobody env CUDA_MPS_PIPE_DIRECTORY=/run/nvidia/mps timeout 20 "$mpscontrol" >"$work/control-nobody.txt" 2>&1
rc_nobody=$?
result control-socket INFO "the pod's pipe directory holds control ($sock): get_server_list from the pod's environment as root: exit $rc_root '$(head -c 200 "$work/control-root.txt" | tr '\n' ' ')'; as uid 65534: exit $rc_nobody '$(head -c 200 "$work/control-nobody.txt" | tr '\n' ' ')'"
gen=$(field generation)
echo quit | asnobody env CUDA_MPS_PIPE_DIRECTORY=/run/nvidia/mps timeout 20 "$mpscontrol" >"$work/quit-nobody.txt" 2>&1
rc_qn=$?
who="uid 65534"
if ! until_true 15 generation_after "$gen"; then
  who=root
  echo quit | client "$mpscontrol" >"$work/quit-root.txt" 2>&1
fi
if until_true 30 restarted_after "$gen"; then
  result control-quit INFO "'quit' through the pod's pipe directory as $who (uid 65534: exit $rc_qn '$(head -c 160 "$work/quit-nobody.txt" | tr '\n' ' ')') ended the daemon; the supervisor started generation $(field generation): $(field lastExit)"
else
  result control-quit INFO "'quit' through the pod's pipe directory as uid 65534 (exit $rc_qn) and as root did not end the daemon: $(cat "$mpsroot/daemon.json")"
fi
cp -r "$mpsroot/log" "$work/mps-log-2" 2>/dev/null

# ---- exclusive: the node agent's code sets EXCLUSIVE_PROCESS, and gives Default back
smi_mode() { nvidia-smi -i 0 --query-gpu=compute_mode --format=csv,noheader | tr -d ' '; }
"$gpufrac" exclusive-process --state-dir "$mpsroot" --hold "$uuid" >"$work/exclusive-set.txt" 2>&1
rc_set=$?
mode_set=$(smi_mode)
if [ $rc_set -eq 0 ] && [ "$mode_set" = Exclusive_Process ]; then
  client "$probe" alloc 1024 6000 >"$work/exclusive-client-1.txt" 2>&1 &
  bg=$!
  until_true 60 holding "$work/exclusive-client-1.txt"
  outsider "$probe" alloc 1024 >"$work/exclusive-outsider.txt" 2>&1
  rc_out=$?
  client "$probe" alloc 1024 >"$work/exclusive-client-2.txt" 2>&1
  rc_c2=$?
  wait $bg
  rc_c1=$?
  "$gpufrac" exclusive-process --state-dir "$mpsroot" --restore >"$work/exclusive-restore.txt" 2>&1
  rc_restore=$?
  mode_restored=$(smi_mode)
  if [ $rc_c1 -eq 0 ] && [ $rc_c2 -eq 0 ] && [ $rc_out -ne 0 ] && [ $rc_restore -eq 0 ] && [ "$mode_restored" = Default ]; then
    result exclusive PASS "gpufrac exclusive-process (the agent's code) set $mode_set: two clients of the server allocated; a process without the pipe directory could not ($(tr '\n' ' ' <"$work/exclusive-outsider.txt")); --restore gave back $mode_restored"
  else
    result exclusive FAIL "set $mode_set: client 1 exit $rc_c1, client 2 exit $rc_c2, outsider exit $rc_out ($(tr '\n' ' ' <"$work/exclusive-outsider.txt")); restore exit $rc_restore, mode $mode_restored ($(tr '\n' ' ' <"$work/exclusive-restore.txt"))"
  fi
else
  result exclusive FAIL "gpufrac exclusive-process --hold: exit $rc_set, nvidia-smi says $mode_set: $(tr '\n' ' ' <"$work/exclusive-set.txt")"
fi

# ---- which privilege setting a compute mode needs (facts: the chart drops
# every capability of the agent's container, uid 0)
if command -v setpriv >/dev/null 2>&1; then
  for caps in -all -all,+sys_admin; do
    setpriv --bounding-set="$caps" --inh-caps=-all "$gpufrac" exclusive-process --state-dir "$mpsroot" --hold "$uuid" >"$work/exclusive-caps$caps.txt" 2>&1
    rc=$?
    got=$(smi_mode)
    result exclusive-caps"$caps" INFO "uid 0 with capability bounding set '$caps': exclusive-process --hold exit $rc, mode $got: $(tail -c 300 "$work/exclusive-caps$caps.txt" | tr '\n' ' ')"
    "$gpufrac" exclusive-process --state-dir "$mpsroot" --restore >>"$work/exclusive-caps$caps.txt" 2>&1
    [ "$(smi_mode)" = Default ] || nvidia-smi -i 0 -c DEFAULT >/dev/null 2>&1
  done
fi

# ---- stop: the supervisor quits its daemon and leaves no process ------------
kill -TERM "$sup"
if until_true 40 bash -c "! kill -0 $sup 2>/dev/null"; then
  left=$(pgrep -a -f 'nvidia-cuda-mps-(control|server)' | grep -v pgrep)
  if [ -z "$left" ]; then
    result mps-daemon-stop PASS "SIGTERM: the supervisor quit its daemon; no MPS process left; status: $(field lastExit)"
  else
    result mps-daemon-stop FAIL "left running: $left"
  fi
else
  result mps-daemon-stop FAIL "the supervisor did not stop within 40 s of SIGTERM"
fi
sup=
cp "$mpsroot/daemon.json" "$work/daemon-final.json" 2>/dev/null
cp -r "$mpsroot/log" "$work/mps-log-3" 2>/dev/null
exit $failed
