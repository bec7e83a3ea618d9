#!/usr/bin/env python3
"""The Hugging Face import/export oracle (run by hand; ctest reads what it wrote).

    pip install torch transformers safetensors numpy
    python3 tests/oracles/hf_models.py write      # rewrites tests/oracles/hf/
    python3 tests/oracles/hf_models.py check --engine build-cpu/spes-engine

`write` builds a small random model of each architecture the engine imports with
`transformers` (Qwen3ForCausalLM, Qwen3MoeForCausalLM, Olmo2ForCausalLM,
OlmoeForCausalLM), saves it with save_pretrained, and writes its fp32 logits on
fixed tokens: tests/oracles/hf/<case>/{config.json, model.safetensors or shards,
tokens.bin (int32), logits.bin (fp32 [T, V])}. tests/test_import_hf.cpp checks our
import and CPU forward against these with no Python. Cases:
  qwen3       dense, per-head QK-norm, head_dim 16 != hidden 32 / 4 heads, GQA 2:1,
              tied embeddings, rope_theta 1e6
  qwen3_moe   4 experts top-2, norm_topk_prob, per-head QK-norm, head_dim 16, GQA 2:1
  olmo2       dense, post-norm, QK-norm over the whole projection, GQA 2:1
  olmoe       4 experts top-2 (no renormalisation), QK-norm over the projection
  qwen3_bf16  the qwen3 model saved in bf16 (logits of its bf16-rounded weights in fp32)
  olmo2_sharded  the olmo2 model saved in shards with model.safetensors.index.json

`check` imports every case with the engine, exports it again (`import-hf`, then
`export-hf`), loads the export with from_pretrained (no missing or unexpected
keys, the same architecture) and compares its logits with the case's; then
upcycles the dense qwen3 case to 4 experts at noise 0, exports it and checks that
transformers loads a Qwen3MoeForCausalLM giving the dense logits.

The committed fixtures were made with transformers 5.24.0 and torch 2.15.0 (CPU);
the versions are also in tests/oracles/hf/versions.json.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "oracles", "hf")
TOKENS = [5, 17, 3, 60, 42, 8, 8, 29, 0, 63, 11, 47, 22, 35, 1, 54]

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, initializer_range=0.2,
              attention_bias=False, hidden_act="silu")


def make(case):
    t = transformers
    if case == "qwen3":
        cfg = t.Qwen3Config(**COMMON, intermediate_size=48, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
                            tie_word_embeddings=True, use_sliding_window=False)
        return t.Qwen3ForCausalLM(cfg)
    if case == "qwen3_moe":
        cfg = t.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                               num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, rope_theta=1e6,
                               rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1,
                               mlp_only_layers=[], use_sliding_window=False)
        return t.Qwen3MoeForCausalLM(cfg)
    if case == "olmo2":
        cfg = t.Olmo2Config(**COMMON, intermediate_size=48, rope_theta=10000.0, rms_norm_eps=1e-6,
                            tie_word_embeddings=False)
        return t.Olmo2ForCausalLM(cfg)
    if case == "olmoe":
        cfg = t.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=False, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
        return t.OlmoeForCausalLM(cfg)
    raise ValueError(case)


def randomize(model, seed):
    """Random weights everywhere, norms away from 1 so a misplaced norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def logits_of(model):
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0].float().numpy()


def write_case(name, model, reference=None, **save):
    out = os.path.join(FIXTURES, name)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True, **save)
    if os.path.exists(os.path.join(out, "generation_config.json")):
        os.remove(os.path.join(out, "generation_config.json"))
    np.asarray(TOKENS, dtype="<i4").tofile(os.path.join(out, "tokens.bin"))
    logits_of(reference if reference is not None else model).astype("<f4").tofile(os.path.join(out, "logits.bin"))
    print(f"wrote {out}")


def write():
    torch.manual_seed(0)
    os.makedirs(FIXTURES, exist_ok=True)
    for i, case in enumerate(["qwen3", "qwen3_moe", "olmo2", "olmoe"]):
        model = make(case).float().eval()
        randomize(model, 100 + i)
        write_case(case, model)
        if case == "qwen3":
            # bf16 on disk; the reference is the bf16-rounded weights computed in fp32 (a
            # fresh fp32 model: converting the bf16 one back would keep RoPE's bf16 buffers).
            bf = make(case).eval()
            bf.load_state_dict(model.state_dict())
            rounded = make(case).float().eval()
            rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
            write_case("qwen3_bf16", bf.to(torch.bfloat16), reference=rounded)
        if case == "olmo2":
            write_case("olmo2_sharded", model, max_shard_size="40KB")
    with open(os.path.join(FIXTURES, "versions.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "torch": torch.__version__}, f, indent=2)
        f.write("\n")


def check(engine):
    failures = 0
    for case in sorted(os.listdir(FIXTURES)):
        src = os.path.join(FIXTURES, case)
        if not os.path.isdir(src):
            continue
        ref = np.fromfile(os.path.join(src, "logits.bin"), dtype="<f4").reshape(len(TOKENS), -1)
        with tempfile.TemporaryDirectory() as tmp:
            ck, ex = os.path.join(tmp, "ck"), os.path.join(tmp, "export")
            subprocess.run([engine, "import-hf", "--in", src, "--out", ck], check=True)
            subprocess.run([engine, "export-hf", "--checkpoint", ck, "--out", ex], check=True)
            arch = json.load(open(os.path.join(ex, "config.json")))["architectures"][0]
            cls = getattr(transformers, arch)
            model, info = cls.from_pretrained(ex, output_loading_info=True, torch_dtype=torch.float32)
            keys_ok = not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
            got = logits_of(model.eval())
            rel = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            ok = keys_ok and rel < 1e-5
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {case}: export loads as {arch}, loading info {info}, "
                  f"worst |logit diff| / max |logit| = {rel:.3g}")
    failures += check_upcycle(engine)
    print(f"{failures} failed")
    return failures


def check_upcycle(engine):
    """Dense Qwen3 -> upcycle (4 experts, top-2, renormalized, noise 0) -> export: transformers
    loads a Qwen3MoeForCausalLM that computes the dense model's logits."""
    src = os.path.join(FIXTURES, "qwen3")
    ref = np.fromfile(os.path.join(src, "logits.bin"), dtype="<f4").reshape(len(TOKENS), -1)
    with tempfile.TemporaryDirectory() as tmp:
        ck, moe, ex = (os.path.join(tmp, n) for n in ("ck", "moe", "export"))
        subprocess.run([engine, "import-hf", "--in", src, "--out", ck], check=True)
        subprocess.run([engine, "upcycle", "--checkpoint", ck, "--config", os.path.join(ck, "config.toml"),
                        "--set", "model.n_experts=4", "--set", "model.top_k=2", "--set", "model.norm_topk_prob=true",
                        "--out", moe], check=True)
        subprocess.run([engine, "export-hf", "--checkpoint", moe, "--out", ex], check=True)
        arch = json.load(open(os.path.join(ex, "config.json")))["architectures"][0]
        model, info = getattr(transformers, arch).from_pretrained(ex, output_loading_info=True,
                                                                  torch_dtype=torch.float32)
        keys_ok = not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        rel = float(np.max(np.abs(logits_of(model.eval()) - ref)) / np.max(np.abs(ref)))
        ok = keys_ok and arch == "Qwen3MoeForCausalLM" and rel < 1e-5
        print(f"{'ok  ' if ok else 'FAIL'} qwen3 upcycled to 4 experts at noise 0: loads as {arch}, loading info "
              f"{info}, worst |logit diff| / max |dense logit| = {rel:.3g}")
        return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["write", "check"])
    ap.add_argument("--engine", default=os.path.join(ROOT, "build-cpu", "spes-engine"))
    a = ap.parse_args()
    if a.mode == "write":
        write()
        return 0
    return 1 if check(a.engine) else 0


if __name__ == "__main__":
    sys.exit(main())
