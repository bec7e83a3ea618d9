#!/usr/bin/env bash
# Does SPES hold at scale? The study on one GPU at 30-100× the tiny study's tokens,
# on a corpus a machine that can download nothing already holds: the Python sources
# of its own installation (bench/study/python_corpus.py).
#
#   bench/study/gpu_scale.sh [--smoke] [--tokens N] [--fit-seconds S] [--seeds "S1 S2"]
#                            [--device cuda|cpu|auto] [--out DIR] [--bin SPES_ENGINE] [--threads N]
#
# The model is configs/study-python.toml's (spes-1b's family at d 512, 8 layers, 16
# experts top-2, the GPT-NeoX BPE). Every variant sees the same total tokens (N,
# default 50331648 = 768 steps of 4 × 16 × 1024; rounded down to a multiple of 48
# steps), the same schedule and the same held-out batches at 16 points:
#   central         one node owning every expert, the 4 nodes' batch;
#   spes            4 nodes × 4 of 16 experts, the merging warm-up on, a round every
#                   1/48 of the run, fp32 deltas (configs/spes-1b.toml's recipe at the
#                   tiny sweep's best interval), the nodes sharing the GPU;
#   solo            one node's share alone (its batch, the same steps: ¼ of the tokens);
#   diloco-average  4 nodes each owning every expert, averaged every round.
# --fit-seconds S: fewer tokens where N would not finish within S seconds of the
# script's start (a lent GPU's call has a hard limit): after the corpus, two short
# probe runs (central, and 4 nodes owning every expert, the dearest per step) time a
# step, an eval, a sync round and the start-up on this machine; the steps are then
# the most (a multiple of 48, at most N's) whose four variants' predicted time, with
# a 15% margin, fits what is left of S.
# The corpus is split by file (held-out files never trained on, fixed by a hash of the
# path) and tokenized on every core. Results go to DIR (default runs/study-gpu): the
# study's table.md / table.csv / curves.csv / val_ce.svg (written again after every
# run, so a run cut short still leaves the ones before it), corpus.csv (files, bytes,
# tokens per split), runs/<variant>/s<seed>/ (each run's CSV and log).
# --smoke (CI, on the CPU): 2 MiB of the corpus, a model of d 64 and 2 layers, a few
# steps: it checks the plumbing, not the numbers.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=$ROOT/build/spes-engine
OUT=$ROOT/runs/study-gpu
SMOKE=0
TOKENS=50331648
FIT_SECONDS=0
SEEDS=1234
DEVICE=
THREADS=0

usage() { sed -n '6,7p' "${BASH_SOURCE[0]}" | sed 's/^# *//'; }
die() { echo "study-gpu: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --tokens) TOKENS=${2:?--tokens needs N}; shift ;;
    --fit-seconds) FIT_SECONDS=${2:?--fit-seconds needs S}; shift ;;
    --seeds) SEEDS=${2:?--seeds needs a list}; shift ;;
    --device) DEVICE=${2:?--device needs cuda, cpu or auto}; shift ;;
    --out) OUT=${2:?--out needs DIR}; shift ;;
    --bin) BIN=${2:?--bin needs a path}; shift ;;
    --threads) THREADS=${2:?--threads needs N}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "study-gpu: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[[ $TOKENS =~ ^[1-9][0-9]*$ ]] || die "--tokens $TOKENS: expected a positive integer"
[[ $FIT_SECONDS =~ ^[0-9]+$ ]] || die "--fit-seconds $FIT_SECONDS: expected a whole number of seconds"
[ -x "$BIN" ] || die "$BIN is not an executable (build it: make engine, or pass --bin)"
command -v python3 > /dev/null || die "python3 is needed to collect the corpus (bench/study/python_corpus.py)"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONFIG=$ROOT/configs/study-python.toml
TOKENIZER=$ROOT/data/tokenizers/gpt-neox-olmo-dolma-v1_5.json
source "$ROOT/bench/study/lib.sh"

# ---- the budget --------------------------------------------------------------------
# Evals every 1/16 of the run, a sync round every 1/48, the learning-rate warm-up
# 1/15, the expert-merging warm-up's merges every 1/6 over the first half: the tiny
# study's shape at a longer run.
NODES=4
MODEL=()
EVALS=16 ROUNDS=48  # per run, full size
schedule_of() {
  STEPS=$1
  EVAL_EVERY=$((STEPS / EVALS)) WARMUP=$((STEPS / 15)) SYNC=$((STEPS / ROUNDS))
  MERGE_INTERVAL=$((STEPS / 6)) MERGE_DECAY=$((STEPS / 2))
}
if [ "$SMOKE" = 1 ]; then
  STEPS=8 EVAL_EVERY=1 EVAL_BATCHES=1 WARMUP=2 SYNC=2 MERGE_INTERVAL=2 MERGE_DECAY=4 NODE_BATCH=2 SEQ=64
  MODEL=("model.d_model=64" "model.n_layers=2" "model.n_heads=2" "model.n_kv_heads=2" "model.expert_hidden=64")
  DEVICE=${DEVICE:-cpu} MAX_MB=2
else
  NODE_BATCH=16 SEQ=1024 EVAL_BATCHES=16
  DEVICE=${DEVICE:-cuda} MAX_MB=0
  schedule_of $((TOKENS / (NODES * NODE_BATCH * SEQ) / ROUNDS * ROUNDS))
  ((STEPS > 0)) || die "--tokens $TOKENS: fewer than $ROUNDS steps of $((NODES * NODE_BATCH * SEQ)) tokens"
fi
SWEEP=""  # no sync sweep here (lib.sh)

# ---- the corpus: this machine's Python sources, split by file, tokenized once -------
DATA=$OUT/data
if [ ! -f "$DATA/heldout/train.manifest" ]; then
  t0=$(date +%s)
  python3 "$ROOT/bench/study/python_corpus.py" "$DATA" --max-mb "$MAX_MB" || die "collecting the corpus failed"
  for split in train heldout; do
    "$BIN" tokenize --input "$DATA/$split.jsonl" --out "$DATA/$split" --tokenizer "$TOKENIZER" --threads "$THREADS" \
      2> "$DATA/tokenize-$split.log" || { tail -n 3 "$DATA/tokenize-$split.log" >&2; die "tokenizing $split failed"; }
  done
  rm -f "$DATA"/*.jsonl
  echo "study-gpu: corpus collected and tokenized in $(( $(date +%s) - t0 )) s" >&2
fi
# corpus.csv gains each split's tokens: the token files' bytes / 2 (uint16 ids).
# The manifest lists each file with its size after a tab.
tokens_of() { awk -F'\t' '!/^#/ && NF { s += $2 } END { printf "%.0f\n", s / 2 }' "$DATA/$1/train.manifest"; }
awk -F, -v tr="$(tokens_of train)" -v ho="$(tokens_of heldout)" '
  NR == 1 { print $0 ",tokens"; next } $1 == "train" { print $0 "," tr; next } $1 == "heldout" { print $0 "," ho; next }
  { print $0 "," }' "$DATA/corpus.csv" > "$OUT/corpus.csv"
echo "study-gpu: corpus (split, files, bytes, tokens):" >&2
sed 's/^/  /' "$OUT/corpus.csv" >&2

# ---- the variants ---------------------------------------------------------------------
# The runs' overrides, from the schedule (again after --fit-seconds changes it).
define_variants() {
  COMMON=("train.steps=$STEPS" "train.eval_every=$EVAL_EVERY" "train.eval_batches=$EVAL_BATCHES"
    "train.micro_batch=$NODE_BATCH" "model.seq_len=$SEQ" "train.device=\"$DEVICE\"" "optim.warmup_steps=$WARMUP"
    "optim.decay_steps=$STEPS" "data.train=\"$DATA/train/train.manifest\""
    "data.validation=\"$DATA/heldout/train.manifest\"" "data.tokenizer=\"$TOKENIZER\"" "checkpoint.every=0"
    "checkpoint.keep=1" "spes.merge_interval=$MERGE_INTERVAL" "spes.merge_decay_steps=$MERGE_DECAY" "${MODEL[@]}")
  node_variants
}
define_variants

# ---- fitting the budget to the time left (--fit-seconds) -----------------------------
# One probe run's figures from its CSV, for the node of most step time: the median
# step_ms of its plain steps, its eval step's extra, its mean sync round (sync_ms) and
# the start-up (the wall time less the steps').
probe_figures() {
  awk -F, -v wall="$(cat "$1/wall_s")" '
    NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
    $1 == "node" || $1 == "step" { next }
    {
      node = ("node" in col) ? $col["node"] : 0; ms = $col["step_ms"]; total[node] += ms
      if ($col["val_ce"] != "") eval_ms[node] = ms - $col["sync_ms"]
      else if ($col["sync_round"] > 0) { sync[node] += $col["sync_ms"]; rounds[node]++ }
      else if ($col["step"] > 2) plain[node, ++n[node]] = ms
    }
    END {
      worst = -1
      for (node in total) if (worst == -1 || total[node] > total[worst]) worst = node
      m = n[worst]
      for (i = 1; i <= m; ++i) v[i] = plain[worst, i]
      for (i = 2; i <= m; ++i) for (k = i; k > 1 && v[k - 1] > v[k]; --k) { t = v[k]; v[k] = v[k - 1]; v[k - 1] = t }
      step = v[int((m + 1) / 2)]
      printf "%.4f %.4f %.4f %.4f\n", step / 1000, (eval_ms[worst] - step) / 1000,
        rounds[worst] ? sync[worst] / rounds[worst] / 1000 : 0, wall - total[worst] / 1000
    }' "$1/train.csv"
}

fit_steps() {
  local probe=$OUT/probe steps=12
  local -a timing=("train.steps=$steps" "train.eval_every=$steps" "optim.warmup_steps=2" "optim.decay_steps=$steps" "spes.merge_interval=$steps" "spes.merge_decay_steps=$steps")
  echo "study-gpu: timing $steps-step probe runs to fit the study into ${FIT_SECONDS} s" >&2
  run_engine "$probe/central" 1 "${CENTRAL[@]}" "${timing[@]}"
  run_engine "$probe/nodes" "$NODES" "${ALL_EXPERTS[@]}" "${timing[@]}" "spes.sync_steps=$((steps / 2))"
  drop_state "$probe"/*
  local c n
  c=$(probe_figures "$probe/central") n=$(probe_figures "$probe/nodes")
  echo "study-gpu: probe (step s, eval extra s, round s, start-up s): central $c; 4 nodes $n" >&2
  # Per seed: central and solo (¼ of central's batch per step) on one node; spes and
  # diloco-average on four, each with ROUNDS rounds. Every run evaluates EVALS times.
  awk -v c="$c" -v n="$n" -v left=$((FIT_SECONDS - SECONDS)) -v seeds="$(wc -w <<< "$SEEDS")" -v most="$STEPS" \
    -v evals="$EVALS" -v rounds="$ROUNDS" '
    BEGIN {
      split(c, C, " "); split(n, N, " ")
      fixed = 2 * (C[4] + evals * C[2]) + 2 * (N[4] + evals * N[2] + rounds * N[3])
      per_step = 1.25 * C[1] + 2 * N[1]
      steps = int((left / 1.15 / seeds - fixed) / per_step / rounds) * rounds
      if (steps > most) steps = most
      print steps
    }'
}

if [ "$FIT_SECONDS" -gt 0 ]; then
  fitted=$(fit_steps)
  [[ $fitted =~ ^-?[0-9]+$ ]] || die "--fit-seconds: the probe runs gave no step count ('$fitted'); see $OUT/probe"
  if [ "$SMOKE" = 1 ]; then
    echo "study-gpu: --fit-seconds would run $fitted steps (the smoke keeps its $STEPS)" >&2
  else
    ((fitted >= ROUNDS)) || die "--fit-seconds $FIT_SECONDS: not even $ROUNDS steps per run fit in the $((FIT_SECONDS - SECONDS)) s left"
    ((fitted < STEPS)) && echo "study-gpu: $STEPS steps would not fit in ${FIT_SECONDS} s: $fitted" >&2
    schedule_of "$fitted"
    define_variants
  fi
fi

BUDGET=$((STEPS * NODES * NODE_BATCH * SEQ))  # total tokens over all nodes
echo "study-gpu: $STEPS steps per run on $DEVICE, budget $BUDGET tokens over all nodes, seeds $SEEDS, out $OUT" >&2
BEST=spes
start=$(date +%s)
# One variant's run, then the results so far (a run cut short leaves the ones before it).
study_run() {
  run_variant "$@"
  write_results
}
for seed in $SEEDS; do
  study_run central "$seed" 1 0 "${CENTRAL[@]}"
  study_run spes "$seed" "$NODES" 0 "${SPES[@]}"
  study_run solo "$seed" 1 0 "${SOLO[@]}"
  study_run diloco-average "$seed" "$NODES" 0 "${ALL_EXPERTS[@]}"
done
echo "study-gpu: done in $(( $(date +%s) - start )) s: $OUT/table.md, $OUT/val_ce.svg" >&2
check_results
