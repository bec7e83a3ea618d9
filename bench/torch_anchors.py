#!/usr/bin/env python3
"""PyTorch on the same GPU, as the peer a user would otherwise run: the anchors our
GPU benches are read against (bench/README.md). CSV on stdout, first line the header:

    what,shape,ms,tflops,note

  - scaled_dot_product_attention with the flash backend, forward and backward, causal
    bf16, at the spes-1b shape (B 8, S 2048, 12 heads, D 64), at D 128 with the same
    width (6 heads), and at bench_attention's width-2048 rows (D 64 and D 128);
  - dense bf16 GEMMs: 8192^3, and each of bench_grouped_gemm's six expert products
    (gate|up and down: forward, backward-input, weight gradient) at spes-1b's shape with
    all 32768 routed rows as one matrix: the same FLOPs, the ceiling the grouped GEMMs
    are held to;
  - transformers' OlmoeForCausalLM built from configs/spes-1b.toml's model (random
    init, fp32 master weights under bf16 autocast, fused AdamW, micro-batch 8 x 2048):
    one training step's tokens/s, eager, and compiled when --compile-budget-s N is given
    and it compiles within N seconds.

Timing: CUDA events, median of --runs after warm-up. Logs go to stderr. The engine
never needs Python; this is a bench only.
"""
import argparse
import statistics
import sys
import time


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def timed(torch, fn, runs, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def row(what, shape, ms, flops, note=""):
    tflops = flops / (ms / 1e3) / 1e12 if flops else 0.0
    print(f"{what},{shape},{ms:.4f},{tflops:.1f},{note}", flush=True)


def attention(torch, runs):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    for (B, S, H, D) in [(8, 2048, 12, 64), (8, 2048, 6, 128), (8, 2048, 32, 64), (8, 2048, 16, 128)]:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        # Causal: half the score matrix is work (FlashAttention's convention).
        fwd_flops = 4.0 * B * H * S * S * D / 2
        shape = f"B{B} S{S} H{H} D{D} causal"
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = timed(torch, lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), runs)
            row("torch sdpa flash fwd", shape, ms, fwd_flops)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)

            def bwd():
                q.grad = k.grad = v.grad = None
                torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

            ms = timed(torch, bwd, runs)
            row("torch sdpa flash bwd", shape, ms, 2.5 * fwd_flops)


# bench_grouped_gemm's six products at spes-1b's expert shape (S = 32768 routed rows,
# d 768, H 2048; weights W [OC, C]) as one dense GEMM each, all rows as one expert: the
# same FLOPs and operand shapes. forward X·Wᵀ (M S, N OC, K C), backward-input dY·W
# (M S, N C, K OC), weight gradient dYᵀ·X (M OC, N C, K S).
GROUPED_PRODUCTS = [("gate_up", 768, 4096), ("down", 2048, 768)]


def gemms(torch, runs):
    shapes = [(8192, 8192, 8192, "dense 8192^3")]
    S = 32768
    for weights, C, OC in GROUPED_PRODUCTS:
        shapes += [(S, OC, C, f"{weights} forward as one GEMM"), (S, C, OC, f"{weights} backward_input as one GEMM"),
                   (OC, C, S, f"{weights} backward_weight as one GEMM")]
    for (M, N, K, name) in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        ms = timed(torch, lambda: a @ b, runs)
        row(f"torch matmul bf16 ({name})", f"M{M} N{N} K{K}", ms, 2.0 * M * N * K)
        del a, b


def olmoe_step(torch, runs, compile_budget_s, tokens_flops):
    import transformers
    cfg = transformers.OlmoeConfig(
        vocab_size=151665, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=12, num_experts=16, num_experts_per_tok=2, max_position_embeddings=2048,
        rope_theta=500000.0, norm_topk_prob=False, router_aux_loss_coef=0.01, output_router_logits=True,
        tie_word_embeddings=False, attn_implementation="sdpa")
    try:  # initialised on the GPU: seconds, where the CPU takes tens of seconds
        with torch.device("cuda"):
            model = transformers.OlmoeForCausalLM(cfg)
    except Exception as e:
        log(f"building the model on the GPU failed ({type(e).__name__}: {e}); building it on the CPU")
        model = transformers.OlmoeForCausalLM(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    B, T = 8, 2048
    x = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")

    def step(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    shape = "spes-1b, micro-batch 8 x 2048"
    ms = timed(torch, lambda: step(model), runs, warmup=2)
    tok_s = B * T / (ms / 1e3)
    row("transformers OlmoeForCausalLM train step (eager)", shape, ms, tokens_flops * B * T,
        f"{tok_s:.0f} tokens/s")
    if compile_budget_s <= 0:
        return
    t0 = time.time()
    try:
        compiled = torch.compile(model)
        step(compiled)  # compiles
        if time.time() - t0 > compile_budget_s:
            log(f"torch.compile took {time.time() - t0:.0f} s, over the {compile_budget_s:.0f} s budget: not timed")
            return
        ms = timed(torch, lambda: step(compiled), runs, warmup=1)
        row("transformers OlmoeForCausalLM train step (torch.compile)", shape, ms, tokens_flops * B * T,
            f"{B * T / (ms / 1e3):.0f} tokens/s; compiled in {time.time() - t0:.0f} s")
    except Exception as e:  # a compile failure is a finding, not a crash of the bench
        log(f"torch.compile failed: {type(e).__name__}: {e}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--compile-budget-s", type=float, default=0, help="time torch.compile too (0: no)")
    # Training FLOPs per token of spes-1b as model/flops counts them (bench_train_gpu prints it).
    p.add_argument("--train-flops-per-token", type=float, default=0)
    a = p.parse_args()
    try:
        import torch
    except ImportError as e:
        log(f"torch_anchors: no PyTorch here ({e})")
        return 77
    if not torch.cuda.is_available():
        log("torch_anchors: no GPU")
        return 77
    log(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print("what,shape,ms,tflops,note", flush=True)
    attention(torch, a.runs)
    gemms(torch, a.runs)
    if not a.skip_model:
        olmoe_step(torch, max(3, a.runs // 3), a.compile_budget_s, a.train_flops_per_token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
