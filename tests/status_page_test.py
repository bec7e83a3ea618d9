#!/usr/bin/env python3
"""The coordinator's status page end to end (net/README.md, Watching a run).

A real run on this machine: `spes-engine coordinator` and two `spes-engine train`
nodes of a tiny model on the shipped corpus. Once the nodes are done, with the
coordinator still serving:

- /status.json and /metrics agree with the coordinator's rounds.csv (round,
  participants, bytes in and out, the close time, the state hash) and with each
  node's own CSV (its step, loss, validation CE and sync time at its last push, and
  its loss curve: one point per push);
- /metrics parses with the Prometheus text-format parser of `prometheus_client`
  (the oracle) into the same values;
- the page loads in headless Chromium with no console message, holds one table row
  per node, and its loss plot one SVG series per node; it refers to nothing outside
  itself (no script, no external style or font).

Without `prometheus_client` or `chromium` those checks are skipped (exit 77 after
the others passed, with the reason); any failed check exits 1.

usage: status_page_test.py SPES_ENGINE_BIN SOURCE_DIR
"""
import html.parser
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

FAILURES = []
SKIPPED = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_csv(path):
    with open(path) as f:
        lines = [l.rstrip("\n") for l in f if l.strip()]
    header = lines[0].split(",")
    return [dict(zip(header, l.split(","))) for l in lines[1:]]


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


CONFIG = """
[model]
vocab_size = 256
d_model = 32
n_layers = 1
n_heads = 2
n_kv_heads = 2
n_experts = 4
top_k = 2
expert_hidden = 32
seq_len = 32
[train]
device = "cpu"
steps = 8
micro_batch = 4
global_batch = 4
threads = 1
eval_every = 4
eval_batches = 2
[optim]
lr = 1e-2
warmup_steps = 2
decay_steps = 8
[data]
train = "{data}/train.manifest"
validation = "{data}/val.manifest"
[spes]
n_nodes = 2
sync_steps = 2
run_id = "status-test"
coordinator = "127.0.0.1:{port}"
status_bind = "127.0.0.1:0"
state_dir = "{dir}/coordinator"
round_timeout_s = 60
[checkpoint]
dir = "{dir}/checkpoints"
"""


def start_run(binary, src, work):
    data = os.path.join(work, "data")
    subprocess.run([binary, "tokenize", "--input", os.path.join(src, "data/corpus/tinyshakespeare.txt"), "--out",
                    data, "--val-fraction", "0.05"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    config = os.path.join(work, "status.toml")
    with open(config, "w") as f:
        f.write(CONFIG.format(data=data, port=free_port(), dir=work))
    coord_log = open(os.path.join(work, "coordinator.log"), "w")
    coord = subprocess.Popen([binary, "coordinator", config, "--fresh"],
                             stdout=open(os.path.join(work, "rounds.csv"), "w"), stderr=coord_log)
    url = None
    deadline = time.time() + 30
    while url is None and time.time() < deadline and coord.poll() is None:
        time.sleep(0.1)
        m = re.search(r"status page at (http://\S+/)", open(os.path.join(work, "coordinator.log")).read())
        url = m.group(1) if m else None
    if url is None:
        coord.kill()
        sys.exit("FAIL the coordinator did not log its status page URL:\n" +
                 open(os.path.join(work, "coordinator.log")).read())
    nodes = [subprocess.Popen([binary, "train", config, "--node-id", str(i)],
                              stdout=open(os.path.join(work, f"node-{i}.csv"), "w"),
                              stderr=open(os.path.join(work, f"node-{i}.log"), "w")) for i in range(2)]
    for i, n in enumerate(nodes):
        if n.wait(timeout=180) != 0:
            coord.kill()
            sys.exit(f"FAIL node {i} failed:\n" + open(os.path.join(work, f"node-{i}.log")).read())
    return coord, url


def check_json(status, rounds, node_rows):
    last = rounds[-1]
    check(status["round"] == int(last["round"]) == 4, f"round {status['round']} = rounds.csv's last ({last['round']})")
    lr = status["last_round"]
    check(lr["participants"] == int(last["participants"]), "participants agree with rounds.csv")
    check(lr["bytes_in"] == int(last["bytes_in"]) and lr["bytes_out"] == int(last["bytes_out"]),
          f"bytes in/out {lr['bytes_in']}/{lr['bytes_out']} agree with rounds.csv ({last['bytes_in']}/{last['bytes_out']})")
    check(abs(lr["close_s"] * 1000 - float(last["merge_ms"])) <= 0.006,
          f"close {lr['close_s'] * 1000:.3f} ms = rounds.csv merge_ms {last['merge_ms']}")
    check(status["state_hash"] == last["state_hash"], "state hash agrees with rounds.csv")
    check(status["step"] == int(last["step"]), "step agrees with rounds.csv")
    check(len(status["nodes"]) == 2, "two nodes")
    check(sum(n["bytes_up"] for n in status["nodes"]) <= status["bytes_in"], "per-node uploads within the total")
    check(status["state_bytes"] > 0, f"bytes on disk {status['state_bytes']} > 0")
    for node in status["nodes"]:
        rows = {int(r["step"]): r for r in node_rows[node["id"]]}
        pushes = sorted(s for s, r in rows.items() if int(r["sync_round"]) > 0)  # the steps it pushed at
        at = rows[pushes[-1]]
        evals = [s for s in sorted(rows) if rows[s]["val_ce"] and s < pushes[-1]]  # the push precedes that step's eval
        name = f"node {node['id']}"
        check(node["last_round_pushed"] == 4 and node["step"] == pushes[-1],
              f"{name}: last round pushed {node['last_round_pushed']}, at step {node['step']}")
        check(abs(node["loss"] - float(at["loss"])) <= 1e-6, f"{name}: loss {node['loss']} = its CSV's {at['loss']}")
        check(node["val_step"] == evals[-1] and abs(node["val_ce"] - float(rows[evals[-1]]["val_ce"])) <= 1e-6,
              f"{name}: val CE {node['val_ce']} at step {node['val_step']} = its CSV's")
        prev = rows[pushes[-2]]
        check(abs(node["round_latency_s"] * 1000 - float(prev["sync_ms"])) <= 0.06,
              f"{name}: round latency {node['round_latency_s'] * 1000:.1f} ms = its CSV's previous sync_ms")
        check(node["tokens_per_s"] > 0, f"{name}: tokens/s {node['tokens_per_s']:.0f} > 0")
        curve = [(s, float(rows[s]["loss"])) for s in pushes]
        check(len(node["loss_curve"]) == len(curve) and
              all(p[0] == s and abs(p[1] - l) <= 1e-6 for p, (s, l) in zip(node["loss_curve"], curve)),
              f"{name}: loss curve = its CSV's loss at each push ({len(curve)} points)")


def check_metrics(text, status, rounds):
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as e:
        SKIPPED.append(f"prometheus_client is not installed ({e}); pip install prometheus_client")
        return
    samples = {}
    families = 0
    try:
        for family in text_string_to_metric_families(text):
            families += 1
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    except Exception as e:  # the oracle refuses the text
        check(False, f"prometheus_client parses /metrics: {e}")
        return
    check(families >= 20, f"prometheus_client parsed {families} metric families")
    last = rounds[-1]
    one = lambda name, **labels: samples.get((name, tuple(sorted(labels.items()))))
    check(one("spes_round") == int(last["round"]), "spes_round = rounds.csv's last round")
    check(one("spes_round_participants") == int(last["participants"]), "spes_round_participants = rounds.csv")
    check(one("spes_round_received_bytes") == int(last["bytes_in"]), "spes_round_received_bytes = rounds.csv bytes_in")
    check(one("spes_round_sent_bytes") == int(last["bytes_out"]), "spes_round_sent_bytes = rounds.csv bytes_out")
    check(abs(one("spes_round_close_seconds") * 1000 - float(last["merge_ms"])) <= 0.006,
          "spes_round_close_seconds = rounds.csv merge_ms")
    check(one("spes_run_info", run_id="status-test", codec="fp32") == 1, "spes_run_info names the run")
    refusals = {k[1][0][1]: v for k, v in samples.items() if k[0] == "spes_refusals_total"}
    check(len(refusals) >= 15 and sum(refusals.values()) == sum(status["refusals"].values()),
          f"refusals by reason ({len(refusals)} reasons) = the JSON's")
    for node in status["nodes"]:
        n = str(node["id"])
        for metric, key in [("spes_node_loss", "loss"), ("spes_node_step", "step"), ("spes_node_val_ce", "val_ce"),
                            ("spes_node_last_round_pushed", "last_round_pushed")]:
            v = one(metric, node=n)
            check(v is not None and abs(v - node[key]) <= 1e-9 * max(1, abs(v)), f"{metric}{{node={n}}} = the JSON's")
        check(one("spes_node_received_bytes_total", node=n) == node["bytes_up"],
              f"spes_node_received_bytes_total{{node={n}}} = the JSON's")


class PageParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.rows, self.series, self.titles, self.refs = [], 0, 0, [], []
        self.scripts = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.stack.append((tag, a))
        if tag == "tr" and "node" in (a.get("class") or "").split() and self.inside("table", "nodes"):
            self.rows += 1
        if tag == "polyline" and self.inside("div", "loss-plot"):
            self.series += 1
        if tag == "script":
            self.scripts += 1
        for k in ("src", "href"):
            if k in a:
                self.refs.append(a[k])

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self.stack and self.stack[-1][0] == "title" and self.inside("div", "loss-plot") and \
                any(t == "g" for t, _ in self.stack):
            self.titles.append(data.strip())

    def inside(self, tag, ident):
        return any(t == tag and a.get("id") == ident for t, a in self.stack)


def check_page(raw, url, work):
    raw_rows = raw.count('<tr class="node"')
    check(raw_rows == 2, f"the page as served has one row per node ({raw_rows})")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        SKIPPED.append("chromium is not installed (apt-get install chromium)")
        return
    profile = tempfile.mkdtemp(dir=work)
    try:
        r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                            "--no-first-run", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                            "--dump-dom", url], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        check(False, "chromium loads the page within 120 s")
        return
    check(r.returncode == 0, f"chromium loads the page (exit {r.returncode})")
    console = [l for l in r.stderr.splitlines() if ":CONSOLE" in l]
    check(not console, "no console message" + ("".join("\n     " + l for l in console)))
    p = PageParser()
    p.feed(r.stdout)
    check(p.rows == 2, f"the DOM's node table has one row per node ({p.rows})")
    check(p.series == 2 and p.titles == ["node 0", "node 1"],
          f"the loss plot has one series per node ({p.series}: {p.titles})")
    check(p.scripts == 0, "no script")
    outside = [ref for ref in p.refs if not (ref.startswith("/") and not ref.startswith("//")) and
               not ref.startswith("data:")]
    check(not outside, f"nothing outside the page is loaded ({outside})")


def main():
    binary, src = sys.argv[1], sys.argv[2]
    work = tempfile.mkdtemp(prefix="spes-status-test-")
    coord = None
    try:
        coord, url = start_run(binary, src, work)
        print(f"status page at {url}")
        st, ctype, body = get(url + "status.json")
        check(st == 200 and ctype.startswith("application/json"), f"/status.json: {st} {ctype}")
        status = json.loads(body)
        rounds = read_csv(os.path.join(work, "rounds.csv"))
        node_rows = [read_csv(os.path.join(work, f"node-{i}.csv")) for i in range(2)]
        check_json(status, rounds, node_rows)
        st, ctype, metrics = get(url + "metrics")
        check(st == 200 and ctype.startswith("text/plain; version=0.0.4"), f"/metrics: {st} {ctype}")
        check_metrics(metrics, status, rounds)
        st, ctype, page = get(url)
        check(st == 200 and ctype.startswith("text/html"), f"/: {st} {ctype}")
        try:
            get(url + "nowhere")
            check(False, "an unknown path is 404")
        except urllib.error.HTTPError as e:
            check(e.code == 404, f"an unknown path is {e.code}")
        check_page(page, url, work)
    finally:
        if coord:
            coord.send_signal(signal.SIGTERM)
            try:
                coord.wait(timeout=20)
            except subprocess.TimeoutExpired:
                coord.kill()
        if not FAILURES:
            shutil.rmtree(work, ignore_errors=True)
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed; files in {work}")
        return 1
    if SKIPPED:
        for s in SKIPPED:
            print(f"SKIPPED (oracle): {s}")
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
