#!/usr/bin/env bash
# The one-call GPU check. Built without a GPU by `make gpu-check-bundle` into
# build-gpu/gpu-check/; copy that folder to any x86-64 machine with an NVIDIA GPU,
# its driver, cuBLAS, cuBLASLt and NCCL, and run
#   gpu-check/run.sh [--quick] OUTDIR    quick mode, the default: at most ~5 minutes
#   gpu-check/run.sh --full OUTDIR       full mode: at most ~8 minutes
# Every step has a timeout inside a total budget (SPES_CHECK_BUDGET_S: 300 s quick,
# 480 s full); a step left without time is recorded as skipped for time.
#
# Quick mode:
#   0. records the device, driver and the CUDA libraries it found; checks that the
#      arena's guard catches a planted kernel write past a buffer (step 4a);
#   1a. runs every CUDA test file, test_gpu_step without its 300-step case;
#   1b. runs the GPU benches, each capped: bench_train_gpu (3 steps of 8
#       micro-batches; again with SPES_ATTENTION=portable where the sm90a
#       attention's start-up check failed to run), then bench/torch_anchors.py
#       (PyTorch on the same GPU, eager; skipped with the reason where python3,
#       torch or a GPU is missing), bench_grouped_gemm, bench_attention, then
#       1d. the step's heaviest kernels profiled with Nsight Compute (ncu) where the
#       machine has it: counters and stall reasons, no timings (skipped otherwise),
#       then bench_core, bench_gemm.
# Full mode runs the same and adds, in two phases:
#   correctness (nothing in it is timed), three lanes side by side on the GPU:
#     - the CUDA test files, test_gpu_step whole (its 300-step case too);
#     - compute-sanitizer over the test files when the machine has it: memcheck on
#       every file (after checking it reports the planted arena overrun), then
#       racecheck on the kernel files, as long as the phase has time;
#     - 2. tiny-central for 300 steps on the GPU, compared with the same run on the
#       CPU, which goes on from the start beside the lanes; then 3. a mixed SPES run:
#       coordinator + 4 nodes of tiny.toml, node 0 on the GPU, nodes 1-3 on the CPU,
#       every round's state hash checked;
#   timing, the GPU alone: the benches of quick mode, torch.compile in the anchors,
#     and bench_train_gpu again with SPES_GROUPED_GEMM=portable (the grouped expert
#     GEMMs on the portable kernels), the profile (1d) after bench_attention; then
#     5. the CPU benches with the time left.
# Then it writes OUTDIR/report.md (summary table first; the mode, and what was skipped
# for time) and OUTDIR/logs.tar.gz (every raw log). A failing step is recorded and the
# script goes on; it exits 0 once the report is written. Nothing is installed;
# scratch files go to a temp folder.
set -uo pipefail

usage() {
  echo "usage: run.sh [--quick|--full] OUTDIR" >&2
  exit 2
}
MODE=quick
case ${1:-} in
  --full) MODE=full && shift ;;
  --quick) shift ;;
  -h | --help | -*) usage ;;
esac
(($# == 1)) || usage
OUTDIR=$1
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/spes-gpu-check.XXXXXX")
L="$WORK/logs"
mkdir -p "$L"/{env,tests,guard,bench,torch,train,spes,sanitize}
BIN="$WORK/bin"
CFG="$HERE/configs"
DATA="$HERE/data/tinyshakespeare"
export SPES_HF_FIXTURES="$HERE/hf"  # test_gpu_import's fixtures (bundle.sh)
T0=$(date +%s)
declare -A DEFAULT_BUDGET=([quick]=300 [full]=480)
BUDGET=${SPES_CHECK_BUDGET_S:-${DEFAULT_BUDGET[$MODE]}}
TRAIN_STEPS=${SPES_CHECK_TRAIN_STEPS:-300}
SPES_STEPS=${SPES_CHECK_SPES_STEPS:-100}
# "cpu" rehearses steps 2-3 on a machine without a GPU (the "GPU" runs then use the CPU).
GPU_DEVICE=${SPES_CHECK_GPU_DEVICE:-cuda}
# 0 leaves the CPU benches out of full mode (the rehearsal test does).
CPU_BENCHES_ON=${SPES_CHECK_CPU_BENCHES:-1}
NPROC=$(nproc 2>/dev/null || echo 2)
FULL_ONLY="full mode only (run.sh --full)"
# The GPU benches in the order they run (others the bundle has follow); the CPU
# benches need no GPU and run last, in full mode only.
GPU_BENCHES=(bench_train_gpu bench_grouped_gemm bench_attention bench_core bench_gemm)
CPU_BENCHES=" bench_sync bench_train_cpu bench_tokenizer "
echo "$CPU_BENCHES" > "$L/cpu_benches"  # report.py splits the benches the same way
# Arguments for benches whose defaults point into the source tree (absent here).
declare -A BENCH_ARGS=([bench_train_cpu]="$CFG/tiny.toml" [bench_sync]="--rounds 2"
  [bench_train_gpu]="--steps 3 --micro-batches 8")
# Seconds a bench may take (40 unless named). Measured on an H200: bench_train_gpu
# ≈ 30-45 s per grouped-GEMM path, bench_grouped_gemm ≈ 30 s.
declare -A BENCH_CAP=([bench_train_gpu]=75 [bench_grouped_gemm]=60 [bench_attention]=70
  [bench_sync]=60 [bench_train_cpu]=90 [bench_tokenizer]=60)
# The PyTorch anchors: eager ≈ 40 s, torch.compile ≈ 80 s more (full mode only).
declare -A ANCHORS_CAP=([quick]=75 [full]=180)
COMPILE_BUDGET_S=100

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
  [[ -z ${PID[$base]:-} ]] && return 0
  wait "${PID[$base]}"
  rc=$?
  echo "$rc $(($(now) - START[$base]))" > "$base.rc"
  PID[$base]=""
  return $rc
}
running() { [[ -n ${PID[$1]:-} ]] && kill -0 "${PID[$1]}" 2>/dev/null; }
# stop LOG WHY: ends a background step early (timeout forwards the signal).
stop() {
  running "$1" || return 0
  echo "$2" > "$1.stopped"
  kill -TERM "${PID[$1]}" 2>/dev/null
  bg_wait "$1"
}
run_step() { bg_start "$@" && bg_wait "$1"; }
# skip_step LOG WHY: a step this mode does not run, recorded as skipped.
skip_step() {
  echo "(not run)" > "$1.cmd"
  echo "$2" > "$1.skipped"
}
rc_of() { [[ -f $1.rc ]] && cut -d' ' -f1 "$1.rc" || echo none; }
quote() { printf '"%s"' "$1"; }  # a TOML string for --set
# say_exit WHAT LOG: one line on how a step ended.
say_exit() {
  local rc
  rc=$(rc_of "$2")
  case $rc in
    0) say "$1: exit 0" ;;
    none) say "$1: not run: $(cat "$2.skipped" 2>/dev/null)" ;;
    124 | 137) say "$1: TIMED OUT after $(cat "$2.timeout")s" ;;
    *) say "$1: exit $rc" ;;
  esac
}

# shellcheck disable=SC2317  # called by the EXIT trap
cleanup() { [[ ${SPES_CHECK_KEEP:-0} == 1 ]] || rm -rf "$WORK"; }
trap cleanup EXIT

# ---- 0. binaries, host, device, libraries --------------------------------------------
unpack_and_probe() {
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
}

# The environment Python runs in: LD_LIBRARY_PATH as the caller had it (find_libraries
# extends it for our binaries).
if [[ -v LD_LIBRARY_PATH ]]; then PY_ENV=(env LD_LIBRARY_PATH="$LD_LIBRARY_PATH"); else PY_ENV=(env -u LD_LIBRARY_PATH); fi

# cuBLAS, cuBLASLt and NCCL are not in the bundle: find the machine's, first where
# the loader already looks, then in the CUDA folders, then in pip's nvidia/*/lib.
find_libraries() {
  local lib_dirs=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64
    /usr/lib/x86_64-linux-gnu /usr/lib64 /lib/x86_64-linux-gnu)
  local d soname found extra="" b
  if command -v python3 >/dev/null; then
    while IFS= read -r d; do lib_dirs+=("$d"/nvidia/*/lib); done < <(python3 -c \
      'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null)
  fi
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
}

# The arena's guards on real hardware: a planted kernel write one float past an arena
# buffer (a test case skipped unless asked for) must be caught by check_guards. Its
# exit status also says whether the machine has a GPU (77: none).
guard_check() {
  run_step "$L/guard/plain" 30 "$BIN/spes_tests" --gpu-file --source-file='*test_cuda_core.cu' \
    --no-skip --test-case='*planted*'
  say "arena guard catches a planted kernel overrun: exit $(rc_of "$L/guard/plain") (0: caught)"
}
have_gpu() { [[ $(rc_of "$L/guard/plain") != 77 ]]; }

# ---- 1a. CUDA tests: one process per test file ----------------------------------------
# run_tests DEADLINE: quick mode leaves test_gpu_step's 300-step case out (≈ 45 s).
run_tests() {
  local D=$1 name base rc filter t
  while IFS= read -r name; do
    [[ -z $name ]] && continue
    base="$L/tests/$name"
    filter=() t=45
    if [[ $name == test_gpu_step ]]; then
      if [[ $MODE == quick ]]; then
        filter=(--test-case-exclude='*300 steps*')
        echo "without its 300-step case (quick mode)" > "$base.note"
      else
        t=120
      fi
    fi
    timeout 30 "$BIN/spes_tests" --source-file="*$name.cu" "${filter[@]}" --list-test-cases --no-skip -r=xml \
      > "$base.list.xml" 2> "$base.list.err"
    run_step "$base" "$(cap "$t" "$D")" "${STDBUF[@]}" "$BIN/spes_tests" --gpu-file --source-file="*$name.cu" \
      "${filter[@]}" -r=xml
    rc=$(rc_of "$base")
    case $rc in
      0) say "test $name: passed" ;;
      77) say "test $name: $(grep -m1 SKIPPED "$base.out")" ;;
      none) say "test $name: not run: $(cat "$base.skipped" 2>/dev/null)" ;;
      124 | 137) say "test $name: TIMED OUT after $(cat "$base.timeout")s" ;;
      *) say "test $name: FAILED (exit $rc)" ;;
    esac
  done < "$HERE/cuda-tests.txt"
}

# ---- 1b. GPU benches, the PyTorch anchors -------------------------------------------------
# run_bench NAME LOG DEADLINE [ENV=VALUE...]: one GPU bench under its cap.
run_bench() {
  local name=$1 base=$2 D=$3
  shift 3
  # shellcheck disable=SC2086  # BENCH_ARGS are words
  run_step "$base" "$(cap "${BENCH_CAP[$name]:-40}" "$D")" env "$@" "${STDBUF[@]}" "$BIN/$name" ${BENCH_ARGS[$name]:-}
  if [[ $(rc_of "$base") == 0 ]] && grep -q '^no GPU' "$base.out"; then
    say "bench $(basename "$base"): $(grep -m1 '^no GPU' "$base.out")"
  elif [[ $(rc_of "$base") == 77 ]]; then  # bench_grouped_gemm: 77 and the reason on stderr
    say "bench $(basename "$base"): skipped: $(grep -v '^\s*$' "$base.err" | tail -1)"
  else
    say_exit "bench $(basename "$base")" "$base"
  fi
}

# run_anchors DEADLINE: bench/torch_anchors.py right after bench_train_gpu, with its
# training FLOPs per token (for the model rows' TFLOP/s); torch.compile in full mode.
# Skipped, with the reason, where python3 or torch is missing; without transformers
# it leaves the model out. Python runs with the caller's LD_LIBRARY_PATH (PY_ENV):
# torch brings its own cuBLAS.
run_anchors() {
  local D=$1 base="$L/torch/anchors" why="" probe="" gflop args=(--runs 5)
  if ! command -v python3 >/dev/null; then
    why="python3 not found"
  elif ! probe=$(timeout 90 "${PY_ENV[@]}" python3 -c \
    'import importlib.util as u, torch; print(u.find_spec("transformers") is not None)' 2>&1); then
    why="no PyTorch for $(command -v python3): $(tail -1 <<< "$probe")"
  fi
  if [[ -n $why ]]; then
    skip_step "$base" "$why"
    say "PyTorch anchors: skipped: $why"
    return
  fi
  if [[ $(tail -1 <<< "$probe") != True ]]; then
    args+=(--skip-model)
    echo "transformers not importable: the OlmoeForCausalLM step was not timed" > "$base.note"
  fi
  gflop=$(sed -n 's/^MFU: .*(\([0-9.]*\) GFLOP\/token training.*/\1/p' "$L/bench/bench_train_gpu.out" 2>/dev/null | head -1)
  [[ -n $gflop ]] && args+=(--train-flops-per-token "$(awk -v g="$gflop" 'BEGIN{printf "%.0f", g * 1e9}')")
  [[ $MODE == full ]] && args+=(--compile-budget-s "$COMPILE_BUDGET_S")
  # torch.compile's caches go to the work folder, like every scratch file.
  run_step "$base" "$(cap "${ANCHORS_CAP[$MODE]}" "$D")" "${PY_ENV[@]}" TORCHINDUCTOR_CACHE_DIR="$WORK/torchinductor" \
    TRITON_CACHE_DIR="$WORK/triton" "${STDBUF[@]}" python3 "$HERE/torch_anchors.py" "${args[@]}"
  if [[ $(rc_of "$base") == 77 ]]; then
    say "PyTorch anchors: skipped: $(tail -1 "$base.err")"
  else
    say_exit "PyTorch anchors" "$base"
  fi
}

# run_gpu_benches DEADLINE: every GPU bench, the anchors after bench_train_gpu; in full
# mode bench_train_gpu again on the portable grouped GEMMs.
run_gpu_benches() {
  local D=$1 b name order=("${GPU_BENCHES[@]}")
  for b in "$BIN"/bench_*; do
    name=$(basename "$b")
    [[ $CPU_BENCHES == *" $name "* || " ${GPU_BENCHES[*]} " == *" $name "* ]] || order+=("$name")
  done
  for name in "${order[@]}"; do
    [[ -x $BIN/$name ]] || continue
    run_bench "$name" "$L/bench/$name" "$D"
    case $name in
      bench_train_gpu)
        # A fault of the sm90a attention in its start-up check (the backend runs it
        # before any step) leaves no step timed: time it again on the portable kernels.
        if [[ $(rc_of "$L/bench/bench_train_gpu") != 0 ]] &&
          grep -qs "checking the sm90a kernels against the portable ones" "$L/bench/bench_train_gpu.err"; then
          run_bench bench_train_gpu "$L/bench/bench_train_gpu.attention_portable" "$D" SPES_ATTENTION=portable
        elif [[ ! $(rc_of "$L/bench/bench_train_gpu") =~ ^(0|none|124|137)$ ]]; then  # failed, not cut for time
          # A fault inside a replayed CUDA graph names no kernel: launch by launch, the
          # same step tells a graph problem from a kernel's.
          run_bench bench_train_gpu "$L/bench/bench_train_gpu.graph_off" "$D" SPES_CUDA_GRAPH=off
        fi
        run_anchors "$D"
        ;;
      bench_attention)
        if [[ $MODE == full ]]; then
          run_bench bench_train_gpu "$L/bench/bench_train_gpu.portable" "$D" SPES_GROUPED_GEMM=portable
        else
          skip_step "$L/bench/bench_train_gpu.portable" "$FULL_ONLY"
        fi
        # Before bench_core and bench_gemm, whose figures have been stable: the
        # profile needs a minute, and the budget may not leave it one at the end.
        run_profile "$D"
        ;;
    esac
  done
}

# ---- 1d. where the step's heaviest kernels spend their cycles: Nsight Compute ------------
# One step of spes-1b cut to 2 layers (every kernel at its spes-1b shape, a few GiB)
# under ncu, which replays each selected kernel to read the hardware counters (so
# nothing here is a timing; --clock-control none leaves the clocks as they are): of
# the step's second layer, the attention forward and the two expert forward GEMMs,
# then the 5 cross-entropy chunks, then that layer's backward (expert backward-input
# and weight-gradient GEMMs, attention backward), 14 kernels in the order the step
# launches them, sm90a or portable, whichever the step takes. The NVTX range
# "profiled step" (bench_train_gpu --profile) keeps the warm-up step out, and the
# launch count starts inside it. Exported as text: the raw counters (CSV, one row per
# kernel), the details page (throughput against the peaks, warp stall reasons, the
# profiler's own advice) and the stall samples per SASS instruction.
# The kernels by name, in any of the forms ncu may give it (demangled with namespaces
# and arguments, or the bare name).
PROFILE_NAMES='(grouped_)?(rows|wgrad)|(attention_)?(forward|backward_dkv|backward_dq|dkv|dq)|ce_cluster'
PROFILE_KERNELS="(^|::| )($PROFILE_NAMES)_kernel([<( ]|\$)"
PROFILE_SKIP=3 PROFILE_COUNT=14 PROFILE_CAP=90
find_ncu() {
  local c
  for c in "$(command -v ncu 2>/dev/null)" /usr/local/cuda/bin/ncu /usr/local/cuda-*/bin/ncu \
    /opt/nvidia/nsight-compute/*/ncu; do
    [[ -n $c && -x $c ]] && echo "$c" && return
  done
}

# run_profile DEADLINE
run_profile() {
  local D=$1 base="$L/profile/step" ncu rep="$WORK/profile" page t extra=()
  mkdir -p "$L/profile" "$WORK/ncu-home"
  ncu=$(find_ncu)
  if [[ -z $ncu ]]; then
    skip_step "$base" "ncu (Nsight Compute) not found"
  elif ! have_gpu; then
    skip_step "$base" "no GPU"
  elif [[ ! -x $BIN/bench_train_gpu ]]; then
    skip_step "$base" "no bench_train_gpu in this build"
  fi
  t=$(cap 15 "$D")
  ((t < 5)) && skip_step "$base" "out of time (the check's budget of ${BUDGET}s is used up)"
  if [[ -f $base.skipped ]]; then
    say "ncu profile: skipped: $(cat "$base.skipped")"
    return
  fi
  # The Hopper tensor pipe's busy share, where this ncu knows the counter (asking for
  # an unknown one would fail the whole profile). The list is read whole (a grep that
  # stopped at the first match would leave ncu writing into a closed pipe).
  HOME="$WORK/ncu-home" timeout "$t" "$ncu" --query-metrics --chip gh100 > "$WORK/ncu-metrics.txt" 2>/dev/null
  grep -q '^sm__pipe_tensor_op_gmma_cycles_active' "$WORK/ncu-metrics.txt" &&
    extra=(--metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active)
  # Launch by launch (SPES_CUDA_GRAPH=off): with one micro-batch a step, the profiled
  # step is the one that captures the graph, and the kernels must be picked by launch
  # order; ncu replays each kernel alone anyway, so the counters are the same.
  run_step "$base" "$(cap "$PROFILE_CAP" "$D")" env HOME="$WORK/ncu-home" SPES_CUDA_GRAPH=off "$ncu" --clock-control none \
    --set detailed "${extra[@]}" --import-source no --nvtx --nvtx-include "profiled step/" \
    --kernel-name-base demangled --kernel-name "regex:$PROFILE_KERNELS" \
    --launch-skip "$PROFILE_SKIP" --launch-count "$PROFILE_COUNT" -f -o "$rep" \
    "$BIN/bench_train_gpu" --profile --layers 2 --micro-batches 1
  if [[ -f $rep.ncu-rep ]]; then
    for page in "raw --csv --print-units base" "details" "source --csv --print-source sass"; do
      t=$(cap 30 "$D")
      ((t < 10)) && t=10  # an export takes seconds: past the budget by that at most
      # shellcheck disable=SC2086  # the page's words
      HOME="$WORK/ncu-home" timeout "$t" "$ncu" --import "$rep.ncu-rep" --print-kernel-base demangled --page $page \
        > "$base.${page%% *}$([[ $page == *csv* ]] && echo .csv || echo .txt)" 2>> "$base.import.err"
    done
  fi
  local kernels
  kernels=$(grep -c '^"[0-9]' "$base.raw.csv" 2>/dev/null)
  say_exit "ncu profile (${kernels:-0} kernels)" "$base"
}

# ---- 2. tiny-central on the GPU and on the CPU; 3. the mixed SPES run ----------------------
DATA_SETS=(--set "data.train=$(quote "$DATA/train.manifest")" --set "data.validation=$(quote "$DATA/val.manifest")")
# The CPU reference takes minutes (bench/RESULTS.md: 300 steps did not fit in 240 s
# on 8 cores of the H200 machine's Xeon), so it runs from the start, beside the
# correctness lanes, on at most half the cores; it stops at the end of that phase and
# step 2 compares the curves up to the last step both runs logged.
CPU_THREADS=$((NPROC / 2 < 8 ? NPROC / 2 : 8))
((CPU_THREADS < 1)) && CPU_THREADS=1
start_cpu_reference() {
  say "training tiny-central for $TRAIN_STEPS steps on the CPU (threads: $CPU_THREADS) in the background"
  bg_start "$L/train/cpu" "$(cap 480 "$1")" "$BIN/spes-engine" train "$CFG/tiny-central.toml" \
    "${DATA_SETS[@]}" --set train.steps="$TRAIN_STEPS" --set 'train.device="cpu"' --set train.threads="$CPU_THREADS" \
    --set "checkpoint.dir=$(quote "$WORK/central-cpu")"
}

# train_gpu DEADLINE CPU_PID: step 2's GPU run; without it the CPU curve compares
# with nothing, so a failed GPU run stops the CPU run (a process of the main shell).
train_gpu() {
  echo "$GPU_DEVICE" > "$L/env/gpu_device"
  say "training tiny-central for $TRAIN_STEPS steps on device $GPU_DEVICE"
  run_step "$L/train/gpu" "$(cap 120 "$1")" "$BIN/spes-engine" train "$CFG/tiny-central.toml" "${DATA_SETS[@]}" \
    --set train.steps="$TRAIN_STEPS" --set "train.device=$(quote "$GPU_DEVICE")" --set train.threads=2 \
    --set "checkpoint.dir=$(quote "$WORK/central-gpu")"
  if [[ $(rc_of "$L/train/gpu") != 0 && -n $2 ]] && kill -0 "$2" 2>/dev/null; then
    echo "stopped: the GPU run failed" > "$L/train/cpu.stopped"
    kill -TERM "$2" 2>/dev/null
  fi
  say "train GPU: exit $(rc_of "$L/train/gpu") $(grep -v '^\s*$' "$L/train/gpu.err" 2>/dev/null | tail -1)"
}

free_port() {
  python3 -c '
import random, socket
for _ in range(100):
    p = random.randint(20000, 29999)  # below the ephemeral range: no client socket holds it
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); print(p); break
    except OSError: pass
    finally: s.close()' 2>/dev/null || echo $((20000 + RANDOM % 10000))
}

# spes_run DEADLINE: coordinator + node 0 on the GPU + nodes 1-3 on the CPU. Like
# `spes-engine local`: one process failing stops the others; when every node is done
# the coordinator is stopped (it serves until told otherwise).
spes_run() {
  local t port node_threads n p dev failed nodes_left procs=("$L/spes/coordinator") spes_sets
  port=$(free_port)
  # The cores the CPU reference and node 0 leave.
  node_threads=$(((NPROC - CPU_THREADS - 2) / 3))
  ((node_threads < 1)) && node_threads=1
  spes_sets=("${DATA_SETS[@]}" --set train.steps="$SPES_STEPS" --set "spes.coordinator=$(quote "127.0.0.1:$port")"
    --set "spes.state_dir=$(quote "$WORK/spes/coordinator")" --set "checkpoint.dir=$(quote "$WORK/spes/checkpoints")")
  say "SPES run: coordinator on port $port, node 0 on device $GPU_DEVICE, nodes 1-3 on the CPU (threads: $node_threads each), $SPES_STEPS steps"
  t=$(cap 180 "$1")
  if bg_start "$L/spes/coordinator" "$t" "$BIN/spes-engine" coordinator "$CFG/tiny.toml" "${spes_sets[@]}" --fresh; then
    for n in 0 1 2 3; do
      if ((n == 0)); then dev=(--set "train.device=$(quote "$GPU_DEVICE")" --set train.threads=2)
      else dev=(--set 'train.device="cpu"' --set train.threads="$node_threads"); fi
      bg_start "$L/spes/node$n" "$t" "$BIN/spes-engine" train "$CFG/tiny.toml" --node-id "$n" "${spes_sets[@]}" "${dev[@]}"
      procs+=("$L/spes/node$n")
    done
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
  else
    for n in 0 1 2 3; do skip_step "$L/spes/node$n" "$(cat "$L/spes/coordinator.skipped")"; done
  fi
  for p in "$L/spes/coordinator" "$L"/spes/node{0,1,2,3}; do
    say "SPES $(basename "$p"): exit $(rc_of "$p")$([[ -f $p.stopped ]] && echo " ($(cat "$p.stopped"))")"
  done
}

# ---- 4. compute-sanitizer over the CUDA test files -------------------------------------
# Kernels that never ran before can read or write out of bounds, or race in shared
# memory, and still pass a test by luck; a failed test says what, the sanitizer where
# (kernel, file:line: the binaries carry -lineinfo).
find_sanitizer() {
  local c
  for c in "$(command -v compute-sanitizer 2>/dev/null)" /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
    /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
    [[ -n $c && -x $c ]] && echo "$c" && return
  done
}

# sanitize_file TOOL NAME DEADLINE: one test file under the tool. The whole-step file
# runs without its long cases (300 steps, resume), which the sanitizer would slow past
# any cap; racecheck leaves out the grouped GEMMs' comparison at spes-1b widths (alone
# > 90 s). Also out: the cases that touch guards through the runtime API on purpose
# (memcheck may report those copies as the accesses they are).
sanitize_file() {
  local tool=$1 name=$2 D=$3 base="$L/sanitize/$2.$1" exclude=()
  [[ $name == test_gpu_step ]] && exclude=(--test-case-exclude='*300 steps*,*resume*,*never leave*')
  [[ $name == test_cuda_core ]] && exclude=(--test-case-exclude='*one byte past*,*arena buffers aligned*')
  [[ $tool == racecheck && $name == test_cuda_grouped_gemm ]] && exclude=(--test-case-exclude='*sm90a path against the portable*')
  run_step "$base" "$(cap 60 "$D")" "$SANITIZER" --tool "$tool" --nvtx yes --error-exitcode 86 --print-limit 20 \
    --log-file "$base.log" "$BIN/spes_tests" --gpu-file --source-file="*$name.cu" "${exclude[@]}"
  case $(rc_of "$base") in
    0) say "$tool $name: clean" ;;
    86) say "$tool $name: ERRORS: $(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$base.log" 2>/dev/null)" ;;
    none) say "$tool $name: not run: $(cat "$base.skipped" 2>/dev/null)" ;;
    124 | 137) say "$tool $name: timed out after $(cat "$base.timeout")s" ;;
    *) say "$tool $name: exit $(rc_of "$base") (the tests themselves failed under the sanitizer)" ;;
  esac
}

# run_sanitizers DEADLINE: first the planted arena overrun under memcheck: it must be
# reported (exit 86). Inside the arena's one cudaMalloc memcheck sees it only through
# the NVTX regions the arena registers; if it stays silent there, a clean memcheck of
# the whole step says nothing about writes from one arena buffer into the next. Then
# memcheck on every file, racecheck on the kernel files (the whole-step files run the
# same kernels through cuBLAS-heavy steps that racecheck slows past any cap, and
# test_cuda_matmul is cuBLAS alone).
run_sanitizers() {
  local D=$1 base="$L/guard/memcheck" tool name
  SANITIZER=$(find_sanitizer)
  echo "${SANITIZER:-not found}" > "$L/sanitize/tool"
  if [[ -z $SANITIZER ]]; then
    skip_step "$base" "compute-sanitizer not found"
    say "compute-sanitizer: not found on this machine (skipped)"
    return
  fi
  if ! have_gpu; then
    skip_step "$base" "no GPU"
    echo "no GPU" > "$L/sanitize/skipped"
    say "compute-sanitizer: no GPU (skipped)"
    return
  fi
  run_step "$base" "$(cap 60 "$D")" "$SANITIZER" --tool memcheck --nvtx yes --error-exitcode 86 --print-limit 5 \
    --log-file "$base.log" "$BIN/spes_tests" --gpu-file --source-file='*test_cuda_core.cu' --no-skip \
    --test-case='*planted*'
  say "memcheck sees the planted arena overrun: exit $(rc_of "$base") (86: seen) $(grep -m1 -o 'Invalid __global__ [a-z]* of size [0-9]* bytes' "$base.log" 2>/dev/null)"
  for tool in memcheck racecheck; do
    while IFS= read -r name; do
      [[ -z $name ]] && continue
      [[ $tool == racecheck && $name =~ ^(test_gpu_step|test_gpu_data_parallel|test_cuda_matmul)$ ]] && continue
      sanitize_file "$tool" "$name" "$D"
    done < "$HERE/cuda-tests.txt"
  done
}

# ---- 5. CPU benches ---------------------------------------------------------------------
run_cpu_benches() {
  local D=$1 b name
  for b in "$BIN"/bench_*; do
    name=$(basename "$b")
    [[ $CPU_BENCHES == *" $name "* ]] || continue
    if [[ $MODE == quick ]]; then
      skip_step "$L/bench/$name" "$FULL_ONLY"
    elif [[ $CPU_BENCHES_ON == 0 ]]; then
      skip_step "$L/bench/$name" "left out (SPES_CHECK_CPU_BENCHES=0)"
    else
      # shellcheck disable=SC2086
      run_step "$L/bench/$name" "$(cap "${BENCH_CAP[$name]:-60}" "$D")" "${STDBUF[@]}" "$b" ${BENCH_ARGS[$name]:-}
      say_exit "bench $name" "$L/bench/$name"
    fi
  done
}

# ---- the modes ----------------------------------------------------------------------------
quick_mode() {
  local what
  for what in train/gpu train/cpu spes/coordinator spes/node{0,1,2,3} guard/memcheck; do
    skip_step "$L/$what" "$FULL_ONLY"
  done
  echo "$FULL_ONLY" > "$L/sanitize/skipped"
  run_tests "$(deadline 0.40)"
  run_gpu_benches "$(deadline 1.0)"
  run_cpu_benches "$(deadline 1.0)"
}

# Correctness first, three lanes side by side (each a subshell that waits for its own
# steps), the CPU reference beside them; then the timing phase with the GPU alone.
full_mode() {
  local DA lanes=() lane cpu_pid
  DA=$(deadline 0.40)
  start_cpu_reference "$DA"
  cpu_pid=${PID[$L/train/cpu]}
  say "correctness phase: the test files, compute-sanitizer, and steps 2-3 side by side, until $((DA - T0))s"
  run_tests "$DA" &
  lanes+=($!)
  run_sanitizers "$DA" &
  lanes+=($!)
  (train_gpu "$DA" "$cpu_pid" && spes_run "$DA") &
  lanes+=($!)
  for lane in "${lanes[@]}"; do wait "$lane"; done
  # The CPU reference ends at the phase's deadline at the latest (its timeout).
  bg_wait "$L/train/cpu"
  say "train CPU: exit $(rc_of "$L/train/cpu")$([[ -f $L/train/cpu.stopped ]] && echo " ($(cat "$L/train/cpu.stopped"))")"
  say "timing phase: the GPU alone"
  run_gpu_benches "$(deadline 0.98)"
  run_cpu_benches "$(deadline 1.0)"
}

say "spes-engine GPU check, $MODE mode: bundle $HERE, output $OUTDIR, work $WORK, budget ${BUDGET}s"
echo "$MODE" > "$L/mode"
echo "$BUDGET" > "$L/budget_s"
cp "$HERE/BUNDLE_INFO" "$L/" 2>/dev/null
say "$(sed -n 's/^commit: /commit /p' "$HERE/BUNDLE_INFO")"
unpack_and_probe
find_libraries
guard_check
if [[ $MODE == full ]]; then full_mode; else quick_mode; fi

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
