#!/usr/bin/env bash
# The GPU check (bench/gpu_check/) rehearsed without a GPU, on this machine's build:
#
#   bundle: packs BUILD_DIR with `bundle.sh --rehearsal` into BUILD_DIR/gpu-check-rehearsal;
#   quick:  runs that bundle's run.sh in quick mode, with a stub `torch` module first on
#           PYTHONPATH (no GPU, no transformers), so the PyTorch anchors run and exit 77;
#   full:   runs it in full mode with SPES_CHECK_GPU_DEVICE=cpu (steps 2-3 train on the
#           CPU), 8 training steps, a 10-step SPES run and no CPU benches.
#
# CUDA_VISIBLE_DEVICES is emptied, so a machine with a GPU rehearses too. Each run
# must exit 0 and write report.md within its budget, with the mode named, every GPU
# step SKIPPED (no GPU) with its reason, the libraries found, steps 2-3 PASS in full
# mode (SKIPPED as full-mode-only in quick mode), and no FAIL anywhere in the summary.
#
# usage: gpu_check_rehearsal.sh bundle|quick|full SOURCE_DIR BUILD_DIR
set -uo pipefail

WHAT=${1:?usage: gpu_check_rehearsal.sh bundle|quick|full SOURCE_DIR BUILD_DIR}
SRC=${2:?source dir}
BUILD=${3:?build dir}
BUNDLE="$BUILD/gpu-check-rehearsal"
OUT="$BUILD/gpu-check-rehearsal-$WHAT"

problems=0
fail() {
  echo "gpu_check_rehearsal $WHAT: $*" >&2
  problems=$((problems + 1))
}
# has PATTERN WHY: report.md must hold the (extended) regular expression.
has() { grep -Eq -- "$1" "$OUT/report.md" || fail "report.md lacks /$1/: $2"; }
# row STEP STATUS [DETAIL]: the summary row of STEP has STATUS (and DETAIL in it).
row() {
  local line
  line=$(grep -F -- "| $1 |" "$OUT/report.md" | head -1)
  [[ $line == *"| **$2** |"* ]] || fail "summary row '$1' is not $2: ${line:-missing}"
  [[ -z ${3:-} || $line == *"$3"* ]] || fail "summary row '$1' does not say '$3': $line"
}

case $WHAT in
  bundle)
    bash "$SRC/bench/gpu_check/bundle.sh" --rehearsal "$BUILD" "$BUNDLE" > /dev/null || exit 1
    for f in run.sh report.py torch_anchors.py bin.tar.gz BUNDLE_INFO cuda-tests.txt configs/tiny.toml \
      data/tinyshakespeare/train.manifest; do
      [[ -e $BUNDLE/$f ]] || fail "the bundle lacks $f"
    done
    # CUPTI (bench_train_gpu's step timeline) travels with the binaries when the build found it.
    if [[ -f $(sed -n 's/^CUDA_cupti_LIBRARY:FILEPATH=//p' "$BUILD/CMakeCache.txt") ]]; then
      grep -q '^bin/libcupti\.so\.[0-9]*$' <<< "$(tar -tzf "$BUNDLE/bin.tar.gz")" || fail "the bundle lacks bin/libcupti.so.N"
    fi
    exit $((problems > 0))
    ;;
  quick)
    args=() budget=300
    mkdir -p "$OUT.stub/torch"
    printf '%s\n' '__version__ = "0-stub"' 'class cuda:' '    @staticmethod' '    def is_available(): return False' \
      > "$OUT.stub/torch/__init__.py"
    export PYTHONPATH="$OUT.stub${PYTHONPATH:+:$PYTHONPATH}"
    ;;
  full)
    args=(--full) budget=480
    export SPES_CHECK_GPU_DEVICE=cpu SPES_CHECK_TRAIN_STEPS=8 SPES_CHECK_SPES_STEPS=10 SPES_CHECK_CPU_BENCHES=0
    ;;
  *)
    echo "usage: gpu_check_rehearsal.sh bundle|quick|full SOURCE_DIR BUILD_DIR" >&2
    exit 2
    ;;
esac

[[ -x $BUNDLE/run.sh ]] || { echo "gpu_check_rehearsal: no bundle at $BUNDLE (run the bundle step)" >&2; exit 1; }
rm -rf "$OUT"
export CUDA_VISIBLE_DEVICES=""
t0=$(date +%s)
"$BUNDLE/run.sh" "${args[@]}" "$OUT" > "$OUT.log" 2>&1
rc=$?
took=$(($(date +%s) - t0))
((rc == 0)) || fail "run.sh exited $rc (log: $OUT.log)"
if [[ ! -s $OUT/report.md ]]; then
  fail "no report.md (log: $OUT.log)"
  tail -20 "$OUT.log" >&2
  exit 1
fi
[[ -s $OUT/logs.tar.gz ]] || fail "no logs.tar.gz"
((took <= budget + 15)) || fail "took ${took}s, over the ${budget}s budget"

has "^- \*\*mode\*\*: $WHAT \(budget $budget s\)" "the mode and its budget"
has "^- \*\*skipped for time\*\*: nothing$" "nothing skipped for time"
has "^## Summary" "the summary"
grep -q '| \*\*FAIL\*\* |' "$OUT/report.md" && fail "a summary row FAILED: $(grep '| \*\*FAIL\*\* |' "$OUT/report.md")"
row "0. libraries" PASS
row "1a. CUDA tests" SKIPPED "no GPU"
row "1b. GPU benches" SKIPPED
row "1c. Ours beside PyTorch (same GPU)" SKIPPED "PyTorch anchors:"
row "4a. arena guards" SKIPPED "no GPU"
row "1d. Kernel profile (ncu)" SKIPPED
if [[ $WHAT == quick ]]; then
  has "full mode only \(\`run.sh --full\`\): compute-sanitizer" "what quick mode leaves out"
  row "2. GPU vs CPU training (tiny-central)" SKIPPED "full mode only"
  row "3. Mixed SPES run (node 0 GPU, nodes 1-3 CPU)" SKIPPED "full mode only"
  row "4. compute-sanitizer" SKIPPED "full mode only"
  row "5. CPU benches" SKIPPED "full mode only"
  has "without its 300-step case \(quick mode\)" "test_gpu_step runs without its 300-step case"
  row "1c. Ours beside PyTorch (same GPU)" SKIPPED "PyTorch anchors: no GPU"
  # The stub stands in for torch only: where this machine has transformers installed
  # (a developer's oracle set-up), the path without it cannot be rehearsed here.
  if python3 -c 'import importlib.util as u, sys; sys.exit(u.find_spec("transformers") is None)' 2>/dev/null; then
    echo "gpu_check_rehearsal quick: transformers is installed here: its absence is not rehearsed" >&2
  else
    has "transformers not importable" "the anchors leave the model out without transformers"
  fi
else
  has "^\*\*Rehearsal\*\*" "the rehearsal note"
  row "2. GPU vs CPU training (tiny-central)" PASS "final loss at step 8"
  row "3. Mixed SPES run (node 0 GPU, nodes 1-3 CPU)" PASS "every state hash equal"
  row "4. compute-sanitizer" SKIPPED
  row "5. CPU benches" SKIPPED "SPES_CHECK_CPU_BENCHES=0"
  has "bench_train_gpu\.portable — SKIPPED \(no GPU" "the portable bench_train_gpu runs (and finds no GPU)"
fi
if ((problems)); then
  echo "--- $OUT/report.md (summary) ---" >&2
  sed -n '/^## Summary/,/^## 1\./p' "$OUT/report.md" >&2
  exit 1
fi
echo "gpu_check_rehearsal $WHAT: report.md as expected in ${took}s ($OUT/report.md)"
