#!/usr/bin/env bash
# The documentation explains itself and its links resolve:
#
#   - every relative markdown link [text](path) or [text](path#anchor) in README.md,
#     */README.md and bench/RESULTS.md names a file or folder that exists, and an
#     anchor names a heading of the target markdown file (GitHub's slug: lower case,
#     punctuation dropped, spaces to hyphens, "-1", "-2"… for repeated headings);
#     links inside fenced code blocks and inline code are not links;
#   - README.md stays within 500 lines (the references live in the folder READMEs);
#   - no file refers to the founders' design notes by section: they are not part of
#     the repository, so what the code relies on is written in its own READMEs.
#
# Each problem is one line, "file:line: what" (paths relative to ROOT).
#
# usage: check_docs.sh [ROOT]          check ROOT (default: this repository)
#        check_docs.sh --self-test [ROOT]
#                                      copy ROOT, plant a broken link, a broken
#                                      anchor, a section reference to the design notes
#                                      and an overlong README, and require the check
#                                      to name each
set -euo pipefail

readonly kMaxReadmeLines=500
# Spelled in two pieces so that this file does not match its own search.
readonly kOutsideRef="DESI""GN §"

root_of_script() { cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd; }

# Prints each line of a markdown file with fenced code blocks blanked (line numbers
# kept); with "spans", inline code spans are blanked too, so that only real links
# remain.
strip_code() {
  awk -v spans="${2:-}" '
    /^[[:space:]]*(```|~~~)/ { fence = !fence; print ""; next }
    fence { print ""; next }
    { if (spans != "") gsub(/`[^`]*`/, "``"); print }
  ' "$1"
}

# The GitHub anchors of a markdown file's headings, one per line.
anchors_of() {
  strip_code "$1" |
    sed -n -E 's/^#{1,6}[[:space:]]+//p' |
    sed -E 's/[[:space:]]+#+[[:space:]]*$//; s/[[:space:]]+$//; s/\[([^]]*)\]\([^)]*\)/\1/g' |
    LC_ALL=C.UTF-8 sed -E 's/.*/\L&/; s/[^[:alnum:] _-]//g; s/ /-/g' |
    awk '{ n = seen[$0]++; if (n) print $0 "-" n; else print $0 }'
}

# Prints "file:line: message" for each problem under $1; returns 1 if any.
check() {
  local root=$1 bad=0 md rel dir line target path anchor resolved lines
  local -a docs=()
  for md in "$root"/README.md "$root"/*/README.md "$root"/bench/RESULTS.md; do
    [[ -f $md ]] && docs+=("$md")
  done
  for md in "${docs[@]}"; do
    rel=${md#"$root"/}
    dir=$(dirname "$md")
    while IFS=: read -r line target; do
      target=${target#*](}
      target=${target%)}
      target=${target%% *}  # a title after the path: [text](path "title")
      case $target in
        *://* | mailto:*) continue ;;
      esac
      path=${target%%#*}
      anchor=
      [[ $target == *#* ]] && anchor=${target#*#}
      if [[ -z $path ]]; then
        resolved=$md
      else
        resolved=$dir/$path
      fi
      if [[ ! -e $resolved ]]; then
        echo "$rel:$line: link target '$path' does not exist"
        bad=1
        continue
      fi
      if [[ -n $anchor && -f $resolved && $resolved == *.md ]]; then
        if ! anchors_of "$resolved" | grep -qxF -- "$anchor"; then
          echo "$rel:$line: link '$target': no heading with anchor '#$anchor' in $(realpath -m --relative-to="$root" "$resolved")"
          bad=1
        fi
      fi
    done < <(strip_code "$md" spans | grep -noE '\]\([^)[:space:]]+( "[^"]*")?\)' || true)
  done

  if [[ -f $root/README.md ]]; then
    lines=$(wc -l < "$root/README.md")
    if ((lines > kMaxReadmeLines)); then
      echo "README.md:$lines: $lines lines; at most $kMaxReadmeLines (references belong in the folder READMEs)"
      bad=1
    fi
  fi

  local hits
  hits=$(grep -rIn --exclude-dir=.git --exclude-dir='build*' --exclude-dir=runs -F "$kOutsideRef" "$root" \
           2>/dev/null | grep -v "^$root/tests/check_docs.sh:" || true)
  if [[ -n $hits ]]; then
    while IFS= read -r h; do
      echo "${h#"$root"/}" | sed -E 's/^([^:]*:[0-9]+):.*/\1: refers to the design notes by section, which are not part of the repository; point at a README section instead/'
    done <<< "$hits"
    bad=1
  fi
  return $bad
}

self_test() {
  local root=$1 tmp out item want
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  for item in "$root"/* "$root"/.[!.]*; do
    [[ -e $item ]] || continue
    case ${item##*/} in .git | build* | runs) continue ;; esac
    cp -r "$item" "$tmp/"
  done
  printf '\nSee [the missing guide](no/such/guide.md).\n' >> "$tmp/net/README.md"
  printf '\nSee [a missing section](../README.md#no-such-section).\n' >> "$tmp/data/README.md"
  printf '// The merge, as in %s1.\n' "$kOutsideRef" >> "$tmp/model/loss.hpp"
  for _ in $(seq 1 $((kMaxReadmeLines + 1))); do echo; done >> "$tmp/README.md"
  if out=$(check "$tmp"); then
    echo "self-test: the check passed a tree with a broken link, a broken anchor, a"
    echo "reference to the design notes and an overlong README"
    return 1
  fi
  for want in \
    "net/README.md:[0-9]*: link target 'no/such/guide.md' does not exist" \
    "data/README.md:[0-9]*: link '../README.md#no-such-section': no heading with anchor '#no-such-section' in README.md" \
    "model/loss.hpp:[0-9]*: refers to the design notes by section" \
    "README.md:[0-9]*: [0-9]* lines; at most $kMaxReadmeLines"; do
    if ! grep -q -- "^$want" <<< "$out"; then
      echo "self-test: expected a problem matching '$want', got:"
      echo "$out"
      return 1
    fi
  done
  echo "self-test: the check names the planted broken link, broken anchor, design-notes"
  echo "reference and overlong README:"
  grep -E "no/such/guide|no-such-section|^model/loss.hpp:|^README.md:[0-9]+: [0-9]+ lines" <<< "$out"
}

if [[ ${1:-} == --self-test ]]; then
  self_test "${2:-$(root_of_script)}"
else
  root=${1:-$(root_of_script)}
  if check "$root"; then echo "docs: every link resolves, README.md is within $kMaxReadmeLines lines"; else exit 1; fi
fi
