#!/usr/bin/env python3
"""One-off oracle for model/safetensors and model/hf_export (not run by ctest).

Checks our files against the official `safetensors` package, and, when torch and
transformers are installed, that `OlmoeForCausalLM.from_pretrained` loads our
export with no missing/unexpected/mismatched keys and computes the same logits as
our CPU forward.

    pip install safetensors numpy            # required
    pip install torch transformers           # optional: the HF loading check
    cmake --build build --target spes_core
    python3 tests/oracles/check_safetensors.py [--build build]

Names and shapes are derived here, independently, from config.json and the
flat-buffer order of model/layout.hpp (shared block, then expert-major blocks).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file as np_save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def build_fixtures(build_dir, out):
    lib = os.path.join(build_dir, "libspes_core.a")
    if not os.path.exists(lib):
        sys.exit(f"{lib} missing: cmake --build {build_dir} --target spes_core first")
    cmd = ["g++", "-std=c++20", "-O2", "-march=x86-64-v3", "-fopenmp", "-I", ROOT,
           os.path.join(ROOT, "tests/oracles/fixtures.cpp"), lib,
           "/usr/lib/x86_64-linux-gnu/libopenblas.a", "-static-libgfortran", "-lgfortran", "-lpthread",
           "-o", out]
    subprocess.run(cmd, check=True)


def expected_tensors(cfg):
    """(name, shape) in our flat-buffer order, from config.json alone."""
    d, V = cfg["hidden_size"], cfg["vocab_size"]
    L, E, H = cfg["num_hidden_layers"], cfg["num_experts"], cfg["intermediate_size"]
    kv = d // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (V, d))]
    for l in range(L):
        p = f"model.layers.{l}."
        out += [(p + "input_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (d, d)),
                (p + "self_attn.k_proj.weight", (kv, d)),
                (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.o_proj.weight", (d, d)),
                (p + "self_attn.q_norm.weight", (d,)),
                (p + "self_attn.k_norm.weight", (kv,)),
                (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate.weight", (E, d))]
    out.append(("model.norm.weight", (d,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (V, d)))
    for e in range(E):
        for l in range(L):
            p = f"model.layers.{l}.mlp.experts.{e}."
            out += [(p + "gate_proj.weight", (H, d)), (p + "up_proj.weight", (H, d)),
                    (p + "down_proj.weight", (d, H))]
    return out


def slices(cfg, params):
    at, out = 0, {}
    for name, shape in expected_tensors(cfg):
        n = int(np.prod(shape))
        out[name] = (shape, params[at:at + n].reshape(shape))
        at += n
    return out, at


def bf16_round(x):
    """fp32 -> bf16 (round to nearest even) -> fp32, computed independently in numpy."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return r.astype(np.uint32).view(np.float32)


def check_export(tmp, sub, params_file, framework="np"):
    d = os.path.join(tmp, sub)
    cfg = json.load(open(os.path.join(d, "config.json")))
    params = np.fromfile(os.path.join(tmp, params_file), dtype=np.float32)
    want, total = slices(cfg, params)
    check(total == params.size, f"{sub}: config.json accounts for all {params.size} params")
    with safe_open(os.path.join(d, "model.safetensors"), framework=framework) as f:
        keys = set(f.keys())
        check(keys == set(want), f"{sub}: official reader sees exactly the {len(want)} expected names")
        check(f.metadata() == {"format": "pt"}, f"{sub}: metadata {{'format': 'pt'}}")
        bad_shape, bad_val = [], []
        for name, (shape, ref) in want.items():
            if name not in keys:
                continue
            t = f.get_tensor(name)
            if framework == "pt":
                import torch
                check_dtype = t.dtype == torch.bfloat16
                t = t.float().numpy()
                ref = bf16_round(ref)
            else:
                check_dtype = t.dtype == np.float32
            if tuple(t.shape) != tuple(shape) or not check_dtype:
                bad_shape.append(name)
            elif not np.array_equal(t.view(np.uint32), np.ascontiguousarray(ref).view(np.uint32)):
                bad_val.append(name)
        check(not bad_shape, f"{sub}: every shape and dtype right {bad_shape[:3]}")
        check(not bad_val, f"{sub}: every value bitwise equal to params.bin{' (bf16-rounded)' if framework == 'pt' else ''} {bad_val[:3]}")
    return cfg


def check_reader(tmp, fixtures):
    """Files written by the official package, read by ours."""
    rng = np.random.default_rng(0)
    tensors = {"a.f32": rng.standard_normal((3, 5)).astype(np.float32),
               "b.f16": rng.standard_normal((4, 2)).astype(np.float16),
               "c.scalar": np.array(1.5, dtype=np.float32),
               "d.empty": np.zeros((0, 3), dtype=np.float32)}
    path = os.path.join(tmp, "official_np.safetensors")
    np_save_file(tensors, path, metadata={"k": "v"})
    files = [(path, tensors, {"a.f32": "F32", "b.f16": "F16", "c.scalar": "F32", "d.empty": "F32"})]
    try:
        import torch
        from safetensors.torch import save_file as pt_save_file
        tt = {"x.bf16": torch.randn(6, 7).to(torch.bfloat16), "y.f32": torch.randn(9)}
        path2 = os.path.join(tmp, "official_pt.safetensors")
        pt_save_file(tt, path2)
        files.append((path2, {k: v.float().numpy() for k, v in tt.items()}, {"x.bf16": "BF16", "y.f32": "F32"}))
    except ImportError:
        print("skip BF16 reader check (no torch)")
    for path, ref, dtypes in files:
        prefix = path + ".ours"
        subprocess.run([fixtures, "read", path, prefix], check=True)
        listing = json.load(open(prefix + ".json"))
        values = np.fromfile(prefix + ".bin", dtype=np.float32)
        check({t["name"] for t in listing} == set(ref), f"{os.path.basename(path)}: our reader sees the same names")
        at, ok = 0, True
        for t in listing:
            r = np.asarray(ref[t["name"]], dtype=np.float32)
            n = r.size
            ok &= tuple(t["shape"]) == r.shape and t["dtype"] == dtypes[t["name"]]
            ok &= np.array_equal(values[at:at + n].reshape(r.shape).view(np.uint32), r.view(np.uint32))
            at += n
        check(ok and at == values.size, f"{os.path.basename(path)}: our reader's dtypes, shapes, values exact")


def check_transformers(tmp):
    try:
        import torch
        from transformers import OlmoeForCausalLM
        import transformers
    except ImportError as e:
        print(f"skip transformers check ({e})")
        return
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    tokens = np.fromfile(os.path.join(tmp, "tokens.bin"), dtype=np.int32)
    for sub, logits_file, loss_file, tol in [("f32", "logits.bin", "loss.json", 1e-4),
                                             ("tied", "logits_tied.bin", "loss_tied.json", 1e-4),
                                             ("bf16", "logits.bin", "loss.json", None)]:
        d = os.path.join(tmp, sub)
        model, info = OlmoeForCausalLM.from_pretrained(d, output_loading_info=True, dtype=torch.float32,
                                                       attn_implementation="eager")
        print(f"     loading info: { {k: list(v) for k, v in info.items()} }")
        problems = {k: v for k, v in info.items() if v}
        check(not problems, f"{sub}: from_pretrained loads with no missing/unexpected/mismatched keys {problems}")
        if sub == "tied":
            check(model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
                  "tied: lm_head shares the embedding")
        T = model.config.max_position_embeddings
        with torch.no_grad():
            ids = torch.tensor(tokens[:T].astype(np.int64))[None]
            out = model(input_ids=ids, labels=torch.tensor(tokens[:T + 1].astype(np.int64))[None, 1:])
        hf = out.logits[0].float().numpy()
        ours = np.fromfile(os.path.join(tmp, logits_file), dtype=np.float32).reshape(hf.shape)
        diff = float(np.abs(hf - ours).max())
        # HF's loss shifts labels by one itself; feeding labels = targets shifted
        # the other way, so recompute CE directly from the logits instead.
        lse = np.log(np.exp(hf - hf.max(1, keepdims=True)).sum(1)) + hf.max(1)
        ce_hf = float(np.mean(lse - hf[np.arange(T), tokens[1:T + 1]]))
        ce_ours = json.load(open(os.path.join(tmp, loss_file)))["ce"]
        if tol is None:
            print(f"info {sub}: max |logit diff| vs our fp32 forward = {diff:.3g} (bf16 weights), "
                  f"CE hf {ce_hf:.6f} vs ours(fp32) {ce_ours:.6f}")
        else:
            check(diff < tol, f"{sub}: HF logits equal our CPU forward's (max |diff| {diff:.3g} < {tol})")
            check(abs(ce_hf - ce_ours) < 1e-5, f"{sub}: CE hf {ce_hf:.7f} == ours {ce_ours:.7f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="spes_oracle_") as tmp:
        fixtures = os.path.join(tmp, "fixtures")
        build_fixtures(args.build, fixtures)
        subprocess.run([fixtures, "write", tmp], check=True)
        check_export(tmp, "f32", "params.bin")
        check_export(tmp, "tied", "params_tied.bin")
        try:
            import torch  # noqa: F401
            check_export(tmp, "bf16", "params.bin", framework="pt")
        except ImportError:
            print("skip BF16 export check (no torch)")
        check_reader(tmp, fixtures)
        check_transformers(tmp)
    print(f"{len(failures)} failed" if failures else "all oracle checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
