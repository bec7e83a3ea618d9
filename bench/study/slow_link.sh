#!/usr/bin/env bash
# Time to quality over a slow link (issue 32): the study's best SPES recipe
# (spes-warmup, the links table's fp32 synchronous baseline) with every node's
# connection through its own throttled link (build/link_proxy), and the wall-clock
# time each setting takes to reach the fp32 synchronous run's final validation CE.
#
#   bench/study/slow_link.sh [--smoke] [--steps N] [--seeds "S1 S2"] [--ratio R | --rate RATE]
#                            [--out DIR] [--bin SPES_ENGINE] [--proxy LINK_PROXY] [--only "VARIANT..."]
#
# The link's rate makes an fp32 round's wire time RATIO times the compute between
# rounds, RATIO being spes-1b's at 100 Mbit/s as `spes-engine plan configs/spes-1b.toml
# --link 100Mbit` prices it (wire s of an fp32 round over its compute per round):
# rate = fp32 bytes per node per round / (RATIO × sync_steps × step time), the bytes
# and the step time measured by `nolink` (the baseline without a link, run first).
# --rate fixes the rate instead (e.g. 7.5Mbit: to add seeds at an earlier run's rate).
# Variants, each through the links: fp32 (synchronous), int3, fp32-overlap, int3-overlap;
# an overlapped variant's overlap_steps is what `plan --link` sets for that link and
# step time (the steps its round's wire time takes; 0 = the next round).
# Outputs in DIR (default runs/slow-link): link.txt (ratio, step time, bytes, rate,
# the planned overlap_steps), ttq.csv (a row per run), ttq.md (means over seeds; times
# as measured and with each run's compute at the rate's step time, bench/study/link.sh),
# curves_time.csv, curves_time_mean.csv, val_ce_time.svg (validation CE against
# wall-clock seconds), runs/<variant>/s<seed>/ (each node's
# CSV and log, the coordinator's rounds.csv, the proxy's links.csv). The budget is the
# study's (bench/study/budget.sh); --smoke: its smoke budget, for CI.
# Only bash, awk, spes-engine and link_proxy.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=$ROOT/build/spes-engine
PROXY=$ROOT/build/link_proxy
OUT=$ROOT/runs/slow-link
SCALE=1
SMOKE=0
STEPS=
SEEDS=1234
DEVICE=cpu
ONLY=
RATIO=
RATE=

usage() { sed -n '7,8p' "${BASH_SOURCE[0]}" | sed 's/^# *//'; }
die() { echo "slow_link: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) SMOKE=1 ;;
    --steps) STEPS=${2:?--steps needs N}; shift ;;
    --seeds) SEEDS=${2:?--seeds needs a list}; shift ;;
    --ratio) RATIO=${2:?--ratio needs a number}; shift ;;
    --rate) RATE=${2:?--rate needs a rate such as 7.5Mbit}; shift ;;
    --out) OUT=${2:?--out needs DIR}; shift ;;
    --bin) BIN=${2:?--bin needs a path}; shift ;;
    --proxy) PROXY=${2:?--proxy needs a path}; shift ;;
    --only) ONLY=${2:?--only needs a list of variants}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "slow_link: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[ -x "$BIN" ] || die "$BIN is not an executable (build it: make engine, or pass --bin)"
[ -x "$PROXY" ] || die "$PROXY is not an executable (build it: cmake --build build --target link_proxy, or pass --proxy)"
[[ -z $RATIO || ( $RATIO =~ ^[0-9]+([.][0-9]+)?$ && $(awk -v r="$RATIO" 'BEGIN { print (r > 0) }') = 1 ) ]] ||
  die "--ratio $RATIO: expected a positive number"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
CONFIG=$ROOT/configs/tiny.toml
source "$ROOT/bench/study/lib.sh"
source "$ROOT/bench/study/budget.sh"
source "$ROOT/bench/study/link.sh"

# ---- the ratio: spes-1b's fp32 round at 100 Mbit/s over its compute per round -------
if [ -z "$RATIO" ]; then
  RATIO=$(plan_ratio "$ROOT/configs/spes-1b.toml" 100Mbit) || die "cannot read the ratio from plan configs/spes-1b.toml"
fi

# ---- the baseline without a link: its bytes and step time set the rate ---------------
echo "slow_link: $STEPS steps per run, seeds $SEEDS, ratio $RATIO, out $OUT" >&2
start=$(date +%s)
first_seed=${SEEDS%% *}
run_plain nolink "$first_seed" "${SPES[@]}"
NOLINK=$OUT/runs/nolink/s$first_seed
[ -f "$NOLINK/train.csv" ] ||
  die "no baseline run in $NOLINK: its step time sets the rate and the planned overlap_steps (leave nolink in --only)"
STEP_MS=$(compute_step_ms "$NOLINK/train.csv")
if [ -z "$RATE" ]; then
  RATE=$(awk -v b="$(cat "$NOLINK/bytes_round")" -v r="$RATIO" -v s="$SYNC" -v ms="$STEP_MS" \
    'BEGIN { printf "%.3gMbit\n", b * 8 / (r * s * ms / 1000) / 1e6 }')
fi
LINK_BPS=$("$BIN" plan "$CONFIG" --device cpu --link "$RATE" --step-ms 1 2>&1 | sed -n 's/.*Sync rounds over a \([0-9.e+]*\) \([MGk]*\)bit\/s.*/\1 \2/p' |
  awk '{ k = $2 == "G" ? 1e9 : $2 == "M" ? 1e6 : $2 == "k" ? 1e3 : 1; print $1 * k }')
[ -n "$LINK_BPS" ] || die "plan does not read the rate $RATE"
{
  echo "ratio $RATIO (plan configs/spes-1b.toml --link 100Mbit: an fp32 round's wire s over the compute per round)"
  echo "step_ms $STEP_MS (nolink seed $first_seed: median step without a round or an eval, over its nodes)"
  echo "bytes_per_node_per_round $(cat "$NOLINK/bytes_round") (nolink, fp32)"
  echo "rate $RATE ($LINK_BPS bit/s each way, per node)"
} > "$OUT/link.txt"
echo "slow_link: every node through its own link of $RATE each way" >&2

# ---- the variants through the links ---------------------------------------------------
FP32_OVERLAP=$(planned_overlap_steps fp32)
INT3_OVERLAP=$(planned_overlap_steps int3)
echo "fp32-overlap overlap_steps $FP32_OVERLAP, int3-overlap overlap_steps $INT3_OVERLAP (plan --link $RATE --step-ms $STEP_MS)" >> "$OUT/link.txt"
LINKED=(fp32 int3 fp32-overlap int3-overlap)
for seed in $SEEDS; do
  [ "$seed" = "$first_seed" ] || run_plain nolink "$seed" "${SPES[@]}"
  run_linked fp32 "$seed" "${SPES[@]}"
  run_linked int3 "$seed" "${SPES[@]}" 'spes.codec="int3"'
  run_linked fp32-overlap "$seed" "${SPES[@]}" "spes.overlap=true" "spes.overlap_steps=$FP32_OVERLAP"
  run_linked int3-overlap "$seed" "${SPES[@]}" 'spes.codec="int3"' "spes.overlap=true" "spes.overlap_steps=$INT3_OVERLAP"
done

write_ttq
echo "slow_link: done in $(( $(date +%s) - start )) s: $OUT/ttq.md, $OUT/val_ce_time.svg" >&2
check_ttq
