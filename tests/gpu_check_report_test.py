#!/usr/bin/env python3
"""The GPU check's report on a GPU-shaped run, without a GPU: writes the logs run.sh
would collect in full mode on an H200 (bench_train_gpu on both grouped-GEMM paths,
bench_attention, bench_grouped_gemm, torch_anchors.py eager and compiled; one bench
skipped for time, the CPU reference cut by its timeout) and checks what
bench/gpu_check/report.py makes of them: the summary rows, ours-beside-PyTorch ratios,
both MFUs, what was skipped for time.

The bench outputs are written from the benches' printf formats with run 4's figures
(bench/RESULTS.md), not captured from a GPU: a bench whose format changes must change
them here too.

usage: gpu_check_report_test.py SOURCE_DIR
"""
import os
import subprocess
import sys
import tempfile

TRAIN_GPU = """device: NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)
grouped expert GEMMs: {path}
attention kernels: sm90a (wgmma), agreeing with the portable kernels on this GPU

== spes-1b shape, node owning all 16 experts: 12 layers, 1.316B parameters, 1.316B owned; micro_batch 8 x seq 2048, 8 micro-batches per step
backend: cuda: NVIDIA H200 (sm_90, 140 GiB); MFU against the datasheet
step: median {ms} ms of 3 (min {ms}, max {ms}); 131072 tokens/step, {tok} tokens/s
steps in order (ms): {ms} {ms} {ms}
MFU: {mfu}% (1.661 GFLOP/token training, peak 989.4 TFLOP/s: datasheet)
phases: forward+backward 600.0 ms (8 micro-batches, 75.00 ms each), grad norm 1.00 ms, AdamW 8.50 ms

-- timeline of one more step (libcupti.so.13, CUPTI API 130001; 5321 records) --
traced step: {ms} ms on the host clock (the untraced steps' median: {ms} ms)
warning: 0 records dropped by CUPTI, 3 without timestamps: the device was busier than this says
device busy (kernels, copies, memsets; overlaps counted once): 600.10 ms = 98.2% of the step
time outside kernels and copies: 11.20 ms = 1.83% of the step (goal <= 2%): 0.04 ms before the first work started, 10.90 ms idle between work in 5210 gaps, 0.26 ms from the last work's end to the host's
gaps by length: < 5 us: 5100, 6.10 ms; 5-50 us: 100, 2.00 ms; 50-500 us: 9, 1.30 ms; >= 500 us: 1, 1.50 ms
the longest gaps:
     1.500 ms at +75.10 ms, after loss_sums_kernel, before memcpy HtoD
kernel (in the traced step, the device's own times)                        calls        ms  % step    us/call
attention_backward_dkv_kernel<64>                                             96     60.00    9.8%      625.0

-- the same node through the NCCL data-parallel path, 1 rank --
step: median 609.3 ms of 3 (min 609.0, max 610.0); 131072 tokens/step, 215121 tokens/s
MFU: 36.1% (1.661 GFLOP/token training, peak 989.4 TFLOP/s: datasheet)
kernel (isolated, step shapes)                   calls    ms/call    ms/step   % step         achieved
attention fwd                                     96.0     0.2300      22.08     3.6%    222.1 TFLOP/s
attention bwd                                     96.0     0.8031      77.10    12.6%    160.4 TFLOP/s
rmsnorm fwd                                      200.0     0.0700      14.00     2.3%       3000 GB/s

== spes-1b shape, SPES node owning 4 of 16 experts: 12 layers, 1.316B parameters, 0.5B owned; micro_batch 8 x seq 2048, 8 micro-batches per step
step: median 545.0 ms of 3 (min 545.0, max 546.0); 131072 tokens/step, 240492 tokens/s
MFU: 40.4% (1.661 GFLOP/token training, peak 989.4 TFLOP/s: datasheet)
attention fwd                                     96.0     0.2300      22.08     3.6%    221.0 TFLOP/s
"""

ATTENTION = """device: NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)
kernel                             size                       ms     achieved   %ceil
attention fwd causal D=64          B=8 S=2048 H=32        0.1234  252.6 TFLOP/s   31.4%
attention bwd causal D=64          B=8 S=2048 H=32        0.4500  173.3 TFLOP/s   21.5%
attention fwd causal D=128         B=8 S=2048 H=16        0.1234  264.3 TFLOP/s   32.8%
attention bwd causal D=128         B=8 S=2048 H=16        0.4200  190.0 TFLOP/s   23.6%
attention fwd causal D=128         B=8 S=2048 H=16/4      0.1234  200.0 TFLOP/s   24.8%
"""

GROUPED_HEAD = ("weights,product,S,E,C,OC,tflop,portable_ms,portable_tflops,sm90a_ms,sm90a_tflops,cublas_grouped_ms,"
                "cublas_grouped_tflops,cublas_per_expert_ms,cublas_per_expert_tflops,dense_ms,dense_tflops,"
                "ours_over_grouped,ours_over_per_expert,ours_over_dense,sm90a_over_portable,ours_even_ms,ours_even_tflops,"
                "ours_even_half_ms,ours_even_half_tflops,sm90a_tma_ms,sm90a_tma_tflops")
# (weights, product, C, OC, portable, sm90a, dense) TFLOP/s, run 4.
GROUPED = [("gate_up", "forward", 768, 4096, 278.4, 556.5, 720.9), ("gate_up", "backward_input", 768, 4096, 318.3, 647.5, 780.3),
           ("gate_up", "backward_weight", 768, 4096, 255.0, 418.4, 789.4), ("down", "forward", 2048, 768, 300.3, 614.0, 751.7),
           ("down", "backward_input", 2048, 768, 276.7, 545.2, 706.6), ("down", "backward_weight", 2048, 768, 223.7, 333.7, 738.6)]

ANCHORS = """what,shape,ms,tflops,note
torch sdpa flash fwd,B8 S2048 H12 D64 causal,0.2000,208.3,
torch sdpa flash bwd,B8 S2048 H12 D64 causal,0.7000,151.9,
torch sdpa flash fwd,B8 S2048 H6 D128 causal,0.2000,230.0,
torch sdpa flash bwd,B8 S2048 H6 D128 causal,0.7000,170.0,
torch sdpa flash fwd,B8 S2048 H32 D64 causal,0.2000,248.3,
torch sdpa flash bwd,B8 S2048 H32 D64 causal,0.7000,181.2,
torch sdpa flash fwd,B8 S2048 H16 D128 causal,0.2000,268.0,
torch sdpa flash bwd,B8 S2048 H16 D128 causal,0.7000,203.9,
torch matmul bf16 (dense 8192^3),M8192 N8192 K8192,1.4000,784.7,
{mm}transformers OlmoeForCausalLM train step (eager),"spes-1b, micro-batch 8 x 2048",515.8000,422.1,31765 tokens/s
transformers OlmoeForCausalLM train step (torch.compile),"spes-1b, micro-batch 8 x 2048",459.1000,474.2,35688 tokens/s; compiled in 77 s
"""

# Nsight Compute's raw page as `ncu --import R --page raw --csv --print-units base` writes
# it (a header row, a units row, one row per kernel, thousands separators), with a few
# of its columns, for the 14 kernels run.sh selects.
NCU_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
            '"Device","CC","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed",'
            '"sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",'
            '"dram__throughput.avg.pct_of_peak_sustained_elapsed",'
            '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",'
            '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",'
            '"smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",'
            '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"\n'
            '"","","","","","","","","","","","nsecond","%","%","%","inst","inst","inst","inst"\n')
NCU_KERNELS = ["spes::cuda::attention_sm90::(anonymous namespace)::forward_kernel<64>",
               *["spes::cuda::grouped_sm90::(anonymous namespace)::rows_kernel<(spes::cuda::grouped_sm90::"
                 "(anonymous namespace)::Major)0>"] * 2, *["spes::cuda::(anonymous namespace)::ce_cluster_kernel"] * 5,
               "spes::cuda::grouped_sm90::(anonymous namespace)::rows_kernel<(spes::cuda::grouped_sm90::"
               "(anonymous namespace)::Major)1>", "spes::cuda::grouped_sm90::(anonymous namespace)::wgrad_kernel",
               "spes::cuda::grouped_sm90::(anonymous namespace)::rows_kernel<(spes::cuda::grouped_sm90::"
               "(anonymous namespace)::Major)1>", "spes::cuda::grouped_sm90::(anonymous namespace)::wgrad_kernel",
               "spes::cuda::attention_sm90::(anonymous namespace)::dkv_kernel<64>",
               "spes::cuda::attention_sm90::(anonymous namespace)::dq_kernel<64>"]


def ncu_raw(kernels):
    rows = [f'"{i}","4242","bench_train_gpu","h200","void {k}(__nv_bfloat16 *, int)","1","7","(256, 1, 1)",'
            f'"(132, 1, 1)","0","9.0","512,345","61.2","55.04","23.4","8.5","2.1","1","6.4"\n' for i, k in enumerate(kernels)]
    return NCU_HEAD + "".join(rows)


def write(logs, base, out="", err="", rc=0, seconds=30, cmd="x"):
    path = os.path.join(logs, base)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    for suffix, text in ((".cmd", cmd), (".out", out), (".err", err), (".rc", f"{rc} {seconds}"), (".timeout", "75")):
        with open(path + suffix, "w") as f:
            f.write(text)


def make_logs(logs, kernels=NCU_KERNELS):
    for name, text in (("mode", "full"), ("budget_s", "465"), ("elapsed_s", "458"),
                       ("cpu_benches", " bench_sync bench_train_cpu bench_tokenizer "), ("env/gpu_device", "cuda")):
        os.makedirs(os.path.dirname(os.path.join(logs, name)), exist_ok=True)
        with open(os.path.join(logs, name), "w") as f:
            f.write(text + "\n")
    write(logs, "bench/bench_train_gpu", TRAIN_GPU.format(path="sm90a (wgmma)", ms=611.3, tok=214402, mfu=36.0),
          "gpu: warning: capturing the work as a CUDA graph failed (CUDA error: operation not permitted when stream "
          "is capturing); it runs launch by launch\n")
    write(logs, "bench/bench_train_gpu.portable", TRAIN_GPU.format(path="portable (SPES_GROUPED_GEMM=portable)", ms=747.7,
                                                                   tok=175309, mfu=29.5))
    write(logs, "bench/bench_attention", ATTENTION)
    rows, mm = [], ""
    for w, p, C, OC, port, sm90, dense in GROUPED:
        tflop = 2 * 32768 * C * OC / 1e12
        rows.append(f"{w},{p},32768,16,{C},{OC},{tflop:.4f},1,{port},1,{sm90},1,nan,1,40.0,1,{dense},nan,10,0.7,2.0,"
                    f"1,{sm90 * 1.1:.1f},1,{sm90 * 1.2:.1f},"
                    + (f"1,{sm90 * 1.3:.1f}" if p == "backward_weight" else "nan,nan"))
        M, N, K = {"forward": (32768, OC, C), "backward_input": (32768, C, OC), "backward_weight": (OC, C, 32768)}[p]
        mm += f"torch matmul bf16 ({w} {p} as one GEMM),M{M} N{N} K{K},0.3000,{dense + 10:.1f},\n"
    write(logs, "bench/bench_grouped_gemm", GROUPED_HEAD + "\n" + "\n".join(rows) + "\n", "paths: portable, sm90a (ours)\n")
    write(logs, "torch/anchors", ANCHORS.format(mm=mm), "torch 2.11.0 on NVIDIA H200\n", seconds=150)
    write(logs, "profile/step", "==PROF== Disconnected from process 4242\n", seconds=41)
    with open(os.path.join(logs, "profile/step.raw.csv"), "w") as f:
        f.write(ncu_raw(kernels))
    write(logs, "bench/bench_gemm", rc=0, cmd="x")
    os.remove(os.path.join(logs, "bench/bench_gemm.rc"))
    with open(os.path.join(logs, "bench/bench_gemm.skipped"), "w") as f:
        f.write("out of time (the check's budget of 465s is used up)\n")
    header = "step,loss,ce,tokens_per_s,mfu,val_ce\n"
    gpu = header + "".join(f"{s},{3 - s / 200:.4f},{3 - s / 200:.4f},770000,0.01,\n" for s in range(1, 301))
    cpu = header + "".join(f"{s},{3 - s / 200 + 0.001:.4f},{3 - s / 200:.4f},6400,,\n" for s in range(1, 121))
    write(logs, "train/gpu", gpu)
    write(logs, "train/cpu", cpu, rc=124, seconds=180)


def main():
    src = sys.argv[1]
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = os.path.join(tmp, "logs")
        make_logs(logs)
        out = os.path.join(tmp, "report.md")
        subprocess.run([sys.executable, os.path.join(src, "bench/gpu_check/report.py"), logs, out], check=True,
                       stdout=subprocess.DEVNULL)
        report = open(out, encoding="utf-8").read()

    def expect(text, why):
        if text not in report:
            problems.append(f"report.md lacks '{text}': {why}")

    expect("- **mode**: full (budget 465 s)", "the mode")
    expect("- **skipped for time**: bench/bench_gemm", "the bench left without time")
    expect("- **ended by a timeout**: train/cpu (after 75 s)", "the CPU reference cut by its timeout")
    expect("| 1c. Ours beside PyTorch (same GPU) | **PASS** | step vs OLMoE eager / compiled 6.75× / 6.01× (sm90a), "
           "5.52× / 4.91× (portable); MFU 36.0 % sm90a, 29.5 % portable; attention (spes-1b) vs SDPA flash fwd 1.07×, "
           "bwd 1.06×; grouped GEMMs vs dense bf16: sm90a 0.45–0.82×, portable 0.30–0.40× |", "the ratios' summary")
    expect("step MFU, all experts owned: 36.0 % on the sm90a (wgmma) grouped GEMMs, 29.5 % on the portable", "both MFUs")
    expect("; outside kernels: 1.8 % of the step (traced)", "the traced step's time outside kernels")
    expect("; the micro-batch's CUDA graph FAILED to capture (bench_train_gpu.err)", "a failed capture of the graph")
    attention_line = "attention kernels: sm90a (wgmma), agreeing with the portable kernels on this GPU"
    section = report.split("### bench_train_gpu ", 1)[-1]
    key_lines = section.split("Key lines", 1)[1].split("```", 2)[1] if "Key lines" in section else ""
    if attention_line not in key_lines:
        problems.append(f"bench_train_gpu's key lines lack '{attention_line}': which attention kernels the step took")
    for line in ("gaps by length: < 5 us: 5100", "     1.500 ms at +75.10 ms, after loss_sums_kernel, before memcpy HtoD",
                 "warning: 0 records dropped by CUPTI, 3 without timestamps"):
        if line not in key_lines:
            problems.append(f"bench_train_gpu's key lines lack '{line}': where the traced step's device sat idle")
    expect("skipped: bench_gemm (out of time", "1b names the bench skipped for time")
    expect("| training step, all 16 experts owned, grouped GEMMs sm90a (bench_train_gpu) vs OlmoeForCausalLM torch.compile "
           "| spes-1b, micro-batch 8 × 2048 | 214,402 tokens/s (MFU 36.0 %) | 35,688 tokens/s | 6.01 |", "the step row")
    expect("| attention bwd, causal (bench_attention) vs SDPA flash bwd | B8 S2048 H16 D128 | 190.0 TFLOP/s | "
           "203.9 TFLOP/s | 0.93 |", "a bench_attention row")
    expect("| grouped down backward-weight, portable (bench_grouped_gemm) vs dense bf16 matmul, same FLOPs | "
           "M768 N2048 K32768 | 223.7 TFLOP/s | 748.6 TFLOP/s | 0.30 |", "a grouped GEMM row")
    expect("| 2. GPU vs CPU training (tiny-central) | **PASS** | CPU run cut by its timeout at step 120", "step 2 judged at the cut")
    expect("| 1d. Kernel profile (ncu) | **PASS** | 14 kernels profiled (exit 0 in 41 s) |", "the profile's summary row")
    expect("| 10 | wgrad_kernel | (132, 1, 1) | 512.3 | 61.2 | 55.0 | 23.4 | barrier 8.5 (50 %), wait 6.4 (38 %), "
           "long_scoreboard 2.1 (12 %) |", "a profiled kernel's row: % of peaks (thousands separators read), stalls "
           "largest first, 'selected' left out")
    expect("| # | kernel | grid | µs | SM % | tensor pipe % | DRAM % | stalls |", "only the columns the export has")
    # A launch window that missed: the warm-up step's layer 0 instead of layer 1.
    with tempfile.TemporaryDirectory() as tmp:
        logs = os.path.join(tmp, "logs")
        make_logs(logs, NCU_KERNELS[:3] + NCU_KERNELS[:3] + NCU_KERNELS[3:11])
        out = os.path.join(tmp, "report.md")
        subprocess.run([sys.executable, os.path.join(src, "bench/gpu_check/report.py"), logs, out], check=True,
                       stdout=subprocess.DEVNULL)
        missed = open(out, encoding="utf-8").read()
    if "| 1d. Kernel profile (ncu) | **FAIL** | 14 kernels profiled (exit 0 in 41 s); not the kernels meant: forward, " \
       "rows, rows, forward, rows, rows, ce_cluster" not in missed:
        problems.append("a profile of other kernels than run.sh meant is not reported as such")
    # The six products FLOP-weighted: their FLOPs over the sum of their times.
    def weighted(i, wgrad_scale=1.0):
        flops = [2 * 32768 * C * OC / 1e12 for _, _, C, OC, *_ in GROUPED]
        return sum(flops) / sum(f / (g[i] * (wgrad_scale if g[1] == "backward_weight" else 1))
                                for f, g in zip(flops, GROUPED))
    line = (f"sm90a {weighted(5):.1f}, sm90a with the TMA weight gradient {weighted(5, 1.3):.1f}, "
            f"portable {weighted(4):.1f}, ours on the even routing {1.1 * weighted(5):.1f}, "
            f"on the half-even one {1.2 * weighted(5):.1f} TFLOP/s")
    expect("Grouped GEMMs, the six products FLOP-weighted (the goal: 600 TFLOP/s): " + line, "the goal's figure")
    if "FLOPs differ" in report:
        problems.append("a grouped GEMM row's FLOPs differ from the anchor's")
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print("gpu_check_report: report.md as expected")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
