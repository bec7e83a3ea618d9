#!/usr/bin/env python3
"""The GPU-scale study's corpus: the Python sources of this machine's own Python
installation (its standard library and every site-packages folder), as JSONL.

    python_corpus.py OUT_DIR [--heldout-percent P] [--max-mb M]

Writes OUT_DIR/train.jsonl and OUT_DIR/heldout.jsonl (one {"text": ...} document per
.py file) and OUT_DIR/corpus.csv (split, files, bytes). A file is held out when the
first 8 hex digits of the SHA-256 of its real path, as a number, mod 100 fall below P
(default 2): the split is fixed by the path alone, so no held-out file is ever trained
on, whatever else the machine holds. Files are read in sorted path order under each
root; a file reached twice (a root inside another, symlinks) counts once; files that
are not UTF-8 are skipped and counted. --max-mb stops once the training split holds
M MiB (the CPU rehearsal).

Why Python sources: a machine that can download nothing still holds hundreds of MB of
real, varied text there, the same on every machine with the same packages.
"""
import argparse
import hashlib
import json
import os
import site
import sys
import sysconfig


def roots():
    paths = sysconfig.get_paths()
    found = [paths.get("stdlib"), paths.get("purelib"), paths.get("platlib")]
    found += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    found.append(site.getusersitepackages())
    seen, out = set(), []
    for r in found:
        if r and os.path.isdir(r):
            real = os.path.realpath(r)
            if real not in seen:
                seen.add(real)
                out.append(real)
    return sorted(out)


def python_files(root):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def heldout(real_path, percent):
    return int(hashlib.sha256(real_path.encode("utf-8", "surrogateescape")).hexdigest()[:8], 16) % 100 < percent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--heldout-percent", type=int, default=2)
    ap.add_argument("--max-mb", type=float, default=0.0)
    a = ap.parse_args()
    if not 0 < a.heldout_percent < 100:
        sys.exit(f"python_corpus: --heldout-percent {a.heldout_percent}: expected 1..99")
    os.makedirs(a.out_dir, exist_ok=True)
    limit = int(a.max_mb * 2**20)
    counts = {"train": [0, 0], "heldout": [0, 0], "skipped_not_utf8": [0, 0]}
    seen = set()
    outs = {s: open(os.path.join(a.out_dir, s + ".jsonl.partial"), "w", encoding="utf-8") for s in ("train", "heldout")}
    done = False
    for root in roots():
        for path in python_files(root):
            real = os.path.realpath(path)
            if real in seen or not os.path.isfile(real):
                continue
            seen.add(real)
            with open(real, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                counts["skipped_not_utf8"][0] += 1
                counts["skipped_not_utf8"][1] += len(raw)
                continue
            split = "heldout" if heldout(real, a.heldout_percent) else "train"
            outs[split].write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            counts[split][0] += 1
            counts[split][1] += len(raw)
            if limit and counts["train"][1] >= limit and counts["heldout"][0] > 0:
                done = True
                break
        if done:
            break
    for s, f in outs.items():
        f.close()
        os.replace(f.name, os.path.join(a.out_dir, s + ".jsonl"))
    if counts["train"][0] == 0 or counts["heldout"][0] == 0:
        sys.exit(f"python_corpus: too few .py files under {roots()}: {counts}")
    with open(os.path.join(a.out_dir, "corpus.csv"), "w") as f:
        f.write("split,files,bytes\n")
        for s, (n, b) in counts.items():
            f.write(f"{s},{n},{b}\n")
    print(f"python_corpus: roots {roots()}", file=sys.stderr)
    for s, (n, b) in counts.items():
        print(f"python_corpus: {s}: {n} files, {b / 2**20:.1f} MiB", file=sys.stderr)


if __name__ == "__main__":
    main()
