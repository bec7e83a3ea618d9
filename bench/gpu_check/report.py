#!/usr/bin/env python3
"""Writes the GPU check's report.md from the logs run.sh collected.

usage: report.py LOGS_DIR REPORT.md

Standard library only: the GPU machine guarantees nothing more. Every input may be
missing or cut short (a crash, a timeout, a step skipped for time); the report then
says so instead of failing. The summary table is also printed to stdout.
"""
import csv
import html
import io
import os
import re
import statistics
import sys
from datetime import datetime, timezone

LOSS_TOL = 0.02  # final training loss, GPU vs CPU, relative
# A CPU reference cut by the budget is judged at the last step both runs logged, from
# this step on (full mode stops it at the end of the correctness phase).
MIN_CUT_STEP = 50

PASS, FAIL, SKIPPED, NA = "PASS", "FAIL", "SKIPPED", "NOT AVAILABLE"


def read(path, default=""):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return default


def kv_file(path):
    out = {}
    for line in read(path).splitlines():
        if ":" in line and not line.startswith(" "):
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip()
    return out


def last_line(text):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


def engine_error(err_text):
    """The engine's one-line error (`spes-engine: error: ...`), else stderr's last line."""
    lines = [l.strip() for l in err_text.splitlines() if l.strip()]
    for l in reversed(lines):
        if "error" in l.lower():
            return l
    return lines[-1] if lines else ""


def nccl_internal_api_errors(log):
    """How many errors a memcheck log holds when every one is a failed CUDA API call
    made by libnccl itself (the first host frame past libcuda lies in libnccl: NCCL
    probes kernels its build may lack and handles the error); 0 when any error is
    something else (an access error, or an API error of the engine's own)."""
    records, current = [], None
    for line in log.splitlines():
        body = line.strip("= ").strip()
        if re.match(r"(Program hit|Invalid|Uninitialized|Misaligned|Out-of-range|Barrier|Leaked|Race)", body):
            current = {"head": body, "frames": []}
            records.append(current)
        elif current is not None and body.startswith("Host Frame"):
            current["frames"].append(body)
    summary = re.search(r"ERROR SUMMARY: (\d+) error", log)
    if not records or not summary or int(summary.group(1)) != len(records):
        return 0
    for r in records:
        if not r["head"].startswith("Program hit") or "on CUDA API call" not in r["head"]:
            return 0
        frames = [f for f in r["frames"] if "libcuda.so" not in f]
        if not frames or "libnccl.so" not in frames[0]:
            return 0
    return len(records)


def short(text, n=300):
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def cell(text):
    return short(str(text)).replace("|", "\\|")


class Step:
    """One process run by run.sh: LOG.{cmd,out,err,rc,timeout,skipped,stopped}."""

    def __init__(self, base):
        self.base = base
        self.name = os.path.basename(base)
        rc = read(base + ".rc").split()
        self.rc = int(rc[0]) if rc else None
        self.seconds = int(rc[1]) if len(rc) > 1 else None
        self.timeout = read(base + ".timeout").strip()
        self.skipped = read(base + ".skipped").strip()
        self.stopped = read(base + ".stopped").strip()
        self.out = read(base + ".out")
        self.err = read(base + ".err")

    @property
    def ran(self):
        return self.rc is not None

    @property
    def timed_out(self):
        return self.rc in (124, 137) and not self.stopped

    def exit_text(self):
        if not self.ran:
            return self.skipped or "not run"
        if self.timed_out:
            return f"timed out after {self.timeout} s"
        if self.stopped:
            return self.stopped
        if self.rc == 0:
            return f"exit 0 in {self.seconds} s"
        if self.rc > 128:
            return f"killed by signal {self.rc - 128} after {self.seconds} s"
        return f"exit {self.rc} after {self.seconds} s"


# ---- doctest XML (tolerant of output cut short by a crash or a timeout) ------------------

REL_RE = re.compile(r"rel(?:ative)?(?: err(?:or)?)? ([-+]?(?:[0-9.]+(?:[eE][-+]?[0-9]+)?|inf|nan))\s*\(tol ([-+0-9.eE]+)\)",
                    re.IGNORECASE)


def xml_text(s):
    return html.unescape(" ".join(s.split()))


def parse_doctest_xml(text):
    cases = []
    chunks = re.split(r"(?=<TestCase )", text)
    for chunk in chunks[1:]:
        head = re.match(r'<TestCase name="([^"]*)"([^>]*?)(/?)>', chunk)
        if not head:
            continue
        fn = re.search(r'filename="([^"]*)"', head.group(2))
        c = {"name": html.unescape(head.group(1)), "file": html.unescape(fn.group(1)) if fn else "",
             "messages": [], "failures": [], "warnings": [], "exceptions": [], "status": None}
        if 'skipped="true"' in head.group(2):
            c["status"] = SKIPPED
            cases.append(c)
            continue
        for m in re.finditer(r"<Message type=\"(\w+)\"[^>]*>\s*<Text>(.*?)</Text>", chunk, re.S):
            c["messages"].append(xml_text(m.group(2)))
        for m in re.finditer(r"<Expression success=\"false\" type=\"(\w+)\"[^>]*>(.*?)</Expression>", chunk, re.S):
            body = m.group(2)
            info = re.search(r"<Info>(.*?)</Info>", body, re.S)
            orig = re.search(r"<Original>(.*?)</Original>", body, re.S)
            what = xml_text(info.group(1)) if info else f"{m.group(1)}( {xml_text(orig.group(1)) if orig else '?'} )"
            (c["warnings"] if m.group(1).startswith("WARN") else c["failures"]).append(what)
        for m in re.finditer(r"<Exception crash=\"(\w+)\">(.*?)</Exception>", chunk, re.S):
            c["exceptions"].append(("crash: " if m.group(1) == "true" else "exception: ") + xml_text(m.group(2)))
        res = re.search(r'<OverallResultsAsserts successes="(\d+)" failures="(\d+)" test_case_success="(\w+)"', chunk)
        if res:
            c["status"] = PASS if res.group(3) == "true" else FAIL
        else:
            c["status"] = "INCOMPLETE"  # the process died inside this test case
        cases.append(c)
    return cases


def worst_rel(messages):
    """(ratio, text) of the message whose rel err is the largest fraction of its tol."""
    worst = None
    for msg in messages:
        m = REL_RE.search(msg)
        if not m:
            continue
        try:
            err, tol = float(m.group(1)), float(m.group(2))
        except ValueError:
            continue
        if err != err:  # NaN
            ratio = float("inf")
        elif tol > 0:
            ratio = err / tol
        else:
            ratio = 0.0 if err == 0 else float("inf")
        if worst is None or ratio > worst[0]:
            worst = (ratio, msg)
    return worst


# ---- CSV on stdout of train / coordinator ----------------------------------------------------


def read_csv_rows(text):
    """Rows of the CSV in `text` as dicts, from its header line on (other lines ignored)."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith(("step,", "round,"))), None)
    if start is None:
        return []
    header = lines[start].split(",")
    rows = []
    for row in csv.reader(io.StringIO("\n".join(lines[start + 1:]))):
        if len(row) == len(header):
            rows.append(dict(zip(header, row)))
    return rows


def num(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def fmt(x, digits=4):
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


# ---- our benches and the PyTorch anchors, side by side ------------------------------------------

SHAPE_RE = re.compile(r"B=?(\d+) S=?(\d+) H=?(\d+) D=?(\d+)")


# ---- Nsight Compute's raw page (ncu --page raw --csv --print-units base) -------------------
# One wide row per profiled kernel after a header row and a units row (empty ID).

NCU_COLUMNS = [  # (heading, raw metric), percentages
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("tensor pipe %", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("issue slots %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("memory %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("warps active %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
]
STALL_RE = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
# What run.sh's launch window selects, in launch order (kernel names without the
# path's prefixes: the sm90a and portable kernels read alike): of layer 1, the
# attention forward and the two expert GEMMs; the 5 cross-entropy chunks; layer 1's
# backward. A different list means the window missed (ncu counted launches otherwise).
NCU_EXPECTED = ["forward", "rows", "rows", *["ce_cluster"] * 5, "rows", "wgrad", "rows", "wgrad", "dkv", "dq"]


def ncu_num(v):
    """An ncu CSV number (it may write thousands separators)."""
    return num(v.replace(",", "")) if isinstance(v, str) else None


def ncu_role(name):
    """A profiled kernel's name as NCU_EXPECTED spells it."""
    base = ncu_kernel_name(name).split("<")[0]
    return re.sub(r"^(grouped_|attention_)?(backward_)?", "", base).removesuffix("_kernel")


def ncu_kernels(text):
    """[{column: value}] of the profiled kernels, in profile order; [] when the text is
    not a raw-page export."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r and "ID" in r), None)
    if head is None:
        return []
    names = rows[head]
    at = names.index("ID")
    return [dict(zip(names, r)) for r in rows[head + 1:] if len(r) > at and r[at].strip().isdigit()]


def ncu_stalls(kernel):
    """[(reason, warp cycles per issued instruction)], largest first ("selected", the
    cycle a warp issues, is not a stall)."""
    out = []
    for k, v in kernel.items():
        m = STALL_RE.match(k)
        if m and m.group(1) != "selected" and ncu_num(v) is not None:
            out.append((m.group(1), ncu_num(v)))
    return sorted(out, key=lambda x: -x[1])


def ncu_kernel_name(name):
    """A kernel's name without its return type, namespaces and parameters (a demangled
    name's template arguments stay)."""
    name = name.replace("(anonymous namespace)::", "")
    depth = 0
    for i, c in enumerate(name):  # the parameter list: the first "(" outside <...>
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0:
            name = name[:i]
            break
    base = name.split("<")[0]  # spaces and "::" in the template arguments are the name's
    return name[base.rfind("::") + 2 if "::" in base else base.rfind(" ") + 1:]


def train_gpu_figures(text):
    """bench_train_gpu's stdout: {"path": grouped-GEMM kernels,
    "nodes": {label: {"tokens_s", "mfu", "step_ms",
                      "outside_pct" (the traced step's time outside kernels and copies)}},
    "attention": {"fwd": TFLOP/s, "bwd": TFLOP/s} of the all-experts node's kernel table, "shape": B S}."""
    out = {"path": None, "nodes": {}, "attention": {}, "shape": None}
    m = re.search(r"^grouped expert GEMMs: (.*)$", text, re.M)
    out["path"] = m.group(1).strip() if m else None
    for sec in re.split(r"^== spes-1b shape, ", text, flags=re.M)[1:]:
        label = sec.split(":", 1)[0].strip()
        node = {}
        step = re.search(r"^step: median ([\d.]+) ms .* tokens/step, ([\d.]+) tokens/s", sec, re.M)
        if step:
            node["step_ms"], node["tokens_s"] = float(step.group(1)), float(step.group(2))
        mfu = re.search(r"^MFU: ([\d.]+)%", sec, re.M)
        if mfu:
            node["mfu"] = float(mfu.group(1))
        outside = re.search(r"^time outside kernels and copies: [\d.]+ ms = ([\d.]+)% of the step", sec, re.M)
        if outside:
            node["outside_pct"] = float(outside.group(1))
        out["nodes"][label] = node
        if "all" in label and not out["attention"]:
            shape = re.search(r"micro_batch (\d+) x seq (\d+)", sec)
            out["shape"] = (int(shape.group(1)), int(shape.group(2))) if shape else None
            for d, tf in re.findall(r"^attention (fwd|bwd)\s{2,}.*?([\d.]+) TFLOP/s\s*$", sec, re.M):
                out["attention"].setdefault(d, float(tf))
    return out


def all_experts_node(fig):
    return next((v for k, v in fig["nodes"].items() if "all" in k and v.get("tokens_s")), None)


def attention_rows(text):
    """bench_attention's MHA rows: {(fwd|bwd, B, S, H, D): TFLOP/s}, the sm90a kernels' where
    the GPU ran them (what the automatic path picks there), else the portable ones'."""
    rows, sm90a = {}, set()
    for m in re.finditer(r"^attention (fwd|bwd) causal( sm90a)? D=(\d+)\s+B=(\d+) S=(\d+) H=(\d+)\s+[\d.]+\s+"
                         r"([\d.]+) TFLOP/s", text, re.M):
        d, tag, D, B, S, H, tf = m.groups()
        key = (d, int(B), int(S), int(H), int(D))
        if tag or key not in sm90a:
            rows[key] = float(tf)
        if tag:
            sm90a.add(key)
    return rows


def anchor_rows(text):
    """torch_anchors.py's CSV rows as dicts (what, shape, ms, tflops, note)."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("what,shape,")), None)
    if start is None:
        return []
    rows = []
    for r in csv.reader(io.StringIO("\n".join(lines[start + 1:]))):
        if len(r) >= 4:
            rows.append({"what": r[0], "shape": r[1], "ms": num(r[2]), "tflops": num(r[3]), "note": ",".join(r[4:])})
    return rows


def grouped_rows(text):
    """bench_grouped_gemm's CSV: {(weights, product): row}."""
    rows = {}
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith("weights,product,")), None)
    if start is None:
        return rows
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if r.get("weights") and r.get("product"):
            rows[(r["weights"], r["product"])] = r
    return rows


GROUPED_PRODUCTS = [(w, p) for w in ("gate_up", "down") for p in ("forward", "backward_input", "backward_weight")]


def grouped_flop_weighted(rows, column, otherwise=None):
    """TFLOP/s over bench_grouped_gemm's six products together (their FLOPs over the
    sum of their times) from a TFLOP/s column, or where a product has no number there,
    from the column `otherwise`; None unless every product has one."""
    flops = time = 0.0
    for key in GROUPED_PRODUCTS:
        r = rows.get(key) or {}
        f, t = num(r.get("tflop") or ""), num(r.get(column) or "")
        if otherwise and (t is None or t != t):
            t = num(r.get(otherwise) or "")
        if f is None or t is None or t != t or t <= 0:
            return None
        flops += f
        time += f / t
    return flops / time


def ratio(a, b):
    return a / b if a and b else None


def fmt_ratio(x):
    return "—" if x is None else f"{x:.2f}"


def tokens(x):
    return "—" if x is None else f"{x:,.0f} tokens/s"


def tflops(x):
    return "—" if x is None else f"{x:.1f} TFLOP/s"


# ---- sections -----------------------------------------------------------------------------------


class Report:
    def __init__(self, logs):
        self.logs = logs
        self.summary = []  # (step, status, detail)
        self.body = []

    def add(self, *lines):
        self.body.extend(lines)

    def result(self, step, status, detail):
        self.summary.append((step, status, detail))

    # -- 1a
    def tests(self):
        d = os.path.join(self.logs, "tests")
        names = sorted({f.rsplit(".", 1)[0] for f in os.listdir(d) if f.endswith(".cmd")}) if os.path.isdir(d) else []
        self.add("## 1. CUDA tests", "",
                 "Each `tests/test_cuda_*.cu` file runs as `spes_tests --gpu-file --source-file=*NAME.cu -r=xml`; "
                 "the worst error is the `rel err` message with the largest error/tolerance ratio.", "")
        counts = {PASS: 0, FAIL: 0, SKIPPED: 0, "INCOMPLETE": 0}
        files_failed, skip_reason = [], ""
        for name in names:
            s = Step(os.path.join(d, name))
            listed = [html.unescape(m) for m in re.findall(r'<TestCase name="([^"]*)"', read(os.path.join(d, name + ".list.xml")))]
            # doctest's XML also names every filtered-out test case (skipped="true"): keep this file's.
            cases = [c for c in parse_doctest_xml(s.out) if os.path.basename(c["file"]) == name + ".cu"] \
                if s.ran and s.rc != 77 else []
            if s.rc == 77:
                why = re.sub(r"^SKIPPED:\s*", "", last_line(s.out)) or "no GPU"
                skip_reason = skip_reason or why
                file_status, note = SKIPPED, why
                cases = [{"name": n, "status": SKIPPED, "messages": [], "failures": [], "warnings": [],
                          "exceptions": []} for n in listed]
            elif not s.ran:
                file_status, note = SKIPPED, s.exit_text()
                cases = [{"name": n, "status": SKIPPED, "messages": [], "failures": [], "warnings": [],
                          "exceptions": []} for n in listed]
            else:
                seen = {c["name"] for c in cases}
                for n in listed:  # cases the process never reached (crash / timeout)
                    if n not in seen:
                        cases.append({"name": n, "status": "NOT RUN", "messages": [], "failures": [],
                                      "warnings": [], "exceptions": []})
                bad = [c for c in cases if c["status"] not in (PASS, SKIPPED)]
                file_status = PASS if s.rc == 0 and not bad else FAIL
                note = s.exit_text()
                if s.rc not in (0, 1) and s.err.strip():
                    note += ": " + short(last_line(s.err), 200)
            if file_status == FAIL:
                files_failed.append(name)
            for c in cases:
                counts[c["status"] if c["status"] in counts else "INCOMPLETE"] += 1
            if extra := read(os.path.join(d, name + ".note")).strip():
                note += f"; {extra}"
            self.add(f"### {name} — {file_status} ({note})", "")
            if cases:
                self.add("| test case | result | worst error (tolerance) | notes |", "| --- | --- | --- | --- |")
                for c in cases:
                    w = worst_rel(c["messages"])
                    worst = "—" if w is None else short(w[1], 120) + (f" = {w[0]:.2g}× tol" if w[0] not in (0.0, float("inf")) else "")
                    notes = c["exceptions"] + c["failures"][:3] + [f"warning: {x}" for x in c["warnings"]]
                    if c["status"] == "INCOMPLETE":
                        notes.insert(0, "the process ended inside this test case (" + s.exit_text() + ")")
                    elif c["status"] == "NOT RUN":
                        notes.insert(0, "not reached: the process ended before it")
                    notes += [m for m in c["messages"] if not REL_RE.search(m)][:3]
                    if len(c["failures"]) > 3:
                        notes.append(f"... {len(c['failures']) - 3} more failed checks")
                    self.add(f"| {cell(c['name'])} | {c['status']} | {cell(worst)} | {cell('; '.join(notes))} |")
                self.add("")
            elif s.ran and s.rc not in (0, 77):
                self.add("```", short(s.out + s.err, 2000), "```", "")
        total = sum(counts.values())
        if not names:
            self.result("1a. CUDA tests", FAIL, "no test files ran")
        elif files_failed:
            self.result("1a. CUDA tests", FAIL, f"{len(files_failed)} of {len(names)} files failed: {', '.join(files_failed)}; "
                        f"test cases: {counts[PASS]} passed, {counts[FAIL] + counts['INCOMPLETE']} failed/incomplete of {total}")
        elif counts[PASS] == 0:
            # Without a GPU the listing holds only the files' non-GPU cases: count files.
            self.result("1a. CUDA tests", SKIPPED, f"{len(names)} test files skipped: {skip_reason}")
        else:
            self.result("1a. CUDA tests", PASS, f"{counts[PASS]} of {total} test cases passed in {len(names)} files"
                        + (f", {counts[SKIPPED]} skipped" if counts[SKIPPED] else ""))

    # -- 1b / 4
    def benches(self, cpu_only):
        d = os.path.join(self.logs, "bench")
        names = sorted({f.rsplit(".", 1)[0] for f in os.listdir(d) if f.endswith(".cmd")}) if os.path.isdir(d) else []
        with open(os.path.join(self.logs, "cpu_benches")) as f:  # run.sh's CPU_BENCHES
            cpu_names = set(f.read().split())
        names = [n for n in names if (n in cpu_names) == cpu_only]
        title = "5. CPU benches" if cpu_only else "1b. GPU benches"
        self.add(f"## {title}", "")
        if not cpu_only:
            self.add("Figures are % of ceilings each bench measures itself (D2D copy GB/s, cuBLAS bf16 GEMM TFLOP/s).", "")
        statuses = []
        for name in names:
            s = Step(os.path.join(d, name))
            if not s.ran:
                st, note = SKIPPED, s.exit_text()
            elif s.rc == 0 and re.search(r"^no GPU", s.out, re.M):
                st, note = SKIPPED, last_line(re.search(r"^no GPU.*$", s.out, re.M).group(0))
            elif s.rc == 77:  # bench_grouped_gemm: no GPU, the reason on stderr
                st, note = SKIPPED, short(re.sub(r"^\S+: ", "", last_line(s.err)) or "no GPU", 200)
            elif s.rc == 0:
                st, note = PASS, s.exit_text()
            else:
                st, note = FAIL, s.exit_text() + (": " + short(engine_error(s.err), 200) if s.err.strip() else "")
            statuses.append((name, st, note))
            self.add(f"### {name} — {st} ({note})", "")
            full = ["```", s.out.rstrip(), *(["--- stderr ---", s.err.rstrip()] if s.err.strip() else []), "```", ""]
            if len(s.out.splitlines()) <= 15:  # short: shown whole
                if s.out.strip() or s.err.strip():
                    self.add(*full)
                continue
            key = [l for l in s.out.splitlines()
                   if re.search(r"GB/s|TFLOP/s|GFLOP/s|tokens/s|%|^device:|^ceilings:|^grouped expert GEMMs:|^attention kernels:"
                             r"|^gaps by length:|^ +[\d.]+ ms at \+|^timeline: not traced|^warning:", l)]
            # bench_grouped_gemm's stderr: the L2 prefetch sweep and the SwiGLU-fused products.
            key += [l for l in s.err.splitlines() if re.search(r"k-steps asked of L2|: fused [\d.]+ ms", l)]
            if key and st == PASS:
                self.add("Key lines (GB/s, TFLOP/s, % of ceiling):", "", "```", *key, "```", "")
            self.add("<details><summary>full output</summary>", "", *full, "</details>", "")
        if not names:
            self.result(title, SKIPPED, "none in this build")
            return
        failed = [n for n, st, _ in statuses if st == FAIL]
        ran = [n for n, st, _ in statuses if st == PASS]
        if failed:
            self.result(title, FAIL, "failed: " + ", ".join(f"{n} ({note})" for n, st, note in statuses if st == FAIL))
        elif not ran:
            self.result(title, SKIPPED, f"{len(names)} benches: " + statuses[0][2])
        else:
            skipped = [f"{n} ({note})" for n, st, note in statuses if st == SKIPPED]
            mfus, outside = [], ""
            # The micro-batch runs as one CUDA graph unless its capture failed, which the
            # backend says once on stderr (the step was then timed launch by launch).
            graph = "capturing the work as a CUDA graph failed" in Step(os.path.join(d, "bench_train_gpu")).err
            for n in ("bench_train_gpu", "bench_train_gpu.portable"):
                fig = train_gpu_figures(Step(os.path.join(d, n)).out)
                node = all_experts_node(fig)
                if node and "mfu" in node:
                    mfus.append(f"{node['mfu']:.1f} % on the {(fig['path'] or '?').split(':')[0]} grouped GEMMs")
                if node and "outside_pct" in node and n == "bench_train_gpu":
                    outside = f"; outside kernels: {node['outside_pct']:.1f} % of the step (traced)"
            self.result(title, PASS, f"{len(ran)} ran"
                        + (f"; step MFU, all experts owned: {', '.join(mfus)}" if mfus else "")
                        + outside
                        + ("; the micro-batch's CUDA graph FAILED to capture (bench_train_gpu.err)" if graph else "")
                        + (f"; skipped: {', '.join(skipped)}" if skipped else ""))

    # -- 1c
    def pytorch(self):
        title = "1c. Ours beside PyTorch (same GPU)"
        self.add(f"## {title}", "")
        a = Step(os.path.join(self.logs, "torch", "anchors"))
        mode = read(os.path.join(self.logs, "mode")).strip()
        bench = {n: Step(os.path.join(self.logs, "bench", n))
                 for n in ("bench_train_gpu", "bench_train_gpu.portable", "bench_attention", "bench_grouped_gemm")}
        fig = train_gpu_figures(bench["bench_train_gpu"].out)
        figp = train_gpu_figures(bench["bench_train_gpu.portable"].out)
        rows = anchor_rows(a.out) if a.ran else []
        self.add("`bench/torch_anchors.py` times PyTorch on the same GPU (CUDA events, median of 5): SDPA with the "
                 "flash backend, dense bf16 matmuls at the grouped expert GEMMs' FLOPs and shapes, and transformers' "
                 "OlmoeForCausalLM at spes-1b's shape (bf16 autocast, fused AdamW, micro-batch 8 × 2048), eager"
                 + (" and with torch.compile" if mode == "full" else "; torch.compile in full mode only") + ". "
                 "Ours: bench_train_gpu (the step with all 16 experts owned; its per-kernel table's attention rows), "
                 "bench_attention, bench_grouped_gemm. A ratio above 1: ours is faster.", "")
        if note := read(a.base + ".note").strip():
            self.add(f"Note: {note}.", "")

        def tok_s(r):
            m = re.search(r"([\d.]+) tokens/s", r["note"]) if r else None
            return float(m.group(1)) if m else None

        eager = next((r for r in rows if "(eager)" in r["what"]), None)
        comp = next((r for r in rows if "(torch.compile)" in r["what"]), None)
        comp_why = ""
        if not comp:
            m = re.search(r"^torch\.compile (took .*|failed.*)$", a.err, re.M)
            comp_why = (m.group(1) if m else "full mode only" if mode != "full"
                        else f"torch_anchors.py timed out after {a.timeout} s" if a.timed_out else "not timed")
        table = []  # (comparison, shape, ours, theirs, ratio)
        step_ratios, mfus = [], []  # "6.75× / 6.01× (sm90a)": eager / compiled
        for f, run, src in ((fig, bench["bench_train_gpu"], "bench_train_gpu"),
                            (figp, bench["bench_train_gpu.portable"], "bench_train_gpu, SPES_GROUPED_GEMM=portable")):
            node = all_experts_node(f)
            if node is None and src != "bench_train_gpu" and not run.ran:
                continue  # the portable run is full mode's
            path = (f["path"] or "").split(":")[0].split(" (")[0]
            ours = tokens(node and node.get("tokens_s")) + (f" (MFU {node['mfu']:.1f} %)" if node and "mfu" in node else "")
            if node and "mfu" in node:
                mfus.append(f"{node['mfu']:.1f} % {path or '(path not reported)'}")
            what = f"training step, all 16 experts owned{', grouped GEMMs ' + path if path else ''} ({src})"
            xs = []
            for peer, r in (("OlmoeForCausalLM eager", eager), ("OlmoeForCausalLM torch.compile", comp)):
                theirs = tok_s(r)
                x = ratio(node and node.get("tokens_s"), theirs)
                xs.append(f"{x:.2f}×" if x is not None else "—")
                table.append((f"{what} vs {peer}", "spes-1b, micro-batch 8 × 2048",
                              ours, tokens(theirs) if theirs or r else f"— ({comp_why})" if "compile" in peer else "—",
                              fmt_ratio(x)))
            if xs != ["—", "—"]:
                step_ratios.append(" / ".join(xs) + (f" ({path})" if path else ""))
        torch_att = {}
        for r in rows:
            m = re.match(r"torch sdpa flash (fwd|bwd)", r["what"])
            sh = SHAPE_RE.search(r["shape"])
            if m and sh:
                torch_att[(m.group(1),) + tuple(int(x) for x in sh.groups())] = r["tflops"]
        ours_att = attention_rows(bench["bench_attention"].out)
        B, S = fig["shape"] or (8, 2048)
        att_ratios = []
        for shape in ((B, S, 12, 64), (8, 2048, 32, 64), (8, 2048, 16, 128)):
            spes1b = shape[2:] == (12, 64)
            for d in ("fwd", "bwd"):
                ours = fig["attention"].get(d) if spes1b else ours_att.get((d,) + shape)
                theirs = torch_att.get((d,) + shape)
                x = ratio(ours, theirs)
                if spes1b and x is not None:
                    att_ratios.append(f"{d} {x:.2f}×")
                table.append((f"attention {d}, causal ({'bench_train_gpu, the spes-1b shape' if spes1b else 'bench_attention'})"
                              f" vs SDPA flash {d}", "B{} S{} H{} D{}".format(*shape), tflops(ours), tflops(theirs),
                              fmt_ratio(x)))
        torch_mm = {}
        for r in rows:
            m = re.search(r"\((\w+) (forward|backward_input|backward_weight) as one GEMM\)", r["what"])
            if m:
                torch_mm[m.groups()] = r
        ours_mm = grouped_rows(bench["bench_grouped_gemm"].out)
        mm_ratios = {"sm90a": [], "portable": []}
        for weights in ("gate_up", "down"):
            for product in ("forward", "backward_input", "backward_weight"):
                o, t = ours_mm.get((weights, product)), torch_mm.get((weights, product))
                theirs = t["tflops"] if t else None
                shape = t["shape"] if t else "—"
                if o and t:
                    mnk = [int(x) for x in re.findall(r"\d+", t["shape"])]
                    if len(mnk) == 3 and num(o.get("tflop")):
                        flops = 2.0 * mnk[0] * mnk[1] * mnk[2] / 1e12
                        if abs(flops - num(o["tflop"])) > 0.01 * flops:
                            shape += f" (FLOPs differ: ours {o['tflop']} TFLOP, theirs {flops:.4f})"
                for path in ("sm90a", "portable"):
                    ours = num(o.get(f"{path}_tflops")) if o else None
                    ours = ours if ours == ours else None  # "nan": the device does not run this path
                    x = ratio(ours, theirs)
                    if x is not None:
                        mm_ratios[path].append(x)
                    table.append((f"grouped {weights} {product.replace('_', '-')}, {path} (bench_grouped_gemm) vs dense "
                                  "bf16 matmul, same FLOPs", shape, tflops(ours), tflops(theirs), fmt_ratio(x)))
        if any(not o.startswith("—") or not t.startswith("—") for _, _, o, t, _ in table):
            self.add("| comparison | shape | ours | PyTorch | ours / PyTorch |", "| --- | --- | --- | --- | --- |",
                     *(f"| {cell(c)} | {cell(sh)} | {cell(o)} | {cell(t)} | {x} |" for c, sh, o, t, x in table), "")
        else:
            self.add("No figure on either side: nothing to compare.", "")
        weighted = {c: grouped_flop_weighted(ours_mm, c)
                    for c in ("sm90a_tflops", "portable_tflops", "ours_even_tflops", "ours_even_half_tflops")}
        tma = [num(r.get("sm90a_tma_tflops") or "") for r in ours_mm.values()]
        has_tma = any(x is not None and x == x for x in tma)  # "nan": not run
        weighted["sm90a_tma_tflops"] = grouped_flop_weighted(ours_mm, "sm90a_tma_tflops", "sm90a_tflops") if has_tma else None
        grouped_line = ""
        if weighted["sm90a_tflops"] or weighted["portable_tflops"]:
            grouped_line = ", ".join(f"{name} {weighted[c]:.1f}" for name, c in (
                ("sm90a", "sm90a_tflops"), ("sm90a with the TMA weight gradient", "sm90a_tma_tflops"),
                ("portable", "portable_tflops"), ("ours on the even routing", "ours_even_tflops"),
                ("on the half-even one", "ours_even_half_tflops")) if weighted[c])
            self.add(f"Grouped GEMMs, the six products FLOP-weighted (the goal: 600 TFLOP/s): {grouped_line} TFLOP/s.", "")
        dense = next((r for r in rows if "8192^3" in r["what"]), None)
        if dense:
            self.add(f"PyTorch's dense bf16 matmul 8192³: {tflops(dense['tflops'])}.", "")

        parts = []
        if step_ratios:
            parts.append("step vs OLMoE eager / compiled " + ", ".join(step_ratios))
        if mfus:
            parts.append("MFU " + ", ".join(mfus))
        if att_ratios:
            parts.append("attention (spes-1b) vs SDPA flash " + ", ".join(att_ratios))
        mm = [f"{path} {min(xs):.2f}–{max(xs):.2f}×" for path, xs in mm_ratios.items() if xs]
        if mm:
            parts.append("grouped GEMMs vs dense bf16: " + ", ".join(mm))
        detail = "; ".join(parts)
        if not a.ran:
            self.result(title, SKIPPED, f"PyTorch anchors: {a.exit_text()}" + (f"; ours: {detail}" if detail else ""))
        elif a.rc == 77:
            why = re.sub(r"^torch_anchors:\s*", "", last_line(a.err)) or "no GPU"
            self.result(title, SKIPPED, f"PyTorch anchors: {why}" + (f"; ours: {detail}" if detail else ""))
        elif a.rc != 0 and not rows:
            self.add("```", short(a.out + a.err, 2000), "```", "")
            self.result(title, FAIL, f"torch_anchors.py {a.exit_text()}: {short(engine_error(a.err), 200)}")
        else:
            cut = "" if a.rc == 0 else f"torch_anchors.py {a.exit_text()} (the rows before it are kept); "
            self.result(title, PASS, cut + (detail or "no figure of ours to compare"))
        if a.out.strip() or a.err.strip():
            self.add("<details><summary>torch_anchors.py output</summary>", "", "```", a.out.rstrip(),
                     *(["--- stderr ---", a.err.rstrip()] if a.err.strip() else []), "```", "</details>", "")

    # -- 1d
    def profile(self):
        title = "1d. Kernel profile (ncu)"
        self.add(f"## {title}", "")
        s = Step(os.path.join(self.logs, "profile", "step"))
        if not s.ran:
            self.add(f"Not run: {s.exit_text()}.", "")
            self.result(title, SKIPPED, s.exit_text())
            return
        kernels = ncu_kernels(read(s.base + ".raw.csv"))
        self.add("Counters of the step's heaviest kernels, read by Nsight Compute's replays: not timings (each "
                 "duration is one replay's, caches flushed). Stalls: warp cycles per issued instruction by "
                 "reason, largest first. The details page (with the profiler's advice) and the stall samples "
                 "per SASS instruction are in `logs.tar.gz`: `profile/step.details.txt`, `profile/step.source.csv`.",
                 "")
        if not kernels:
            # ncu writes its own errors (==ERROR==) to stdout, the program's to stderr.
            errors = [l for l in s.out.splitlines() if l.startswith("==ERROR==")]
            said = errors[-1] if errors else last_line(s.err)
            why = s.exit_text() + (": " + short(said, 200) if said else "")
            self.add(f"No profiled kernels ({why}).", "")
            self.result(title, FAIL, f"no profiled kernels ({why})")
            return
        cols = [(h, m) for h, m in NCU_COLUMNS if any(m in k for k in kernels)]
        self.add("| # | kernel | grid | µs | " + " | ".join(h for h, _ in cols) + " | stalls |",
                 "| --- " * (5 + len(cols)) + "|")
        for i, k in enumerate(kernels):
            dur = ncu_num(k.get("gpu__time_duration.sum", ""))
            stalls = ncu_stalls(k)
            total = sum(v for _, v in stalls)
            top = ", ".join(f"{r} {v:.1f} ({100 * v / total:.0f} %)" for r, v in stalls[:3]) if total > 0 else "—"
            vals = [f"{ncu_num(k[m]):.1f}" if ncu_num(k.get(m, "")) is not None else "—" for _, m in cols]
            self.add(f"| {i + 1} | {cell(ncu_kernel_name(k.get('Kernel Name', '?')))} | {cell(k.get('Grid Size', ''))} | "
                     f"{f'{dur / 1e3:.1f}' if dur is not None else '—'} | " + " | ".join(vals) + f" | {cell(top)} |")
        self.add("")
        roles = [ncu_role(k.get("Kernel Name", "")) for k in kernels]
        if roles != NCU_EXPECTED:
            self.add(f"**Not the kernels run.sh meant to select**: got {', '.join(roles)}; expected "
                     f"{', '.join(NCU_EXPECTED)} (PROFILE_SKIP / PROFILE_COUNT in run.sh).", "")
        ok = s.rc == 0 and roles == NCU_EXPECTED
        self.result(title, PASS if ok else FAIL, f"{len(kernels)} kernels profiled ({s.exit_text()})"
                    + ("" if roles == NCU_EXPECTED else "; not the kernels meant: " + ", ".join(roles)))

    # -- 4
    def sanitize(self):
        title = "4. compute-sanitizer"
        self.add(f"## {title}", "")
        d = os.path.join(self.logs, "sanitize")
        tool = read(os.path.join(d, "tool")).strip()
        why = read(os.path.join(d, "skipped")).strip()
        if why:
            self.add(f"Not run: {why}.", "")
            self.result(title, SKIPPED, why)
            return
        if not tool or tool == "not found":
            self.add("compute-sanitizer was not found on this machine.", "")
            self.result(title, SKIPPED, "compute-sanitizer not found")
            return
        bases = sorted({f.rsplit(".", 1)[0] for f in os.listdir(d) if f.endswith(".cmd")})
        self.add(f"`{tool}` over the CUDA test files (memcheck: out-of-bounds and misaligned accesses, "
                 "API errors; racecheck, on the kernel files only: shared-memory hazards). test_gpu_step runs without its 300-step "
                 "and resume cases.", "")
        if not bases:
            self.add("Nothing ran: every test file was skipped, or no time was left.", "")
            self.result(title, SKIPPED, "no test file ran under the sanitizer")
            return
        self.add("| test file | tool | result | summary |", "| --- | --- | --- | --- |")
        dirty, clean, other, details = [], [], [], []
        for base in bases:
            s = Step(os.path.join(d, base))
            name, tool_name = base.rsplit(".", 1)
            log = read(os.path.join(d, base + ".log"))
            summary = next((l.strip("= ").strip() for l in log.splitlines()
                            if re.search(r"(ERROR|RACECHECK) SUMMARY", l)), "")
            nccl_errors = nccl_internal_api_errors(log) if s.rc == 86 else 0
            if nccl_errors:
                st = PASS
                clean.append(base)
                summary = (f"{summary}: all {nccl_errors} are API errors inside libnccl (its start-up "
                           "probing kernels its build lacks), none from the engine")
            elif s.rc == 86:
                st = FAIL
                dirty.append(base)
                first = [l for l in log.splitlines() if l.startswith("=========")][:40]
                details += [f"### {name} under {tool_name}", "", "```", *first, "```", ""]
            elif s.rc == 0:
                st = PASS
                clean.append(base)
            else:
                st = SKIPPED if not s.ran else "TIMED OUT" if s.timed_out else "TESTS FAILED"
                other.append(f"{base}: {s.exit_text()}")
            self.add(f"| {name} | {tool_name} | {st} ({s.exit_text()}) | {cell(summary or '—')} |")
        self.add("", *details)
        if dirty:
            self.result(title, FAIL, f"errors in {', '.join(dirty)}; clean: {len(clean)}")
        elif clean:
            self.result(title, PASS, f"{len(clean)} runs clean" + (f"; {'; '.join(other)}" if other else ""))
        else:
            self.result(title, SKIPPED, "; ".join(other))

    # -- arena guards
    def guards(self):
        title = "4a. arena guards"
        self.add(f"## {title}", "")
        self.add("A planted kernel write one float past an arena buffer (test_cuda_core, `*planted*`): the arena's "
                 "guard must catch it, and memcheck must report it (it sees inside the arena's one cudaMalloc only "
                 "through the buffers the arena registers with NVTX).", "")
        d = os.path.join(self.logs, "guard")
        plain, mem = Step(os.path.join(d, "plain")), Step(os.path.join(d, "memcheck"))
        seen = re.search(r"Invalid __global__ \w+ of size \d+ bytes", read(os.path.join(d, "memcheck.log")))
        self.add(f"- guard check: {plain.exit_text()}" + (" — caught" if plain.rc == 0 else ""),
                 f"- memcheck: {mem.exit_text()}" + (f" — `{seen.group(0)}`" if seen else ""), "")
        notes, st = [], PASS
        # doctest exits 0 when the filter matches no test: the one case must have run.
        one_ran = re.search(r"test cases:\s*1 \|\s*1 passed", plain.out)
        if plain.rc == 0 and one_ran:
            notes.append("guard caught it")
        elif plain.rc == 0:
            st = FAIL
            notes.append("the planted test case did not run (no test matched)")
        elif plain.rc == 77:
            st = SKIPPED
            notes.append("no GPU")
        else:
            st = FAIL if plain.ran else SKIPPED
            notes.append(f"guard check {plain.exit_text()}")
        if mem.rc == 86 and seen:
            notes.append("memcheck reported it")
        elif mem.rc == 77 or mem.skipped == "no GPU" or (not mem.ran and plain.rc == 77):
            notes.append("memcheck: no GPU")
        elif mem.ran:
            st = FAIL
            notes.append(f"memcheck did not report it ({mem.exit_text()}): its clean runs say nothing of "
                         "overruns between arena buffers")
        else:
            notes.append(f"memcheck not run: {mem.exit_text()}")
        self.result(title, st, "; ".join(notes))

    # -- per-kernel share
    def kernel_share(self):
        self.add("## Per-kernel share of the GPU training step", "")
        s = Step(os.path.join(self.logs, "bench", "bench_train_gpu"))
        if not os.path.exists(s.base + ".cmd"):
            self.add("Not available: this build has no `bench_train_gpu`.", "")
            return
        lines = [l for l in s.out.splitlines() if "%" in l]
        if s.rc == 0 and lines:
            self.add("From `bench_train_gpu` (full output in section 1b):", "", "```", *lines, "```", "")
        else:
            self.add(f"`bench_train_gpu`: {s.exit_text()}; no per-kernel lines.", "")

    # -- 2
    def train_compare(self):
        title = "2. GPU vs CPU training (tiny-central)"
        self.add(f"## {title}", "")
        g = Step(os.path.join(self.logs, "train", "gpu"))
        c = Step(os.path.join(self.logs, "train", "cpu"))
        gr, cr = read_csv_rows(g.out), read_csv_rows(c.out)
        self.add(f"- GPU run: {g.exit_text()}, {len(gr)} steps logged", f"- CPU run: {c.exit_text()}, {len(cr)} steps logged", "")
        if not g.ran and g.skipped:
            self.add(f"Not run: {g.skipped}.", "")
            self.result(title, SKIPPED, g.skipped)
            return
        if not g.ran or (g.rc != 0 and not gr):
            err = engine_error(g.err) if g.ran else g.exit_text()
            st = NA if "not built yet" in err or "not available" in err.lower() else FAIL
            self.add(f"The GPU run stopped before its first step: `{err}`", "")
            self.result(title, st, f"GPU run: {err}")
            return
        gpu, cpu = {r["step"]: r for r in gr}, {r["step"]: r for r in cr}
        common = sorted((int(s) for s in gpu if s in cpu), key=int)
        # Throughput of the GPU step (first steps excluded: warm-up, plan caches).
        tps = [num(r.get("tokens_per_s")) for r in gr[5:] or gr]
        tps = [x for x in tps if x]
        mfu = [num(r.get("mfu")) for r in gr[5:] or gr if "mfu" in r]
        mfu = [x for x in mfu if x is not None]
        ctps = [x for x in (num(r.get("tokens_per_s")) for r in cr[5:] or cr) if x]
        self.add("| | GPU | CPU |", "| --- | --- | --- |",
                 f"| tokens/s (median, steps > 5) | {fmt(statistics.median(tps), 0) if tps else '—'} | "
                 f"{fmt(statistics.median(ctps), 0) if ctps else '—'} |",
                 f"| MFU (median) | {fmt(statistics.median(mfu), 4) if mfu else ('no mfu column' if gr and 'mfu' not in gr[0] else '—')} | |",
                 f"| wall time | {g.seconds} s | {c.seconds} s |", "")
        if not common:
            self.add("No step logged by both runs.", "")
            why = engine_error(c.err) if c.ran and c.rc else "no common steps"
            self.result(title, FAIL, f"GPU {g.exit_text()}, CPU {c.exit_text()}: {why}")
            return
        last = common[-1]
        points = sorted({p for p in (1, 10, 25, 50, 100, 150, 200, 250, 300) if p in common} | {last})
        self.add("| step | loss GPU | loss CPU | rel diff | ce GPU | ce CPU | val_ce GPU | val_ce CPU |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |")
        for p in points:
            a, b = gpu[str(p)], cpu[str(p)]
            la, lb = num(a.get("loss")), num(b.get("loss"))
            rel = abs(la - lb) / abs(lb) if la is not None and lb else None
            self.add(f"| {p} | {fmt(la)} | {fmt(lb)} | {fmt(rel * 100 if rel is not None else None, 2)}% | "
                     f"{fmt(num(a.get('ce')))} | {fmt(num(b.get('ce')))} | {a.get('val_ce') or '—'} | {b.get('val_ce') or '—'} |")
        self.add("")
        la, lb = num(gpu[str(last)].get("loss")), num(cpu[str(last)].get("loss"))
        rel = abs(la - lb) / abs(lb) if la is not None and lb else float("inf")
        vals = [s for s in common if gpu[str(s)].get("val_ce") and cpu[str(s)].get("val_ce")]
        vnote = ""
        if vals:
            va, vb = num(gpu[str(vals[-1])]["val_ce"]), num(cpu[str(vals[-1])]["val_ce"])
            vnote = f"; val CE at step {vals[-1]}: GPU {fmt(va)}, CPU {fmt(vb)} ({abs(va - vb) / vb * 100:.2f}%)"
        complete = g.rc == 0 and c.rc == 0
        if g.rc == 0 and c.timed_out and last >= MIN_CUT_STEP:
            # The slower CPU run was cut by the time budget: judge at the last common step.
            complete = True
            detail_cut = f"CPU run cut by its timeout at step {last}; "
        else:
            detail_cut = ""
        detail = detail_cut + (f"final loss at step {last}: GPU {fmt(la)}, CPU {fmt(lb)}, diff {rel * 100:.2f}% "
                  f"(tolerance {LOSS_TOL * 100:.0f}%){vnote}")
        self.add(detail + ".", "")
        if tps:
            detail += f"; GPU {statistics.median(tps):.0f} tokens/s" + (f", MFU {statistics.median(mfu):.3f}" if mfu else "")
        if not complete:
            self.result(title, FAIL, f"GPU {g.exit_text()}, CPU {c.exit_text()}; " + detail)
        else:
            self.result(title, PASS if rel <= LOSS_TOL else FAIL, detail)

    # -- 3
    def spes_round(self):
        title = "3. Mixed SPES run (node 0 GPU, nodes 1-3 CPU)"
        self.add(f"## {title}", "")
        d = os.path.join(self.logs, "spes")
        co = Step(os.path.join(d, "coordinator"))
        nodes = [Step(os.path.join(d, f"node{n}")) for n in range(4)]
        for s in [co] + nodes:
            self.add(f"- {s.name}: {s.exit_text()}" + (f" — `{engine_error(s.err)}`" if s.ran and s.rc not in (0, None) and not s.stopped and s.err.strip() else ""))
        self.add("")
        if not co.ran:
            self.result(title, SKIPPED if co.skipped else FAIL, co.exit_text())
            return
        n0 = nodes[0]
        if n0.ran and n0.rc != 0 and not n0.stopped and not read_csv_rows(n0.out):
            err = engine_error(n0.err)
            st = NA if "not built yet" in err or "not available" in err.lower() else FAIL
            self.result(title, st, f"node 0 (GPU): {err}")
            return
        bad = [s for s in nodes if not s.ran or s.rc != 0]
        crow = read_csv_rows(co.out)
        rounds = {}
        for r in crow:
            rounds.setdefault(r["round"], {})["coordinator"] = r.get("state_hash", "")
            rounds[r["round"]]["step"] = r.get("step", "")
        tps = []
        for n, s in enumerate(nodes):
            rows = read_csv_rows(s.out)
            t = [x for x in (num(r.get("tokens_per_s")) for r in rows[5:]) if x]
            tps.append(statistics.median(t) if t else None)
            for r in rows:
                if r.get("sync_round") not in (None, "", "0"):
                    rounds.setdefault(r["sync_round"], {})[f"node{n}"] = r.get("state_hash", "")
        self.add("| round | step | coordinator | node 0 (GPU) | node 1 | node 2 | node 3 | agree |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |")
        disagree = []
        for rnd in sorted(rounds, key=lambda x: int(x) if x.isdigit() else 0):
            h = rounds[rnd]
            hs = [h.get(k, "") for k in ("coordinator", "node0", "node1", "node2", "node3")]
            ok = all(hs) and len(set(hs)) == 1
            if not ok:
                disagree.append(rnd)
            self.add(f"| {rnd} | {h.get('step', '')} | " + " | ".join(x or "missing" for x in hs) + f" | {'yes' if ok else 'NO'} |")
        self.add("", "Median tokens/s per node: " + ", ".join(f"node {n} {fmt(t, 0)}" for n, t in enumerate(tps)), "")
        if bad:
            self.result(title, FAIL, "; ".join(f"{s.name}: {s.exit_text()}" + (f" ({engine_error(s.err)})" if s.ran and s.err.strip() and not s.stopped else "") for s in bad))
        elif not rounds:
            self.result(title, FAIL, "no sync round logged")
        elif disagree:
            self.result(title, FAIL, f"state hashes differ or are missing in rounds {', '.join(disagree)}")
        else:
            self.result(title, PASS, f"{len(rounds)} rounds, every state hash equal on the coordinator and the 4 nodes")


QUICK_LEAVES_OUT = ("compute-sanitizer, the 300-step GPU-vs-CPU comparison and test_gpu_step's 300-step case, "
                    "the mixed SPES run, torch.compile in the PyTorch anchors, bench_train_gpu on the portable "
                    "grouped GEMMs, the CPU benches")


def cut_for_time(logs):
    """(steps skipped because the budget was used up, steps ended by their timeout), as paths under logs/."""
    skipped, timed_out = [], []
    for root, _, files in os.walk(logs):
        for f in sorted(files):
            base = os.path.join(root, f.rsplit(".", 1)[0])
            name = os.path.relpath(base, logs)
            if f.endswith(".skipped") and read(base + ".skipped").startswith("out of time"):
                skipped.append(name)
            elif f.endswith(".rc"):
                st = Step(base)
                if st.timed_out:
                    timed_out.append(f"{name} (after {st.timeout} s)")
    return sorted(skipped), sorted(timed_out)


def mode_lines(logs):
    mode = read(os.path.join(logs, "mode")).strip() or "?"
    budget = read(os.path.join(logs, "budget_s")).strip() or "?"
    skipped, timed_out = cut_for_time(logs)
    lines = [f"- **mode**: {mode} (budget {budget} s)"
             + (f"; full mode only (`run.sh --full`): {QUICK_LEAVES_OUT}" if mode == "quick" else "")]
    lines.append("- **skipped for time**: " + (", ".join(skipped) if skipped else "nothing"))
    if timed_out:
        lines.append("- **ended by a timeout**: " + ", ".join(timed_out))
    return lines


def main():
    logs, out_path = sys.argv[1], sys.argv[2]
    info = kv_file(os.path.join(logs, "BUNDLE_INFO"))
    host = kv_file(os.path.join(logs, "env", "host.txt"))
    gpus = list(csv.reader(io.StringIO(read(os.path.join(logs, "env", "gpus.csv")))))
    smi = read(os.path.join(logs, "env", "nvidia-smi.txt"))
    cuda_ver = re.search(r"CUDA Version:\s*([0-9.]+)", smi)
    libs = read(os.path.join(logs, "env", "libs.txt"))
    ldd = read(os.path.join(logs, "env", "ldd.txt"))

    r = Report(logs)
    missing = sorted({l.split()[0] for l in ldd.splitlines() if "not found" in l})
    if missing:
        r.result("0. libraries", FAIL, "not found: " + ", ".join(missing))
    elif not ldd.strip():
        r.result("0. libraries", FAIL, "no binaries unpacked")
    else:
        found = [re.sub(r" => .*\((.*)\)$", r" → \1", l) for l in libs.splitlines() if "=>" in l]
        r.result("0. libraries", PASS, "; ".join(found) or "none needed")
    r.tests()
    r.benches(cpu_only=False)
    r.pytorch()
    r.profile()
    r.train_compare()
    r.spes_round()
    r.guards()
    r.sanitize()
    r.benches(cpu_only=True)
    r.kernel_share()

    if len(gpus) > 1:
        hdr = [h.strip() for h in gpus[0]]
        devs = [dict(zip(hdr, (x.strip() for x in row))) for row in gpus[1:] if row]
        dev = "; ".join(f"{g.get('name', '?')} ({g.get('memory.total [MiB]', '?')} MiB, sm {g.get('compute_cap', '?')})" for g in devs)
        driver = devs[0].get("driver_version", "?")
    else:
        dev, driver = "no NVIDIA GPU found (" + short(smi or "nvidia-smi not run", 120) + ")", "—"
    elapsed = read(os.path.join(logs, "elapsed_s")).strip()

    head = [
        "# spes-engine GPU check",
        "",
        f"- **device**: {dev}",
        f"- **driver**: {driver}; CUDA (driver API) {cuda_ver.group(1) if cuda_ver else '—'}; "
        f"built with CUDA {info.get('cuda_toolkit', '?')} for sm_{info.get('cuda_archs', '?')}, cudart static",
        f"- **host**: {host.get('cpu', '?')}, {host.get('memory', '?')}, {host.get('host', '?')}",
        f"- **commit**: {info.get('commit', '?')} — {info.get('commit_subject', '')}",
        f"- **date**: {host.get('date') or datetime.now(timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')}; "
        f"check took {elapsed or '?'} s; bundle built {info.get('built', '?')}",
        *mode_lines(logs),
        "",
        "## Summary",
        "",
        "| step | result | detail |",
        "| --- | --- | --- |",
    ]
    device = read(os.path.join(logs, "env", "gpu_device")).strip()
    if device and device != "cuda":
        head[-5:-5] = ["", f"**Rehearsal**: the \"GPU\" runs of steps 2 and 3 used `train.device = \"{device}\"` "
                       "(SPES_CHECK_GPU_DEVICE)."]
    head += [f"| {s} | **{st}** | {cell(d)} |" for s, st, d in r.summary]
    head.append("")
    tail = ["## Logs", "", "`logs.tar.gz` next to this file: `run.log` (the script's progress), `env/` (nvidia-smi, "
            "the libraries found, ldd of every binary), `tests/NAME.out` (doctest XML), `bench/`, `torch/` (the PyTorch "
            "anchors), `train/`, `spes/` (stdout CSV and stderr of every process), `profile/` (Nsight Compute's "
            "exports), `guard/` (the planted overrun), `sanitize/` (compute-sanitizer logs).", ""]
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("\n".join(head + r.body + tail) + "\n")
    width = max(len(s) for s, _, _ in r.summary)
    print("summary:")
    for s, st, d in r.summary:
        print(f"  {s:<{width}}  {st:<13}  {short(d, 160)}")


if __name__ == "__main__":
    main()
