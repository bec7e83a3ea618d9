#!/usr/bin/env bash
# Does sparse sync work? (issue 15) One command runs every variant of the study on
# the shipped corpus at one total-token budget and writes a table and SVG plots:
#
#   bench/study/run.sh [--smoke] [--scale N | --steps N] [--seeds "S1 S2"] [--device cpu|cuda|auto]
#                      [--out DIR] [--bin SPES_ENGINE] [--only "VARIANT..."] [--data DIR]
#
# The model is configs/tiny.toml's (the tiny family: 8 experts, top-2, d 128, 4
# layers); only steps change. The budget is STEPS optimizer steps of 4 nodes × 8
# sequences × 256 tokens (STEPS = 180·N with --scale N, or --steps; --smoke: a few
# tiny steps, for CI). Every variant sees the same tokens per step over all nodes, the
# same schedule and the same validation batches at the same token counts; each
# node reads its own data order (seed + 1000·node, as SPES has it). Outputs under
# DIR (default runs/study): table.md, table.csv, curves.csv (every eval point),
# val_ce.svg (one series per variant, mean over seeds), val_ce_sync.svg (the sync
# sweep), runs/<variant>/s<seed>/ (each run's CSV, rounds.csv, log). --only runs just
# the variants named (e.g. "spes-warmup spes-warmup-int8"): the best SPES variant is then
# the best of those of its candidates with runs under DIR, else spes-warmup (the
# committed study's best, bench/RESULTS.md). --data DIR trains on a corpus of your own,
# already tokenized with the byte tokenizer (`spes-engine tokenize`, the tiny family's
# vocabulary): DIR/train.manifest and DIR/val.manifest (held-out text), in place of
# the shipped Shakespeare.
# Only bash, awk and spes-engine: CI has nothing else.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=$ROOT/build/spes-engine
OUT=$ROOT/runs/study
SCALE=1
SMOKE=0
STEPS=
SEEDS="1234 1235"
DEVICE=cpu
ONLY=
DATA=

usage() { sed -n '5,6p' "${BASH_SOURCE[0]}" | sed 's/^# *//'; }
die() { echo "study: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --scale) SCALE=${2:?--scale needs N}; shift ;;
    --steps) STEPS=${2:?--steps needs N}; shift ;;
    --seeds) SEEDS=${2:?--seeds needs a list}; shift ;;
    --device) DEVICE=${2:?--device needs cpu, cuda or auto}; shift ;;
    --out) OUT=${2:?--out needs DIR}; shift ;;
    --bin) BIN=${2:?--bin needs a path}; shift ;;
    --only) ONLY=${2:?--only needs a list of variants}; shift ;;
    --data) DATA=${2:?--data needs DIR}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "study: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[[ $SCALE =~ ^[1-9][0-9]*$ ]] || die "--scale $SCALE: expected a positive integer"
[ -x "$BIN" ] || die "$BIN is not an executable (build it: make engine, or pass --bin)"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONFIG=$ROOT/configs/tiny.toml
source "$ROOT/bench/study/lib.sh"
source "$ROOT/bench/study/budget.sh"

# ---- (9) hooks: every codec and overlapped rounds on the best SPES variant ---------
# Each hook: name|overrides on top of the best SPES variant, at its sync interval (so
# the best variant itself is the fp32 synchronous baseline). Overlapped rounds are
# applied at the next round (overlap) or a fifth of the interval after their push
# (overlap-fifth: a link whose round takes a fifth of the compute between rounds). A
# hook whose key this engine does not know is skipped with a message.
FIFTH=$((SYNC / 5 > 0 ? SYNC / 5 : 1))
HOOKS=("overlap|spes.overlap=true" "overlap-fifth|spes.overlap=true spes.overlap_steps=$FIFTH"
  "sparse-codec|spes.codec=\"sparse\"" "bf16|spes.codec=\"bf16\"" "int8|spes.codec=\"int8\""
  "int3|spes.codec=\"int3\"" "int3-overlap-fifth|spes.codec=\"int3\" spes.overlap=true spes.overlap_steps=$FIFTH")

echo "study: $STEPS steps per run, budget $BUDGET tokens over all nodes, seeds $SEEDS, out $OUT" >&2
start=$(date +%s)
for seed in $SEEDS; do
  run_variant central "$seed" 1 0 "${CENTRAL[@]}"
  run_variant solo "$seed" 1 0 "${SOLO[@]}"
  run_variant spes-warmup "$seed" "$NODES" 0 "${SPES[@]}"
  run_variant spes-no-warmup "$seed" "$NODES" 0 "${SPES[@]}" "${NOWARM[@]}"
  run_variant spes-nesterov "$seed" "$NODES" 0 "${SPES[@]}" "${NESTEROV[@]}"
  run_variant spes-nesterov-mild "$seed" "$NODES" 0 "${SPES[@]}" "${NESTEROV_MILD[@]}"
  run_variant diloco-average "$seed" "$NODES" 0 "${ALL_EXPERTS[@]}"
  run_variant diloco-nesterov "$seed" "$NODES" 0 "${ALL_EXPERTS[@]}" "${NESTEROV[@]}"
done

# (7), (8) and (9) build on the best SPES variant (lowest mean final validation CE).
BEST=$(best_of spes-warmup spes-no-warmup spes-nesterov spes-nesterov-mild)
case $BEST in
  spes-warmup) BEST_SETS=("${SPES[@]}") ;;
  spes-no-warmup) BEST_SETS=("${SPES[@]}" "${NOWARM[@]}") ;;
  spes-nesterov) BEST_SETS=("${SPES[@]}" "${NESTEROV[@]}") ;;
  spes-nesterov-mild) BEST_SETS=("${SPES[@]}" "${NESTEROV_MILD[@]}") ;;
esac
echo "study: best SPES variant: $BEST" >&2
for seed in $SEEDS; do
  for s in $SWEEP; do run_variant "$BEST-sync$s" "$seed" "$NODES" 0 "${BEST_SETS[@]}" "spes.sync_steps=$s"; done
  run_upcycled "$seed"
done
for hook in "${HOOKS[@]}"; do
  name=${hook%%|*}
  IFS=' ' read -r -a sets <<< "${hook#*|}"
  if ! why=$(probe_keys "${BEST_SETS[@]}" "${sets[@]}"); then
    echo "study: hook $name skipped: this engine does not accept ${sets[*]} ($why)" >&2
    continue
  fi
  for seed in $SEEDS; do run_variant "$BEST-$name" "$seed" "$NODES" 0 "${BEST_SETS[@]}" "${sets[@]}"; done
done

write_results
echo "study: done in $(( $(date +%s) - start )) s: $OUT/table.md, $OUT/val_ce.svg, $OUT/val_ce_sync.svg" >&2
check_results
