#!/usr/bin/env bash
# The layering rule (README "Architecture"), checked on every #include "...":
#
#   engine/base   the ground floor: includes nothing of the project but itself
#   data          engine/base, data
#   cuda          engine/base, cuda
#   model         engine/base, model (model/gpu also cuda: the GPU model's kernels)
#   net           engine/base, net, and of model only the plain layout, owned space
#                 and merge math: model/{model_config,layout,owned_space,expert_merge}.hpp
#   engine        everything below it (it is the roof: commands, config, trainer)
#   tests, bench  anything
#
# Also: nothing in the repository refers to the design folder outside it.
#
# usage: check_layers.sh [ROOT]          check ROOT (default: this repository)
#        check_layers.sh --self-test [ROOT]
#                                        copy ROOT's code, plant a wrong include,
#                                        and require that the check fails on it
set -euo pipefail

root_of_script() { cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd; }

# Prints "file:line: message" for each violation under $1; returns 1 if any.
check() {
  local root=$1 bad=0 file rel layer allowed inc line
  while IFS= read -r file; do
    rel=${file#"$root"/}
    case $rel in
      engine/base/*) layer="engine/base"; allowed="engine/base/" ;;
      engine/*) layer="engine"; allowed="engine/ model/ cuda/ net/ data/" ;;
      data/*) layer="data"; allowed="engine/base/ data/" ;;
      cuda/*) layer="cuda"; allowed="engine/base/ cuda/" ;;
      model/gpu/*) layer="model/gpu"; allowed="engine/base/ model/ cuda/" ;;
      model/*) layer="model"; allowed="engine/base/ model/" ;;
      net/*) layer="net"
        allowed="engine/base/ net/ protocol_generated.h model/model_config.hpp model/layout.hpp model/owned_space.hpp model/expert_merge.hpp" ;;
      *) continue ;;
    esac
    while IFS=: read -r line inc; do
      inc=${inc#*\"}
      inc=${inc%%\"*}
      local ok=0 a
      for a in $allowed; do
        if [[ $a == */ ]]; then [[ $inc == "$a"* ]] && ok=1; else [[ $inc == "$a" ]] && ok=1; fi
      done
      # model (not model/gpu) must not reach into the GPU model either.
      [[ $layer == model && $inc == model/gpu/* ]] && ok=0
      if ((!ok)); then
        echo "$rel:$line: includes \"$inc\": $layer may include only: $allowed"
        bad=1
      fi
    done < <(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$file" || true)
  done < <(find "$root/engine" "$root/data" "$root/cuda" "$root/model" "$root/net" -type f \
             \( -name '*.hpp' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) | sort)
  # The design notes live beside the repository while it is built, not in it: a
  # user who clones it has no such folder.
  local outside="..""/shared"
  if grep -rIn --exclude-dir=.git --exclude-dir='build*' --exclude-dir=runs -F "$outside" "$root" \
       2>/dev/null | grep -v "^$root/tests/check_layers.sh:"; then
    echo "the lines above refer to $outside, which is not part of the repository"
    bad=1
  fi
  return $bad
}

self_test() {
  local root=$1 tmp out
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  cp -r "$root/engine" "$root/data" "$root/cuda" "$root/model" "$root/net" "$tmp/"
  check "$tmp" > /dev/null || { echo "self-test: the clean copy already fails"; return 1; }
  # The ground floor must not know the program, the model must not know the config.
  printf '#include "engine/config.hpp"\n' >> "$tmp/model/layout.hpp"
  printf '#include "net/frame.hpp"\n' >> "$tmp/engine/base/error.hpp"
  if out=$(check "$tmp"); then
    echo "self-test: the check passed a tree with wrong includes"
    return 1
  fi
  for want in 'model/layout.hpp:[0-9]*: includes "engine/config.hpp"' 'engine/base/error.hpp:[0-9]*: includes "net/frame.hpp"'; do
    if ! grep -q "$want" <<< "$out"; then
      echo "self-test: expected a violation matching '$want', got:"
      echo "$out"
      return 1
    fi
  done
  echo "self-test: the check names both planted wrong includes:"
  echo "$out"
}

if [[ ${1:-} == --self-test ]]; then
  self_test "${2:-$(root_of_script)}"
else
  root=${1:-$(root_of_script)}
  if check "$root"; then echo "layers: every include points down"; else exit 1; fi
fi
