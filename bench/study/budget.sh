# The study's budget, data and variant overrides (sourced by bench/study/run.sh and
# bench/study/slow_link.sh, which set ROOT, BIN, OUT, DEVICE, SMOKE, SCALE, STEPS and DATA):
# every script of the study trains on the same tokens with the same schedule.
# ---- the budget --------------------------------------------------------------------
# Full: 180 steps per run (≈1.5M tokens over all nodes; 36 runs in about 50 minutes
# on 2 cores: configs/tiny.toml's 300 steps would take about 80), an eval and a sync round every 15 steps (12 rounds, as `make run` has),
# the sweep 3 and 60. --steps N (a multiple of 60) or --scale N (180·N steps) keep
# that shape: sync intervals, evals and the merge schedule scale with the steps, so
# every eval of the base variants follows a sync round and every run ends on one.
# Smoke (CI): 8 steps of 2 sequences of 64 tokens per node; it checks the plumbing,
# not the numbers.
NODES=4
if [ "$SMOKE" = 1 ]; then
  STEPS=8 EVAL_EVERY=2 EVAL_BATCHES=1 WARMUP=2 SYNC=2 SWEEP="1 4" MERGE_INTERVAL=2 MERGE_DECAY=4
  NODE_BATCH=2 SEQ=64
else
  [[ -z $STEPS || $STEPS =~ ^[1-9][0-9]*$ ]] || die "--steps $STEPS: expected a positive integer"
  STEPS=${STEPS:-$((180 * SCALE))}
  [ $((STEPS % 60)) = 0 ] || die "--steps $STEPS: expected a multiple of 60 (the sync sweep is steps/60, steps/12 and steps/3)"
  SYNC=$((STEPS / 12)) SWEEP="$((STEPS / 60)) $((STEPS / 3))" EVAL_EVERY=$((STEPS / 12)) EVAL_BATCHES=4
  WARMUP=$((STEPS / 15)) MERGE_INTERVAL=$((STEPS / 6)) MERGE_DECAY=$((STEPS / 2)) NODE_BATCH=8 SEQ=256
fi
BUDGET=$((STEPS * NODES * NODE_BATCH * SEQ))  # total tokens over all nodes

# ---- data: the shipped corpus, tokenized once (95% train, 5% validation), or DATA --
if [ -n "${DATA:-}" ]; then
  for m in train val; do
    [ -f "$DATA/$m.manifest" ] || die "--data $DATA: no $m.manifest there (spes-engine tokenize writes it)"
  done
  DATA=$(cd "$DATA" && pwd)
else
  DATA=$OUT/data
fi
if [ ! -f "$DATA/val.manifest" ]; then
  "$BIN" tokenize --input "$ROOT/data/corpus/tinyshakespeare.txt" --out "$DATA" --val-fraction 0.05 >&2 ||
    die "tokenize failed"
fi

# Every run: the budget's schedule, the data, the same evals. Per-variant keys follow.
COMMON=("train.steps=$STEPS" "train.eval_every=$EVAL_EVERY" "train.eval_batches=$EVAL_BATCHES"
  "train.micro_batch=$NODE_BATCH" "model.seq_len=$SEQ" "train.device=\"$DEVICE\"" "optim.warmup_steps=$WARMUP"
  "optim.decay_steps=$STEPS" "data.train=\"$DATA/train.manifest\"" "data.validation=\"$DATA/val.manifest\""
  "checkpoint.every=0" "checkpoint.keep=1" "spes.merge_interval=$MERGE_INTERVAL"
  "spes.merge_decay_steps=$MERGE_DECAY")
# SPES as configs/tiny.toml: 4 nodes × 2 of 8 experts, the merging warm-up on; and
# the other layouts (lib.sh).
node_variants
NOWARM=("spes.merge_alpha=0")
NESTEROV=("spes.outer_optimizer=\"nesterov\"")
# DiLoCo's momentum 0.9 assumes hundreds of rounds; this budget has 12, so also a mild
# one whose first round moves about as far as averaging does (0.7 × (1 + 0.5)).
NESTEROV_MILD=("spes.outer_optimizer=\"nesterov\"" "spes.outer_lr=0.7" "spes.outer_momentum=0.5")
