# The study's pieces (sourced by bench/study/run.sh, which sets BIN, CONFIG, OUT,
# COMMON, the budget and the variant overrides). Each run leaves in its folder:
# train.csv (the engine's stdout), log.txt (its stderr), curve.csv (tokens over all
# nodes, validation CE), wall_s, bytes_round (mean bytes up + down per node per
# sync round; empty without rounds) and opt_grad_bytes (node 0's optimizer state and
# gradients).

VARIANTS=()  # in the order they first ran
PORT=$((20000 + ($$ % 20000)))

# The overrides of the study's four node layouts, from NODES, NODE_BATCH and SYNC:
# SPES (every node its share of the experts, the merging warm-up on), ALL_EXPERTS
# (every node owning every expert, plain averaging: DiLoCo), CENTRAL (one node, the
# nodes' batch together) and SOLO (one node's batch alone).
node_variants() {
  SPES=("spes.n_nodes=$NODES" "spes.ownership=\"partitioned\"" "train.global_batch=$NODE_BATCH"
    "spes.sync_steps=$SYNC")
  ALL_EXPERTS=("spes.n_nodes=$NODES" "spes.ownership=\"all\"" "train.global_batch=$NODE_BATCH"
    "spes.sync_steps=$SYNC" "spes.merge_alpha=0")
  CENTRAL=("spes.n_nodes=1" "spes.ownership=\"all\"" "train.global_batch=$((NODES * NODE_BATCH))"
    "spes.sync_steps=0" "spes.merge_alpha=0")
  SOLO=("spes.n_nodes=1" "spes.ownership=\"all\"" "train.global_batch=$NODE_BATCH" "spes.sync_steps=0"
    "spes.merge_alpha=0")
}

# Appends --set for each override.
set_args() {
  local s
  for s in "$@"; do printf '%s\0' --set "$s"; done
}

# DIR NODES PORT ARGS...: one spes-engine train (1 node) or local (several, the
# coordinator on PORT) into DIR/train.csv, its stderr into DIR/log.txt.
launch_local() {
  local dir=$1 nodes=$2 port=$3
  shift 3
  local cmd=local
  [ "$nodes" = 1 ] && cmd=train
  "$BIN" "$cmd" "$CONFIG" "$@" --set "spes.coordinator=\"127.0.0.1:$port\"" > "$dir/train.csv" 2> "$dir/log.txt"
}

# DIR NODES OVERRIDES...: one run into DIR, started by LAUNCH (default launch_local;
# bench/study/link.sh's runs through throttled links set their own), which leaves
# train.csv and log.txt there; DIR/wall_s gets its wall time. A coordinator port
# already in use is retried on the next ones; on failure the logs' tails go to stderr.
run_engine() {
  local dir=$1 nodes=$2
  shift 2
  mkdir -p "$dir"
  local -a args
  local run_id=${dir##*/runs/}
  mapfile -d '' args < <(set_args "${COMMON[@]}" "$@" "checkpoint.dir=\"$dir/checkpoints\"" \
    "spes.state_dir=\"$dir/coordinator\"" "spes.run_id=\"study-${run_id//\//-}\"")
  local t0 attempt
  t0=$(date +%s.%N)
  for attempt in 1 2 3; do
    drop_state "$dir"           # a new run each attempt (a new run refuses an earlier one's state)
    PORT=$((PORT + nodes + 1))  # a linked run takes a port per node after the coordinator's
    if "${LAUNCH:-launch_local}" "$dir" "$nodes" "$PORT" "${args[@]}"; then
      awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f\n", b - a }' > "$dir/wall_s"
      return 0
    fi
    # A port in use, or another script's coordinator on it (ctest runs the smoke tests side by side).
    cat "$dir"/*.txt "$dir"/*.log 2> /dev/null | grep -qi "address already in use\|cannot listen\|bind\|run id mismatch" ||
      break
  done
  echo "study: the run in $dir failed; the last lines of its logs:" >&2
  tail -n 5 "$dir"/*.txt "$dir"/*.log >&2 2> /dev/null
  exit 1
}

# Validation CE against tokens over all nodes: on eval steps, the mean over the nodes'
# val_ce (identical on every node when the eval step is a sync step, as the sync
# round comes first), at tokens = this node's tokens × nodes + offset.
curve_of() {
  local csv=$1 nodes=$2 offset=$3
  awk -F, -v nodes="$nodes" -v offset="$offset" '
    NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
    $1 == "node" || $1 == "step" { next }
    $col["val_ce"] != "" {
      t = $col["tokens"] * nodes + offset
      if (!(t in n)) order[++k] = t
      sum[t] += $col["val_ce"]; n[t]++
    }
    END { for (i = 1; i <= k; ++i) printf "%d,%.6f\n", order[i], sum[order[i]] / n[order[i]] }' "$csv"
}

# Mean bytes up + down per node per sync round ("" when there were none).
bytes_per_round() {
  awk -F, '
    NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
    $1 == "node" || $1 == "step" { next }
    $col["sync_round"] > 0 { s += $col["bytes_up"] + $col["bytes_down"]; n++ }
    END { if (n) printf "%.0f\n", s / n; else print "" }' "$1"
}

# Optimizer state + gradients of node 0 in bytes: its owned parameters (the engine's
# start-up line "[node 0] ... owned N") × 12 (fp32 AdamW moments + gradients; a GPU
# node adds 4 for the fp32 master copy). `plan` reports the same categories, but in
# GiB with two decimals: all zeros at this model size.
opt_grad_bytes() {
  sed -n 's/^\[node 0\] .*owned \([0-9]*\);.*/\1/p' "$1" | head -n 1 | awk '{ printf "%.0f\n", $1 * 12 }'
}

# Whether the engine accepts these overrides (a key of another branch may be unknown
# here); prints the engine's one-line reason when it does not.
probe_keys() {
  local -a args
  mapfile -d '' args < <(set_args "${COMMON[@]}" "$@")
  local err
  if ! err=$("$BIN" plan "$CONFIG" --device cpu "${args[@]}" 2>&1 > /dev/null); then
    echo "$err" | tail -n 1
    return 1
  fi
}

remember() {
  local v
  for v in "${VARIANTS[@]}"; do [ "$v" = "$1" ] && return; done
  VARIANTS+=("$1")
}

# Whether --only names this variant (everything runs without --only). A variant left
# out keeps its earlier runs under DIR in the table.
wanted() {
  local v
  [ -z "${ONLY:-}" ] && return 0
  for v in ${ONLY//,/ }; do [ "$v" = "$1" ] && return 0; done
  [ -f "$OUT/runs/$1/s$2/curve.csv" ] && remember "$1"
  return 1
}

# The study reads only each run's CSV and log: its final checkpoint and coordinator
# state (hundreds of MB a run even at the tiny size, GBs at the GPU study's) go, so
# that a study of dozens of runs fits the disk and --out stays small enough to bring back.
drop_state() {
  local d
  for d in "$@"; do rm -rf "$d/checkpoints" "$d/coordinator"; done
}

# NAME SEED NODES OFFSET OVERRIDES...: one run of a variant, and its curve and numbers.
run_variant() {
  local name=$1 seed=$2 nodes=$3 offset=$4
  shift 4
  wanted "$name" "$seed" || return 0
  local dir=$OUT/runs/$name/s$seed
  rm -rf "$dir"
  echo "study: $name seed $seed ($nodes node(s))" >&2
  run_engine "$dir" "$nodes" "$@" "train.seed=$seed"
  curve_of "$dir/train.csv" "$nodes" "$offset" > "$dir/curve.csv"
  bytes_per_round "$dir/train.csv" > "$dir/bytes_round"
  opt_grad_bytes "$dir/log.txt" > "$dir/opt_grad_bytes"
  drop_state "$dir"
  remember "$name"
}

# (8) Dense for the first half of the budget (one node, the central batch: the same
# tokens per step), `spes-engine upcycle --noise 0.5` (SPES-9B's), then the best SPES
# variant for the second half from the upcycled checkpoint.
run_upcycled() {
  local seed=$1 half=$((STEPS / 2))
  wanted upcycled "$seed" || return 0
  local dir=$OUT/runs/upcycled/s$seed
  rm -rf "$dir"
  echo "study: upcycled seed $seed (dense $half steps, then $BEST)" >&2
  local -a dense=("${CENTRAL[@]}" "model.n_experts=1" "model.top_k=1" "train.steps=$half" "optim.decay_steps=$half"
    "train.seed=$seed")
  local -a moe=("${BEST_SETS[@]}" "train.steps=$half" "optim.decay_steps=$half" "train.seed=$seed"
    "train.init=\"$dir/moe-init\"")
  run_engine "$dir/dense" 1 "${dense[@]}"
  local -a up
  mapfile -d '' up < <(set_args "${COMMON[@]}" "${BEST_SETS[@]}" "train.seed=$seed")
  "$BIN" upcycle --checkpoint "$dir/dense/checkpoints" --config "$CONFIG" --out "$dir/moe-init" --noise 0.5 \
    "${up[@]}" 2> "$dir/upcycle.log" || { tail -n 3 "$dir/upcycle.log" >&2; die "upcycle failed in $dir"; }
  drop_state "$dir/dense"
  run_engine "$dir/moe" "$NODES" "${moe[@]}"
  drop_state "$dir/moe"
  rm -rf "$dir/moe-init"
  {
    curve_of "$dir/dense/train.csv" 1 0
    curve_of "$dir/moe/train.csv" "$NODES" $((BUDGET / 2))
  } > "$dir/curve.csv"
  awk '{ s += $1 } END { printf "%.1f\n", s }' "$dir/dense/wall_s" "$dir/moe/wall_s" > "$dir/wall_s"
  bytes_per_round "$dir/moe/train.csv" > "$dir/bytes_round"
  opt_grad_bytes "$dir/moe/log.txt" > "$dir/opt_grad_bytes"
  remember upcycled
}

# Mean over seeds of a variant's final validation CE.
final_ce() {
  local f
  for f in "$OUT/runs/$1"/s*/curve.csv; do tail -n 1 "$f"; done | awk -F, '{ s += $2; n++ } END { printf "%.6f\n", s / n }'
}

# The variant of lowest mean final CE among those with runs under DIR (spes-warmup,
# the committed study's best, when none has).
best_of() {
  local v
  {
    for v in "$@"; do
      if compgen -G "$OUT/runs/$v/s*/curve.csv" > /dev/null; then echo "$(final_ce "$v") $v"; fi
    done
    echo "inf spes-warmup"
  } | sort -g | head -n 1 | cut -d' ' -f2
}

# Whether the sweep's series (the best variant at its interval) has runs under DIR.
sweep_ran() { compgen -G "$OUT/runs/$BEST/s*/curve.csv" > /dev/null; }

# table.csv, table.md, curves.csv, curves_mean.csv and the two SVGs.
write_results() {
  local v s
  {
    echo "variant,seed,tokens,val_ce"
    for v in "${VARIANTS[@]}"; do
      for s in "$OUT/runs/$v"/s*; do sed "s/^/$v,${s##*/s},/" "$s/curve.csv"; done
    done
  } > "$OUT/curves.csv"
  awk -F, 'NR > 1 { k = $1 SUBSEP $3; if (!(k in n)) order[++m] = k; sum[k] += $4; n[k]++ }
    END { print "variant,tokens,val_ce"
          for (i = 1; i <= m; ++i) { split(order[i], p, SUBSEP); printf "%s,%s,%.6f\n", p[1], p[2], sum[order[i]] / n[order[i]] } }' \
    "$OUT/curves.csv" > "$OUT/curves_mean.csv"
  {
    echo "variant,seeds,final_val_ce,final_val_ce_spread,val_ce_quarter,val_ce_half,gap_to_central_pct,opt_grad_bytes_per_node,bytes_per_node_per_round,wall_s,tokens,tokens_per_s,gap_to_sync_pts,central_tokens_to_final"
    for v in "${VARIANTS[@]}"; do
      for s in "$OUT/runs/$v"/s*; do
        printf '%s,%s,%s,%s,%s\n' "$v" "$(tail -n 1 "$s/curve.csv" | cut -d, -f2)" \
          "$(awk -F, -v t=$((BUDGET / 4)) '$1 == t { print $2 }' "$s/curve.csv")" \
          "$(awk -F, -v t=$((BUDGET / 2)) '$1 == t { print $2 }' "$s/curve.csv")" \
          "$(cat "$s/opt_grad_bytes")|$(cat "$s/bytes_round")|$(cat "$s/wall_s")|$(tail -n 1 "$s/curve.csv" | cut -d, -f1)"
      done
    done | awk -F, -v best="${BEST:-}" -v curves="$OUT/curves_mean.csv" '
      # The tokens central took to reach CE x: linear between its eval points, the
      # first that reaches it; empty where it never does (or without central).
      function central_tokens(x,    i, t) {
        for (i = 1; i <= nc; ++i) {
          if (cv[i] > x + 5e-7) continue  # the curve is rounded to 6 decimals
          if (i == 1) return ct[1]
          t = ct[i - 1] + (ct[i] - ct[i - 1]) * (cv[i - 1] - x) / (cv[i - 1] - cv[i])
          return sprintf("%.0f", t)
        }
        return ""
      }
      BEGIN { while ((getline line < curves) > 0) { split(line, p, ","); if (p[1] == "central") { ct[++nc] = p[2]; cv[nc] = p[3] } } }
      { v = $1; if (!(v in n)) order[++m] = v; n[v]++; f[v] += $2; q[v] += $3; h[v] += $4
        if (n[v] == 1 || $2 < lo[v]) lo[v] = $2; if (n[v] == 1 || $2 > hi[v]) hi[v] = $2
        split($5, x, "|"); og[v] = x[1]; br[v] += x[2]; w[v] += x[3]; tk[v] += x[4]; hq[v] += ($3 != ""); hh[v] += ($4 != "") }
      END {
        c = ("central" in n) ? f["central"] / n["central"] : 0
        b = (best in n) ? f[best] / n[best] : 0
        ref = (c > 0) ? c : b
        for (i = 1; i <= m; ++i) {
          v = order[i]; fm = f[v] / n[v]
          quarter = (hq[v] == n[v]) ? sprintf("%.4f", q[v] / n[v]) : ""
          half = (hh[v] == n[v]) ? sprintf("%.4f", h[v] / n[v]) : ""
          gap = (c > 0) ? sprintf("%+.1f", 100 * (fm - c) / c) : ""
          round_bytes = (br[v] > 0) ? sprintf("%.0f", br[v] / n[v]) : ""
          pts = (b > 0) ? sprintf("%+.1f", 100 * (fm - b) / ref) : ""
          printf("%s,%d,%.4f,%.4f,%s,%s,%s,%s,%s,%.1f,%.0f,%.0f,%s,%s\n", v, n[v], fm, (hi[v] - lo[v]) / 2, quarter, half,
                 gap, og[v], round_bytes, w[v] / n[v], tk[v] / n[v], (w[v] > 0) ? tk[v] / w[v] : 0, pts, central_tokens(fm))
        } }'
  } > "$OUT/table.csv"
  write_markdown > "$OUT/table.md"
  "$BIN" plot "$OUT/curves_mean.csv" --x tokens --y val_ce --group variant --title \
    "validation CE against tokens (mean of seeds $SEEDS)" -o "$OUT/val_ce.svg"
  [ -n "${SWEEP:-}" ] || return 0  # no sync sweep (the GPU-scale study)
  sweep_ran || return 0             # --only without the sweep's variants under DIR
  local sync_series  # the best variant itself is the sweep's sync_steps = $SYNC
  sync_series=$(grep -E "^($BEST|$BEST-sync[0-9]+)," "$OUT/curves_mean.csv" | sed "s/^$BEST,/$BEST-sync$SYNC,/" || true)
  { echo "variant,tokens,val_ce"; echo "$sync_series"; } > "$OUT/curves_sync.csv"
  "$BIN" plot "$OUT/curves_sync.csv" --x tokens --y val_ce --group variant --title \
    "$BEST: sync interval sweep" -o "$OUT/val_ce_sync.svg"
}

write_markdown() {
  echo "Budget: $BUDGET tokens over all nodes ($STEPS steps × $NODES nodes × $NODE_BATCH × $SEQ tokens), seeds $SEEDS;"
  echo "validation CE on the same $EVAL_BATCHES held-out batches; ± is half the spread over the seeds; the gap to"
  echo "${BEST:-the best SPES variant} (fp32 synchronous rounds at the same interval) in points of central's final CE (of its own without central);"
  echo "central's tokens to it: the tokens central took to reach the variant's final CE (× the variant's own tokens),"
  echo "a measure of what the variant's tokens were worth that does not grow as the CE falls."
  echo
  echo "| variant | final val CE | CE at ¼ | CE at ½ | gap to central | gap to sync | central's tokens to it | opt+grad bytes/node | bytes/node/round | wall s | tokens | tokens/s |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  awk -F, 'NR > 1 {
    og = $8 == "" ? "-" : sprintf("%.1f MiB", $8 / 2^20); br = $9 == "" ? "-" : sprintf("%.2f MiB", $9 / 2^20)
    worth = $14 == "" ? "-" : sprintf($14 >= 1e5 ? "%.2fM (%.2f×)" : "%.0f (%.2f×)", $14 >= 1e5 ? $14 / 1e6 : $14, $14 / $11)
    printf "| %s | %s ± %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", $1, $3, $4, ($5 == "" ? "-" : $5),
      ($6 == "" ? "-" : $6), ($7 == "" ? "-" : $7 "%"), ($13 == "" ? "-" : $13), worth, og, br, $10, $11, $12 }' "$OUT/table.csv"
}

# Every variant has a row in the table and a series in val_ce.svg; the sweep plot has
# the best variant. A missing piece fails the study (and its CI smoke test).
check_results() {
  local v bad=0
  local files=(table.md table.csv val_ce.svg)
  [ -n "${SWEEP:-}" ] && sweep_ran && files+=(val_ce_sync.svg)
  for f in "${files[@]}"; do
    [ -s "$OUT/$f" ] || { echo "study: $OUT/$f is missing or empty" >&2; bad=1; }
  done
  for v in "${VARIANTS[@]}"; do
    grep -q "^$v," "$OUT/table.csv" || { echo "study: no row for $v in table.csv" >&2; bad=1; }
    grep -q "| $v |" "$OUT/table.md" || { echo "study: no row for $v in table.md" >&2; bad=1; }
    grep -q ">variant=$v<" "$OUT/val_ce.svg" || { echo "study: no series $v in val_ce.svg" >&2; bad=1; }
    awk -F, -v v="$v" '$1 == v && $3 !~ /^[0-9.]+$/ { exit 1 }' "$OUT/table.csv" ||
      { echo "study: $v has no final validation CE" >&2; bad=1; }
  done
  [ -z "${SWEEP:-}" ] || ! sweep_ran || grep -q ">variant=$BEST-sync$SYNC<" "$OUT/val_ce_sync.svg" ||
    { echo "study: no sweep series in val_ce_sync.svg" >&2; bad=1; }
  [ "$bad" = 0 ] || exit 1
  echo "study: table and plots hold every variant: ${VARIANTS[*]}" >&2
}
