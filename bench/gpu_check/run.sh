#!/usr/bin/env bash
# The one-call GPU check. Built without a GPU by `make gpu-check-bundle` into
# build-gpu/gpu-check/; copy that folder to any x86-64 machine with an NVIDIA GPU,
# its driver, cuBLAS, cuBLASLt and NCCL, and run
#   gpu-check/run.sh OUTDIR
# In about 4 minutes (at most ~8: every step has a timeout inside a total budget of
# SPES_CHECK_BUDGET_S = 460 s) it
#   0. records the device, driver and the CUDA libraries it found;
#   1. runs every CUDA test file and every GPU bench;
#   2. trains configs/tiny-central.toml for 300 steps on the GPU and on the CPU (the CPU
#      run starts first and goes on beside step 1), and compares the loss curves;
#   3. runs a mixed SPES run: coordinator + 4 nodes of configs/tiny.toml, node 0 on
#      the GPU, nodes 1-3 on the CPU, and checks every round's state hash agrees;
#   4. reruns the CUDA test files under compute-sanitizer (memcheck on every file, then
#      racecheck on the kernel files; failed files first) when the machine has it, as
#      long as time is left, after checking that memcheck sees a planted write past
#      an arena buffer (which step 1 checks the arena's own guards catch);
#   5. runs the CPU benches,
# then writes OUTDIR/report.md (summary table first) and OUTDIR/logs.tar.gz (every
# raw log). A failing step is recorded and the script goes on; it exits 0 once the
# report is written. Nothing is installed; scratch files go to a temp folder.
set -uo pipefail

OUTDIR=${1:?usage: run.sh OUTDIR}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/spes-gpu-check.XXXXXX")
L="$WORK/logs"
mkdir -p "$L"/{env,tests,guard,bench,train,spes,sanitize}
BIN="$WORK/bin"
CFG="$HERE/configs"
DATA="$HERE/data/tinyshakespeare"
T0=$(date +%s)
BUDGET=${SPES_CHECK_BUDGET_S:-460}
TRAIN_STEPS=${SPES_CHECK_TRAIN_STEPS:-300}
SPES_STEPS=${SPES_CHECK_SPES_STEPS:-100}
# "cpu" rehearses steps 2-3 on a machine without a GPU (the "GPU" runs then use the CPU).
GPU_DEVICE=${SPES_CHECK_GPU_DEVICE:-cuda}
NPROC=$(nproc 2>/dev/null || echo 2)
# Benches that need no GPU run last (or not at all when time is out).
CPU_BENCHES=" bench_sync bench_train_cpu bench_tokenizer "
echo "$CPU_BENCHES" > "$L/cpu_benches"  # report.py splits the benches the same way
# Arguments for benches whose defaults point into the source tree (absent here).
declare -A BENCH_ARGS=([bench_train_cpu]="$CFG/tiny.toml" [bench_sync]="--rounds 2"
  [bench_train_gpu]="--steps 4 --micro-batches 8")
# Seconds a GPU bench may take (100 unless named): bench_train_gpu times three backends.
declare -A BENCH_CAP=([bench_train_gpu]=160)

now() { date +%s; }
elapsed() { echo $(($(now) - T0)); }
say() { echo "[gpu-check $(printf '%3d' "$(elapsed)")s] $*" | tee -a "$L/run.log" >&2; }
# Phase deadline: a fraction of the budget after the start.
deadline() { awk -v t0="$T0" -v b="$BUDGET" -v f="$1" 'BEGIN{printf "%d", t0 + b * f}'; }
# A step's timeout: its own cap, cut to what is left before the phase deadline.
cap() {
  local want=$1 left=$(($2 - $(now)))
  ((left < want)) && want=$left
  echo "$want"
}
STDBUF=()
command -v stdbuf >/dev/null && STDBUF=(stdbuf -oL -eL)  # keep output up to a crash

declare -A PID START
# bg_start LOG TIMEOUT CMD...: CMD in the background under `timeout`, stdout to
# LOG.out, stderr to LOG.err; a step left too little time is recorded as skipped.
bg_start() {
  local base=$1 t=$2
  shift 2
  printf '%q ' "$@" > "$base.cmd"
  if ((t < 5)); then
    echo "out of time (the check's budget of ${BUDGET}s is used up)" > "$base.skipped"
    PID[$base]=""
    return 1
  fi
  echo "$t" > "$base.timeout"
  START[$base]=$(now)
  timeout -k 5 "$t" "$@" > "$base.out" 2> "$base.err" &
  PID[$base]=$!
}
# bg_wait LOG: waits, writes LOG.rc = "exit-status seconds", returns the status.
bg_wait() {
  local base=$1 rc
  [[ -z ${PID[$base]} ]] && return 0
  wait "${PID[$base]}"
  rc=$?
  echo "$rc $(($(now) - START[$base]))" > "$base.rc"
  PID[$base]=""
  return $rc
}
running() { [[ -n ${PID[$1]} ]] && kill -0 "${PID[$1]}" 2>/dev/null; }
# stop LOG WHY: ends a background step early (timeout forwards the signal).
stop() {
  running "$1" || return 0
  echo "$2" > "$1.stopped"
  kill -TERM "${PID[$1]}" 2>/dev/null
  bg_wait "$1"
}
run_step() { bg_start "$@" && bg_wait "$1"; }
rc_of() { [[ -f $1.rc ]] && cut -d' ' -f1 "$1.rc" || echo none; }
quote() { printf '"%s"' "$1"; }  # a TOML string for --set

# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() { [[ ${SPES_CHECK_KEEP:-0} == 1 ]] || rm -rf "$WORK"; }
trap cleanup EXIT

say "spes-engine GPU check: bundle $HERE, output $OUTDIR, work $WORK, budget ${BUDGET}s"
cp "$HERE/BUNDLE_INFO" "$L/" 2>/dev/null
say "$(sed -n 's/^commit: /commit /p' "$HERE/BUNDLE_INFO")"

# ---- 0. binaries, host, device, libraries --------------------------------------------
if ! tar -xzf "$HERE/bin.tar.gz" -C "$WORK" 2> "$L/env/unpack.err"; then
  say "cannot unpack bin.tar.gz: $(tail -1 "$L/env/unpack.err")"
fi
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -n) $(uname -srm)"
  echo "cpu: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1) ($NPROC cores)"
  echo "memory: $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
  echo "glibc: $(ldd --version 2>/dev/null | head -1)"
  echo "python3: $(python3 --version 2>&1)"
} > "$L/env/host.txt"
if command -v nvidia-smi >/dev/null; then
  timeout 30 nvidia-smi > "$L/env/nvidia-smi.txt" 2>&1
  timeout 30 nvidia-smi --query-gpu=index,name,memory.total,driver_version,compute_cap,clocks.max.sm,power.limit,pci.bus_id \
    --format=csv > "$L/env/gpus.csv" 2>&1
  say "device: $(sed -n 2p "$L/env/gpus.csv")"
else
  echo "nvidia-smi not found" > "$L/env/nvidia-smi.txt"
  say "device: nvidia-smi not found (no NVIDIA driver?)"
fi

# cuBLAS, cuBLASLt and NCCL are not in the bundle: find the machine's, first where
# the loader already looks, then in the CUDA folders, then in pip's nvidia/*/lib.
lib_dirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64
  /usr/lib/x86_64-linux-gnu /usr/lib64 /lib/x86_64-linux-gnu)
if command -v python3 >/dev/null; then
  while IFS= read -r d; do lib_dirs+=("$d"/nvidia/*/lib); done < <(python3 -c \
    'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
fi
extra=""
: > "$L/env/libs.txt"
while IFS= read -r soname; do
  [[ -z $soname ]] && continue
  found=$(ldconfig -p 2>/dev/null | awk -v s="$soname" '$1 == s {print $NF; exit}')
  if [[ -z $found ]]; then
    for d in "${lib_dirs[@]}"; do
      if [[ -e $d/$soname ]]; then
        found=$d/$soname
        [[ :$extra: == *":$d:"* ]] || extra="${extra:+$extra:}$d"
        break
      fi
    done
  fi
  echo "$soname => ${found:-NOT FOUND}$([[ -n $found ]] && echo " ($(readlink -f "$found"))")" >> "$L/env/libs.txt"
done < "$HERE/needed-libs.txt"
[[ -n $extra ]] && export LD_LIBRARY_PATH="$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >> "$L/env/libs.txt"
for b in "$BIN"/*; do
  echo "== $(basename "$b")"
  ldd "$b" 2>&1
done > "$L/env/ldd.txt"
if grep -q 'not found' "$L/env/ldd.txt"; then
  say "missing libraries: $(grep 'not found' "$L/env/ldd.txt" | awk '{print $1}' | sort -u | paste -sd' ' -)"
else
  say "libraries: $(grep -c '=>' "$L/env/libs.txt") found$([[ -n $extra ]] && echo " (LD_LIBRARY_PATH += $extra)")"
fi

# ---- 2 (started now). tiny-central on the CPU -------------------------------------------
# The CPU reference of step 2 takes minutes (bench/RESULTS.md: 300 steps did not fit in
# 240 s on 8 cores of the H200 machine's Xeon), so it runs from here, beside the tests
# and benches, which need the GPU far more than the CPU; step 2 compares the curves. It
# takes at most half the cores, so the benches' host threads (launches, MoE host
# waits) keep theirs.
data_sets=(--set "data.train=$(quote "$DATA/train.manifest")" --set "data.validation=$(quote "$DATA/val.manifest")")
cpu_threads=$((NPROC / 2 < 8 ? NPROC / 2 : 8))
((cpu_threads < 1)) && cpu_threads=1
say "training tiny-central for $TRAIN_STEPS steps on the CPU (threads: $cpu_threads) in the background"
bg_start "$L/train/cpu" "$(cap 480 "$(deadline 0.85)")" "$BIN/spes-engine" train "$CFG/tiny-central.toml" \
  "${data_sets[@]}" --set train.steps="$TRAIN_STEPS" --set 'train.device="cpu"' --set train.threads="$cpu_threads" \
  --set "checkpoint.dir=$(quote "$WORK/central-cpu")"

# ---- 1a. CUDA tests: one process per test file ----------------------------------------
D=$(deadline 0.35)
while IFS= read -r name; do
  [[ -z $name ]] && continue
  base="$L/tests/$name"
  timeout 30 "$BIN/spes_tests" --source-file="*$name.cu" --list-test-cases --no-skip -r=xml \
    > "$base.list.xml" 2> "$base.list.err"
  run_step "$base" "$(cap 60 "$D")" "${STDBUF[@]}" "$BIN/spes_tests" --gpu-file --source-file="*$name.cu" -r=xml
  rc=$(rc_of "$base")
  case $rc in
    0) say "test $name: passed" ;;
    77) say "test $name: $(grep -m1 SKIPPED "$base.out")" ;;
    none) say "test $name: not run: $(cat "$base.skipped" 2>/dev/null)" ;;
    124 | 137) say "test $name: TIMED OUT after $(cat "$base.timeout")s" ;;
    *) say "test $name: FAILED (exit $rc)" ;;
  esac
done < "$HERE/cuda-tests.txt"

# The arena's guards on real hardware: a planted kernel write one float past an arena
# buffer (a test case skipped unless asked for) must be caught by check_guards.
run_step "$L/guard/plain" "$(cap 30 "$D")" "$BIN/spes_tests" --gpu-file --source-file='*test_cuda_core.cu' \
  --no-skip --test-case='*planted*'
say "arena guard catches a planted kernel overrun: exit $(rc_of "$L/guard/plain") (0: caught)"

# ---- 1b. GPU benches ------------------------------------------------------------------
D=$(deadline 0.60)
for b in "$BIN"/bench_*; do
  name=$(basename "$b")
  [[ $CPU_BENCHES == *" $name "* ]] && continue
  # shellcheck disable=SC2086  # BENCH_ARGS are words
  run_step "$L/bench/$name" "$(cap "${BENCH_CAP[$name]:-100}" "$D")" "${STDBUF[@]}" "$b" ${BENCH_ARGS[$name]:-}
  rc=$(rc_of "$L/bench/$name")
  if [[ $rc == 0 ]] && grep -q '^no GPU' "$L/bench/$name.out"; then
    say "bench $name: $(grep -m1 '^no GPU' "$L/bench/$name.out")"
  else
    say "bench $name: exit $rc"
  fi
done

# ---- 2. tiny-central on the GPU, compared with the CPU run started above -----------------
D=$(deadline 0.85)
echo "$GPU_DEVICE" > "$L/env/gpu_device"
say "training tiny-central for $TRAIN_STEPS steps on device $GPU_DEVICE (the CPU run has been going since the start)"
bg_start "$L/train/gpu" "$(cap 240 "$D")" "$BIN/spes-engine" train "$CFG/tiny-central.toml" "${data_sets[@]}" \
  --set train.steps="$TRAIN_STEPS" --set "train.device=$(quote "$GPU_DEVICE")" --set train.threads=2 \
  --set "checkpoint.dir=$(quote "$WORK/central-gpu")"
while running "$L/train/gpu" || running "$L/train/cpu"; do
  if [[ -n ${PID[$L/train/gpu]} ]] && ! running "$L/train/gpu"; then
    # Without a GPU result the CPU curve compares with nothing: stop it.
    bg_wait "$L/train/gpu" || stop "$L/train/cpu" "stopped: the GPU run failed"
  fi
  sleep 1
done
bg_wait "$L/train/gpu"
bg_wait "$L/train/cpu"
say "train GPU: exit $(rc_of "$L/train/gpu") $(grep -v '^\s*$' "$L/train/gpu.err" 2>/dev/null | tail -1)"
say "train CPU: exit $(rc_of "$L/train/cpu")$([[ -f $L/train/cpu.stopped ]] && echo " ($(cat "$L/train/cpu.stopped"))")"

# ---- 3. mixed SPES run: coordinator + node 0 on the GPU + nodes 1-3 on the CPU ------------
D=$(deadline 0.88)
port=$(python3 -c '
import random, socket
for _ in range(100):
    p = random.randint(20000, 29999)  # below the ephemeral range: no client socket holds it
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); print(p); break
    except OSError: pass
    finally: s.close()' 2>/dev/null || echo $((20000 + RANDOM % 10000)))
node_threads=$(((NPROC - 2) / 3))
((node_threads < 1)) && node_threads=1
spes_sets=("${data_sets[@]}" --set train.steps="$SPES_STEPS" --set "spes.coordinator=$(quote "127.0.0.1:$port")"
  --set "spes.state_dir=$(quote "$WORK/spes/coordinator")" --set "checkpoint.dir=$(quote "$WORK/spes/checkpoints")")
say "SPES run: coordinator on port $port, node 0 on device $GPU_DEVICE, nodes 1-3 on the CPU (threads: $node_threads each), $SPES_STEPS steps"
t=$(cap 120 "$D")
procs=("$L/spes/coordinator")
if bg_start "$L/spes/coordinator" "$t" "$BIN/spes-engine" coordinator "$CFG/tiny.toml" "${spes_sets[@]}" --fresh; then
  for n in 0 1 2 3; do
    if ((n == 0)); then dev=(--set "train.device=$(quote "$GPU_DEVICE")" --set train.threads=2)
    else dev=(--set 'train.device="cpu"' --set train.threads="$node_threads"); fi
    bg_start "$L/spes/node$n" "$t" "$BIN/spes-engine" train "$CFG/tiny.toml" --node-id "$n" "${spes_sets[@]}" "${dev[@]}"
    procs+=("$L/spes/node$n")
  done
  # Like `spes-engine local`: one process failing stops the others; when every node
  # is done the coordinator is stopped (it serves until told otherwise).
  while :; do
    failed="" nodes_left=0
    for p in "${procs[@]}"; do
      if [[ -n ${PID[$p]} ]] && ! running "$p"; then
        # A node may finish; the coordinator ending on its own is a failure.
        bg_wait "$p" && [[ $p != */coordinator ]] || failed=$p
      fi
      [[ $p != */coordinator ]] && running "$p" && nodes_left=$((nodes_left + 1))
    done
    if [[ -n $failed ]]; then
      for p in "${procs[@]}"; do stop "$p" "stopped: $(basename "$failed") failed"; done
      break
    fi
    if ((nodes_left == 0)); then
      stop "$L/spes/coordinator" "stopped after every node finished"
      break
    fi
    sleep 1
  done
  for p in "${procs[@]}"; do bg_wait "$p"; done
fi
for p in "${procs[@]}"; do
  say "SPES $(basename "$p"): exit $(rc_of "$p")$([[ -f $p.stopped ]] && echo " ($(cat "$p.stopped"))")"
done

# ---- 4. compute-sanitizer over the CUDA test files -------------------------------------
# Kernels that never ran before can read or write out of bounds, or race in shared
# memory, and still pass a test by luck; a failed test says what, the sanitizer where
# (kernel, file:line: the binaries carry -lineinfo). Failed files go first; the
# whole-step file runs without its long cases (300 steps, resume), which the
# sanitizer would slow past any cap.
D=$(deadline 0.97)
SANITIZER=""
for c in "$(command -v compute-sanitizer 2>/dev/null)" /usr/local/cuda/bin/compute-sanitizer \
  /usr/local/cuda/compute-sanitizer/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
  /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
  [[ -n $c && -x $c ]] && SANITIZER=$c && break
done
echo "${SANITIZER:-not found}" > "$L/sanitize/tool"
if [[ -z $SANITIZER ]]; then
  say "compute-sanitizer: not found on this machine (skipped)"
else
  failed_first=()
  while IFS= read -r name; do
    [[ -z $name ]] && continue
    case $(rc_of "$L/tests/$name") in
      0) failed_first+=("$name") ;;
      77) ;;  # skipped (no GPU): the sanitizer would skip it too
      *) failed_first=("$name" "${failed_first[@]}") ;;
    esac
  done < "$HERE/cuda-tests.txt"
  # The same planted write under memcheck: it must be reported (exit 86). Inside the
  # arena's one cudaMalloc memcheck sees it only through the NVTX regions the arena
  # registers; if it stays silent here, a clean memcheck of the whole step below says
  # nothing about writes from one arena buffer into the next.
  base="$L/guard/memcheck"
  if [[ $(rc_of "$L/guard/plain") == 77 ]]; then
    echo "no GPU" > "$base.skipped"
  else
    run_step "$base" "$(cap 60 "$D")" "$SANITIZER" --tool memcheck --nvtx yes --error-exitcode 86 --print-limit 5 \
      --log-file "$base.log" "$BIN/spes_tests" --gpu-file --source-file='*test_cuda_core.cu' --no-skip \
      --test-case='*planted*'
  fi
  say "memcheck sees the planted arena overrun: exit $(rc_of "$base") (86: seen) $(grep -m1 -o 'Invalid __global__ [a-z]* of size [0-9]* bytes' "$base.log" 2>/dev/null)"
  for tool in memcheck racecheck; do
    for name in "${failed_first[@]}"; do
      # racecheck looks for shared-memory hazards, so it runs the kernel files only:
      # the whole-step files run the same kernels through cuBLAS-heavy steps that
      # racecheck slows past any cap (test_gpu_step: bench/RESULTS.md), and
      # test_cuda_matmul is cuBLAS alone.
      [[ $tool == racecheck && $name =~ ^(test_gpu_step|test_gpu_data_parallel|test_cuda_matmul)$ ]] && continue
      base="$L/sanitize/$name.$tool"
      exclude=()
      # Long cases out; so are the three that touch guards through the runtime API on
      # purpose (memcheck may report those copies as the accesses they are).
      [[ $name == test_gpu_step ]] && exclude=(--test-case-exclude='*300 steps*,*resume*,*never leave*')
      [[ $name == test_cuda_core ]] && exclude=(--test-case-exclude='*one byte past*,*arena buffers aligned*')
      run_step "$base" "$(cap 60 "$D")" "$SANITIZER" --tool "$tool" --nvtx yes --error-exitcode 86 --print-limit 20 \
        --log-file "$base.log" "$BIN/spes_tests" --gpu-file --source-file="*$name.cu" "${exclude[@]}"
      case $(rc_of "$base") in
        0) say "$tool $name: clean" ;;
        86) say "$tool $name: ERRORS: $(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$base.log" 2>/dev/null)" ;;
        none) say "$tool $name: not run: $(cat "$base.skipped" 2>/dev/null)" ;;
        124 | 137) say "$tool $name: timed out after $(cat "$base.timeout")s" ;;
        *) say "$tool $name: exit $(rc_of "$base") (the tests themselves failed under the sanitizer)" ;;
      esac
    done
  done
fi

# ---- 5. CPU benches ---------------------------------------------------------------------
D=$(deadline 1.0)
for b in "$BIN"/bench_*; do
  name=$(basename "$b")
  [[ $CPU_BENCHES == *" $name "* ]] || continue
  # shellcheck disable=SC2086
  run_step "$L/bench/$name" "$(cap 120 "$D")" "${STDBUF[@]}" "$b" ${BENCH_ARGS[$name]:-}
  say "bench $name: exit $(rc_of "$L/bench/$name")"
done

# ---- report ---------------------------------------------------------------------------
elapsed > "$L/elapsed_s"
if command -v python3 >/dev/null && python3 "$HERE/report.py" "$L" "$OUTDIR/report.md"; then
  :
else
  say "report.py failed or python3 missing: writing a bare report"
  {
    echo "# spes-engine GPU check (bare report: report.py did not run)"
    echo
    echo '```'
    cat "$L/run.log"
    echo '```'
  } > "$OUTDIR/report.md"
fi
tar -C "$WORK" -czf "$OUTDIR/logs.tar.gz" logs
say "done: $OUTDIR/report.md, $OUTDIR/logs.tar.gz"
exit 0
