# Runs over emulated slow links and their time to quality (sourced by
# bench/study/slow_link.sh after lib.sh and budget.sh; it sets PROXY, RATE, LINK_BPS,
# STEP_MS and SYNC). A linked run is `local`'s processes started one by one: the
# coordinator, one link_proxy listening once per node, and each node dialing its own
# link; its folder gets what run_engine leaves (train.csv with local's `node` column,
# log.txt, wall_s) and the coordinator's rounds.csv, the proxy's links.csv and load
# (the 1-minute load average at the start and the end).

# Ports apart from lib.sh's (20000-39999), for a study running beside this script.
PORT=$((10000 + ($$ % 10000)))

# CONFIG RATE: the ratio `plan CONFIG --link RATE` prices: an fp32 synchronous
# round's wire seconds over the compute per round.
plan_ratio() {
  "$BIN" plan "$1" --link "$2" | awk -F'|' '
    /s of compute per round/ { match($0, /[0-9.]+ s of compute per round/); c = substr($0, RSTART, RLENGTH) + 0 }
    $2 ~ /^ fp32 $/ && $3 ~ /^ no $/ { w = $6 + 0 }
    END { if (!(c > 0 && w > 0)) exit 1; printf "%.3f\n", w / c }'
}

# The median step_ms of a run's steps without a round or an eval, over every node.
compute_step_ms() {
  awk -F, 'NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
    $1 == "node" || $1 == "step" { next }
    $col["sync_round"] == 0 && $col["val_ce"] == "" && $col["sync_wait_ms"] + 0 == 0 { print $col["step_ms"] }' "$1" |
    sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) exit 1; print v[int((NR + 1) / 2)] }'
}

# overlap_steps that `plan --link RATE --step-ms STEP_MS` sets for CODEC overlapped
# (the steps its round's wire time takes; 0: a whole round).
planned_overlap_steps() {
  local -a args
  mapfile -d '' args < <(set_args "${COMMON[@]}" "${SPES[@]}")
  "$BIN" plan "$CONFIG" --device cpu --link "$RATE" --step-ms "$STEP_MS" "${args[@]}" 2> /dev/null |
    awk -F'|' -v c=" $1 " '$2 == c && $3 !~ /^ no $/ {
      if ($3 ~ /whole round/) print 0; else if (match($3, /[0-9]+/)) print substr($3, RSTART, RLENGTH); found = 1 }
      END { if (!found) exit 1 }' || die "plan --link $RATE has no overlapped row for $1"
}

# DIR NODES PORT ARGS...: run_engine's LAUNCH for a run through the links: `local`'s
# processes (linked_processes), each node on its share of the cores as `local` gives
# it; then the nodes' CSVs as one train.csv with local's `node` column, and their logs
# as log.txt.
launch_linked() {
  local dir=$1 nodes=$2 port=$3
  shift 3
  local threads=$(( $(nproc) / nodes > 0 ? $(nproc) / nodes : 1 ))
  linked_processes "$dir" "$nodes" "$port" "$@" --set "train.threads=$threads" || return 1
  local n
  : > "$dir/train.csv"
  for ((n = 0; n < nodes; ++n)); do
    awk -v n="$n" 'NR == 1 { if (n == 0) print "node," $0; next } { print n "," $0 }' "$dir/node-$n.csv" >> "$dir/train.csv"
  done
  cat "$dir"/node-*.log > "$dir/log.txt"
}

# DIR NODES PORT ARGS...: the proxy (links on PORT+1..PORT+NODES to the coordinator on
# PORT), the coordinator, then the nodes; waits for the nodes, then stops the other two.
# Fails (and stops what it started) when any of them fails.
linked_processes() {
  local dir=$1 nodes=$2 port=$3
  shift 3
  local -a listen=() pids=()
  local n proxy coordinator ok=1
  for ((n = 0; n < nodes; ++n)); do listen+=(--listen $((port + 1 + n))); done
  "$PROXY" --rate "$RATE" --to "$port" "${listen[@]}" > "$dir/links.csv" 2> "$dir/proxy.log" &
  proxy=$!
  wait_for "$dir/proxy.log" "ready" "$proxy" || { stop_pids "$proxy"; return 1; }
  "$BIN" coordinator "$CONFIG" --fresh "$@" --set "spes.coordinator=\"127.0.0.1:$port\"" > "$dir/rounds.csv" \
    2> "$dir/coordinator.log" &
  coordinator=$!
  wait_for "$dir/coordinator.log" "listening on" "$coordinator" || { stop_pids "$coordinator" "$proxy"; return 1; }
  for ((n = 0; n < nodes; ++n)); do
    SPES_PROGRESS=off "$BIN" train "$CONFIG" --node-id "$n" "$@" --set "spes.coordinator=\"127.0.0.1:$((port + 1 + n))\"" \
      > "$dir/node-$n.csv" 2> "$dir/node-$n.log" &
    pids+=($!)
  done
  # Every node must finish; the coordinator and the proxy must live until then.
  local left=$nodes
  while [ "$left" -gt 0 ]; do
    sleep 0.2
    left=0
    for n in "${!pids[@]}"; do
      [ -n "${pids[$n]}" ] || continue
      if kill -0 "${pids[$n]}" 2> /dev/null; then
        left=$((left + 1))
      else
        wait "${pids[$n]}" || { echo "slow_link: node $n failed in $dir" >&2; ok=0; }
        pids[$n]=
      fi
    done
    [ "$ok" = 1 ] || break
    kill -0 "$coordinator" 2> /dev/null || { echo "slow_link: the coordinator stopped early in $dir" >&2; ok=0; break; }
    kill -0 "$proxy" 2> /dev/null || { echo "slow_link: the link proxy stopped early in $dir" >&2; ok=0; break; }
  done
  # Nodes still running (a failure above): killed, since a node of a synced run answers
  # TERM only at its next round, which the stopped coordinator and proxy never bring.
  for n in "${!pids[@]}"; do [ -n "${pids[$n]}" ] && kill -KILL "${pids[$n]}" 2> /dev/null; done
  stop_pids "${pids[@]}" "$coordinator" "$proxy"
  [ "$ok" = 1 ]
}

# Waits until FILE holds TEXT (0) or PID has exited (1).
wait_for() {
  local i
  for ((i = 0; i < 600; ++i)); do
    grep -q "$2" "$1" 2> /dev/null && return 0
    kill -0 "$3" 2> /dev/null || return 1
    sleep 0.05
  done
  return 1
}

# SIGTERM to each process still running (empty ids skipped), then waits for it.
stop_pids() {
  local p
  for p in "$@"; do [ -n "$p" ] && kill -TERM "$p" 2> /dev/null || true; done
  for p in "$@"; do [ -n "$p" ] && wait "$p" 2> /dev/null || true; done
}

# LAUNCH NAME SEED OVERRIDES...: one run of a variant through the links
# (launch_linked) or not (launch_local), with the load average around it.
run_load() {
  local launch=$1 name=$2 seed=$3
  shift 3
  wanted "$name" "$seed" || return 0
  local l0
  l0=$(cut -d' ' -f1 /proc/loadavg)
  LAUNCH=$launch run_variant "$name" "$seed" "$NODES" 0 "$@"
  echo "$l0 $(cut -d' ' -f1 /proc/loadavg)" > "$OUT/runs/$name/s$seed/load"
}
run_linked() { run_load launch_linked "$@"; }
run_plain() { run_load launch_local "$@"; }

# Validation CE against wall-clock seconds: on eval steps, the latest node's
# elapsed_s (a round holds every node until the last arrives), the same with the
# run's compute at REF_MS per step instead of its own median RUN_MS (elapsed +
# step × (REF_MS − RUN_MS): the load of others' processes on a shared machine taken
# out; the waits at rounds stay measured), and the mean val_ce.
time_curve_of() {
  awk -F, -v ref="$2" -v run="$3" '
    NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
    $1 == "node" || $1 == "step" { next }
    $col["val_ce"] != "" {
      s = $col["step"]
      if (!(s in n)) order[++k] = s
      sum[s] += $col["val_ce"]; n[s]++
      if ($col["elapsed_s"] + 0 > t[s]) t[s] = $col["elapsed_s"] + 0
    }
    END { for (i = 1; i <= k; ++i) { s = order[i]; printf "%.3f,%.3f,%.6f\n", t[s], t[s] + s * (ref - run) / 1000, sum[s] / n[s] } }' "$1"
}

# The step loop's seconds at rounds per round (synchronous: the round, sync_ms;
# overlapped: its wait for a round still in flight, sync_wait_ms, as sync_ms is then
# the round's time in flight), mean over the nodes.
round_wait_s() {
  awk -F, 'NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
    $1 == "node" || $1 == "step" { next }
    { ms += $col["sync_inflight_ms"] > 0 ? $col["sync_wait_ms"] : $col["sync_ms"]; if ($col["sync_round"] > 0) rounds++ }
    END { printf "%.2f\n", rounds ? ms / rounds / 1000 : 0 }' "$1"
}

# ttq.csv (a row per run), curves_time.csv, curves_time_mean.csv, ttq.md (means over
# seeds), val_ce_time.svg. A run's time to a CE is the elapsed_s of its first eval at
# or below it; per run the target is the fp32 synchronous run's final CE at its seed,
# in ttq.md the mean of those, reached on the mean curve (CE and time of each eval
# averaged over the seeds), as the study's tables average seeds. "Within 1%": the
# first eval at or below 1.01 × the target.
write_ttq() {
  local v s
  {
    echo "variant,seed,elapsed_s,elapsed_ref_s,val_ce"
    for v in "${VARIANTS[@]}"; do
      for s in "$OUT/runs/$v"/s*; do
        time_curve_of "$s/train.csv" "$STEP_MS" "$(compute_step_ms "$s/train.csv")" | sed "s/^/$v,${s##*/s},/"
      done
    done
  } > "$OUT/curves_time.csv"
  awk -F, 'NR > 1 { k = $1 SUBSEP $2; i[k]++; key = $1 SUBSEP i[k]; if (!(key in n)) order[++m] = key
      t[key] += $3; r[key] += $4; c[key] += $5; n[key]++ }
    END { print "variant,elapsed_s,elapsed_ref_s,val_ce"
          for (j = 1; j <= m; ++j) { k = order[j]; split(k, p, SUBSEP)
            printf "%s,%.3f,%.3f,%.6f\n", p[1], t[k] / n[k], r[k] / n[k], c[k] / n[k] } }' \
    "$OUT/curves_time.csv" > "$OUT/curves_time_mean.csv"
  {
    echo "variant,seed,rate,final_val_ce,target_ce,time_to_target_s,time_to_1pct_s,wall_s,bytes_per_node_per_round,round_wait_s,step_ms,load_start,load_end"
    for v in "${VARIANTS[@]}"; do
      for s in "$OUT/runs/$v"/s*; do
        local seed=${s##*/s} target="" rate=$RATE
        [ -f "$OUT/runs/fp32/s$seed/curve.csv" ] && target=$(tail -n 1 "$OUT/runs/fp32/s$seed/curve.csv" | cut -d, -f2)
        [ -f "$s/links.csv" ] || rate=none
        printf '%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s\n' "$v" "$seed" "$rate" "$(tail -n 1 "$s/curve.csv" | cut -d, -f2)" \
          "$target" "$(time_to "$OUT/curves_time.csv" "$v,$seed," "$target" 1 3)" \
          "$(time_to "$OUT/curves_time.csv" "$v,$seed," "$target" 1.01 3)" "$(cat "$s/wall_s")" "$(cat "$s/bytes_round")" \
          "$(round_wait_s "$s/train.csv")" "$(compute_step_ms "$s/train.csv" || true)" "$(tr ' ' , < "$s/load")"
      done
    done
  } > "$OUT/ttq.csv"
  write_ttq_markdown > "$OUT/ttq.md"
  "$BIN" plot "$OUT/curves_time_mean.csv" --x elapsed_s --y val_ce --group variant --title \
    "validation CE against wall-clock seconds, every node through a $RATE link (mean of seeds $SEEDS)" \
    -o "$OUT/val_ce_time.svg"
}

# CSV PREFIX TARGET FACTOR BACK: the field BACK from the end (3: elapsed_s, 2:
# elapsed_ref_s) of the first row starting with PREFIX whose CE (the last field) is at
# most FACTOR × TARGET; "" if none.
time_to() {
  [ -n "$3" ] || return 0
  awk -F, -v p="$2" -v t="$3" -v f="$4" -v back="$5" 'index($0, p) == 1 && $NF <= t * f { print $(NF - back + 1); exit }' "$1"
}

# Means over seeds; the time to the target on the mean curve (write_ttq), as measured
# and with the compute at the rate's step time (STEP_MS).
write_ttq_markdown() {
  local target m="$OUT/curves_time_mean.csv"
  target=$(awk -F, '$1 == "fp32" { t = $NF } END { print t }' "$m")
  echo "Every node through its own link of $RATE each way (an fp32 round's wire time $(head -n 1 "$OUT/link.txt" | cut -d' ' -f2)×"
  echo "the compute per round at $STEP_MS ms per step, as spes-1b's at 100 Mbit/s); seeds $SEEDS. Target: the fp32"
  echo "synchronous run's final val CE, $target (mean of the seeds), reached on the mean curve; ×: that time over"
  echo "fp32's. \"At $STEP_MS ms/step\": each run's compute at that step time instead of its own median (the"
  echo "others' load taken out; the waits at rounds as measured)."
  echo
  echo "| variant | link | bytes/node/round | step loop at rounds, s/round | median step ms | final val CE | to target s (×) | to within 1% s (×) | at $STEP_MS ms/step: to target s (×) | to within 1% s (×) | wall s | load (1 min, lowest–highest at the runs' starts and ends) |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  # fp32's times, the denominators: to the target and within 1%, measured and at STEP_MS.
  local v k cells f t ref
  local -A fp32_time
  for k in "1 3" "1.01 3" "1 2" "1.01 2"; do
    set -- $k
    fp32_time[$k]=$(time_to "$m" "fp32," "$target" "$1" "$2")
  done
  for v in "${VARIANTS[@]}"; do
    cells=""
    for k in "1 3" "1.01 3" "1 2" "1.01 2"; do
      set -- $k
      t=$(time_to "$m" "$v," "$target" "$1" "$2")
      ref=${fp32_time[$k]}
      cells+=$(awk -v t="$t" -v f="$ref" 'BEGIN { if (t == "") printf "not reached|"; else printf "%.0f (%.2f)|", t, t / f }')
    done
    awk -F, -v v="$v" -v cells="$cells" '
      $1 == v { n++; rate = $3; ce += $4; w += $8; b += $9; rw += $10; ms += $11
        if (n == 1 || $4 < clo) clo = $4; if (n == 1 || $4 > chi) chi = $4
        for (i = 12; i <= 13; ++i) { if (n == 1 && i == 12 || $i < lo) lo = $i; if (n == 1 && i == 12 || $i > hi) hi = $i } }
      END { gsub(/\|/, " | ", cells)
            printf "| %s | %s | %.2f MB | %.1f | %.0f | %.4f ± %.4f | %s%.0f | %s–%s |\n", v, rate, b / n / 1e6, rw / n, ms / n,
              ce / n, (chi - clo) / 2, cells, w / n, lo, hi }' "$OUT/ttq.csv"
  done
}

# The table and the plot hold every variant, and the links really throttled: every
# round of each fp32 run took at least its bytes over the rate on every node, and
# each node's link carried at least the bytes its rounds counted.
check_ttq() {
  local v s bad=0
  for f in ttq.md ttq.csv val_ce_time.svg; do
    [ -s "$OUT/$f" ] || { echo "slow_link: $OUT/$f is missing or empty" >&2; bad=1; }
  done
  for v in "${VARIANTS[@]}"; do
    awk -F, -v v="$v" 'BEGIN { found = 0 } $1 == v { found = 1; if ($4 !~ /^[0-9.]+$/ || $8 !~ /^[0-9.]+$/) exit 1 }
      END { exit !found }' "$OUT/ttq.csv" || { echo "slow_link: no well-formed row for $v in ttq.csv" >&2; bad=1; }
    grep -q "| $v |" "$OUT/ttq.md" || { echo "slow_link: no row for $v in ttq.md" >&2; bad=1; }
    grep -q ">variant=$v<" "$OUT/val_ce_time.svg" || { echo "slow_link: no series $v in val_ce_time.svg" >&2; bad=1; }
  done
  awk -F, '$1 == "fp32" && $6 !~ /^[0-9.]+$/ { exit 1 }' "$OUT/ttq.csv" ||
    { echo "slow_link: fp32 has no time to its own final CE" >&2; bad=1; }
  for s in "$OUT"/runs/fp32/s*; do
    [ -d "$s" ] || continue
    awk -F, -v bps="$LINK_BPS" 'NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
      $1 == "node" || $1 == "step" || $col["sync_round"] == 0 { next }
      { wire = ($col["bytes_up"] + $col["bytes_down"]) * 8 / bps * 1000; r = $col["sync_ms"] / wire; rounds++
        if (rounds == 1 || r < worst) worst = r }
      END { printf "slow_link: fp32 rounds took %.2f× their wire time at the rate, or more (%d rounds)\n", worst, rounds > "/dev/stderr"
            exit !(rounds > 0 && worst >= 1) }' "$s/train.csv" ||
      { echo "slow_link: a round of $s was faster than its bytes over the rate: the link did not throttle it" >&2; bad=1; }
    awk -F, 'FNR == 1 { if (++f == 1) for (i = 1; i <= NF; ++i) col[$i] = i; next }
      f == 1 && $1 != "node" { up[$1] += $col["bytes_up"]; down[$1] += $col["bytes_down"] }
      f == 2 { node = FNR - 2; if ($2 < up[node] || $3 < down[node]) bad = 1; links++ }
      END { exit bad || links == 0 }' "$s/train.csv" "$s/links.csv" ||
      { echo "slow_link: a link of $s carried fewer bytes than its node's rounds counted" >&2; bad=1; }
  done
  [ "$bad" = 0 ] || exit 1
  echo "slow_link: table and plot hold every variant (${VARIANTS[*]}); the links throttled the fp32 rounds" >&2
}
