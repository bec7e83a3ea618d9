#!/usr/bin/env python3
"""An independent check of the study's averaging, in PyTorch (not the engine's code).

Trains one small dense byte-level transformer five ways on the same corpus and the
same schedule, and prints each one's held-out CE as CSV (variant,final_ce,curve,wall_s;
the curve is the CE at every sixth of the steps):
  central          one worker, the 4 workers' batch (32 sequences), AdamW lr 3e-3
  central-lr-half  the same at lr 1.5e-3
  average-every-1, average-every-15
                   4 workers of 8 sequences, each its own AdamW state, parameters
                   averaged every step or every 15 steps
  solo             one worker of 8 sequences
If averaging AdamW steps every step is sound, it lands near central at a smaller lr:
each worker's Adam normalises a noisier gradient, so the averaged step is up to 2x
smaller. The study's engine runs (bench/RESULTS.md) are read against this.

  python3 bench/study/adam_average.py --train corpus/train.jsonl --heldout corpus/heldout.jsonl
(JSONL with a "text" field per line, as bench/study/python_corpus.py writes.)
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

T, D, LAYERS, HEADS = 256, 128, 4, 4


def load_bytes(path, limit):
    out = bytearray()
    with open(path) as f:
        for line in f:
            out += json.loads(line)["text"].encode() + b"\n"
            if len(out) > limit:
                break
    return torch.tensor(list(out), dtype=torch.long)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        q, k, v = self.qkv(self.n1(x)).view(x.shape[0], T, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape))
        return x + self.down(F.gelu(self.up(self.n2(x))))


class ByteLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(256, D), nn.Parameter(torch.randn(T, D) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 256)

    def forward(self, idx):
        x = self.emb(idx) + self.pos
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def sample(gen, n, data):
    at = torch.randint(0, len(data) - T - 1, (n,), generator=gen)
    return torch.stack([data[j:j + T] for j in at]), torch.stack([data[j + 1:j + T + 1] for j in at])


def lr_at(step, steps, peak):  # linear warm-up over 1/15, cosine to 0.1 of the peak
    warm = steps // 15
    if step < warm:
        return peak * (step + 1) / warm
    p = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * p)))


def train(workers, batch, peak_lr, average_every, steps, data, held_batches):
    torch.manual_seed(1234)
    start = ByteLM().state_dict()
    models = [ByteLM() for _ in range(workers)]
    for m in models:
        m.load_state_dict(start)
    opts = [torch.optim.AdamW(m.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1) for m in models]
    gens = [torch.Generator().manual_seed(1000 * w + 7) for w in range(workers)]
    curve = []
    for step in range(steps):
        for m, opt, gen in zip(models, opts, gens):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, peak_lr)
            x, y = sample(gen, batch, data)
            loss = F.cross_entropy(m(x).view(-1, 256), y.view(-1))
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        if workers > 1 and (step + 1) % average_every == 0:
            with torch.no_grad():
                for same in zip(*[m.parameters() for m in models]):
                    mean = torch.stack(same).mean(0)
                    for p in same:
                        p.copy_(mean)
        if (step + 1) % (steps // 6) == 0:
            with torch.no_grad():
                ce = [F.cross_entropy(models[0](x).view(-1, 256), y.view(-1)).item() for x, y in held_batches]
            curve.append(sum(ce) / len(ce))
    return curve


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.steps < 6:
        ap.error(f"--steps {a.steps}: expected at least 6 (the CE is taken at every sixth of the steps)")
    for flag, path in (("--train", a.train), ("--heldout", a.heldout)):
        if not os.path.isfile(path):
            ap.error(f"{flag} {path}: no such file")
    torch.set_num_threads(a.threads)
    data = load_bytes(a.train, 20_000_000)
    held = load_bytes(a.heldout, 1_000_000)
    held_batches = [sample(torch.Generator().manual_seed(99 + k), 16, held) for k in range(4)]
    runs = [("central", 1, 32, 3e-3, 1), ("central-lr-half", 1, 32, 1.5e-3, 1), ("average-every-1", 4, 8, 3e-3, 1),
            ("average-every-15", 4, 8, 3e-3, 15), ("solo", 1, 8, 3e-3, 1)]
    print("variant,final_ce,curve,wall_s")
    for name, workers, batch, lr, every in runs:
        t0 = time.time()
        curve = train(workers, batch, lr, every, a.steps, data, held_batches)
        print(f"{name},{curve[-1]:.4f},{' '.join(f'{c:.4f}' for c in curve)},{time.time() - t0:.0f}", flush=True)
        print(f"adam_average: {name} done", file=sys.stderr)


if __name__ == "__main__":
    main()
