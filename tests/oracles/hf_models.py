#!/usr/bin/env python3
"""The Hugging Face import/export oracle (run by hand; ctest reads what it wrote).

    pip install torch transformers safetensors numpy
    python3 tests/oracles/hf_models.py write      # rewrites tests/oracles/hf/
    python3 tests/oracles/hf_models.py write qwen3_gpu olmo2_gpu   # only those cases
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
GPU-shaped cases (head_dim 32, widths multiples of 8: what the GPU kernels take, see
check_gpu_shape in model/gpu/gpu_plan.cu), their weights bf16 (on disk too), so that
the GPU's bf16 compute copy is exactly transformers' weights; checked by
tests/test_gpu_import.cu on the GPU model (and the emulator) and by test_import_hf.cpp:
  qwen3_gpu   dense, per-head QK-norm, head_dim 32 with 2 heads over hidden 32 (q width
              64), GQA 2:1, tied embeddings, rope_theta 1e6
  olmo2_gpu   dense, post-norm, QK-norm over the whole projection, 2 heads of 32 over
              hidden 64, GQA 2:1
  qwen3_moe_gpu  qwen3_gpu's attention, 4 experts of 16 top-2, norm_topk_prob
  olmoe_gpu   olmo2_gpu's attention (pre-norm), 4 experts of 16 top-2, no renormalisation
The MoE cases' seeds keep every routing decision clear of the GPU's rounding (GPU_SEEDS).

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


GPU_COMMON = dict(vocab_size=64, num_hidden_layers=2, max_position_embeddings=len(TOKENS), initializer_range=0.2,
                  attention_bias=False, hidden_act="silu")
# Each GPU case's seed. The MoE cases' seeds were picked so that every routing decision
# has a margin (router logit of the k-th expert over the next one's) of at least
# MIN_ROUTER_MARGIN, some 5x the GPU's bf16 rounding of those logits: a token routed
# to another expert on the GPU would change its logits by order 1.
GPU_SEEDS = {"qwen3_gpu": 200, "olmo2_gpu": 201, "qwen3_moe_gpu": 213, "olmoe_gpu": 204}
GPU_CASES = list(GPU_SEEDS)
MIN_ROUTER_MARGIN = 0.05


def make_gpu(case):
    t = transformers
    qwen3_attention = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=1e6,
                           rms_norm_eps=1e-6, use_sliding_window=False)
    olmo_attention = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0)
    if case == "qwen3_gpu":
        cfg = t.Qwen3Config(**GPU_COMMON, **qwen3_attention, intermediate_size=24, tie_word_embeddings=True)
        return t.Qwen3ForCausalLM(cfg)
    if case == "olmo2_gpu":
        cfg = t.Olmo2Config(**GPU_COMMON, **olmo_attention, intermediate_size=24, rms_norm_eps=1e-6,
                            tie_word_embeddings=False)
        return t.Olmo2ForCausalLM(cfg)
    if case == "qwen3_moe_gpu":
        cfg = t.Qwen3MoeConfig(**GPU_COMMON, **qwen3_attention, intermediate_size=48, moe_intermediate_size=16,
                               num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
                               decoder_sparse_step=1, mlp_only_layers=[])
        return t.Qwen3MoeForCausalLM(cfg)
    if case == "olmoe_gpu":
        cfg = t.OlmoeConfig(**GPU_COMMON, **olmo_attention, intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                            norm_topk_prob=False, rms_norm_eps=1e-5, tie_word_embeddings=False)
        return t.OlmoeForCausalLM(cfg)
    raise ValueError(case)


def router_margin(model):
    """The smallest gap, over tokens and layers, between the router logit of a token's
    k-th expert and of its (k+1)-th: how far each routing decision is from flipping."""
    k = model.config.num_experts_per_tok
    gaps = []

    def hook(module, inputs, _):
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        top = (x @ module.weight.T).sort(dim=-1, descending=True).values
        gaps.append((top[:, k - 1] - top[:, k]).min().item())

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    logits_of(model)
    for h in hooks:
        h.remove()
    return min(gaps)


def round_to_bf16(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


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


CPU_CASES = ["qwen3", "qwen3_moe", "olmo2", "olmoe"]


def write(cases):
    """Writes the named cases (qwen3 also writes qwen3_bf16, olmo2 olmo2_sharded); every
    case's weights come from its own seed, so a case written alone has the same bytes."""
    torch.manual_seed(0)
    os.makedirs(FIXTURES, exist_ok=True)
    for case in GPU_CASES:
        if case not in cases:
            continue
        model = make_gpu(case).float().eval()
        randomize(model, GPU_SEEDS[case])
        round_to_bf16(model)
        if getattr(model.config, "num_experts_per_tok", None):
            margin = router_margin(model)
            print(f"{case}: smallest routing margin {margin:.3f}")
            assert margin >= MIN_ROUTER_MARGIN, f"{case}: a routing decision within {margin} of flipping: change its seed"
        # Saved in bf16 (its values are bf16 already: the same weights in half the bytes)
        # from a copy, since .to() converts in place; the logits are the fp32 model's.
        bf = make_gpu(case).eval()
        bf.load_state_dict(model.state_dict())
        write_case(case, bf.to(torch.bfloat16), reference=model)
    for i, case in enumerate(CPU_CASES):
        if case not in cases:
            continue
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
    ap.add_argument("cases", nargs="*", help="write: only these cases (default: all)")
    ap.add_argument("--engine", default=os.path.join(ROOT, "build-cpu", "spes-engine"))
    a = ap.parse_args()
    if a.mode == "write":
        unknown = set(a.cases) - set(CPU_CASES + GPU_CASES)
        if unknown:
            ap.error(f"unknown case(s) {sorted(unknown)}: choose from {CPU_CASES + GPU_CASES}")
        write(a.cases or CPU_CASES + GPU_CASES)
        return 0
    return 1 if check(a.engine) else 0


if __name__ == "__main__":
    sys.exit(main())
