// Token embedding: forward lookup and deterministic backward (same contract as
// cpu::embedding_forward / embedding_backward).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"

namespace spes::cuda {

// out[n] = table[tokens[n]] (bf16 rows of C). A token outside [0, V) yields a row
// of NaN (visible in the loss, never an out-of-bounds read). C % 8 == 0, bf16
// pointers 16-byte aligned.
void embedding_forward(bf16* out, const int32_t* tokens, const bf16* table, int64_t N, int64_t C, int64_t V,
                       cudaStream_t stream);

// Workspace embedding_backward needs for N tokens over a vocabulary of V (sort
// buffers + CUB temporary storage). Plan it once.
size_t embedding_backward_workspace_bytes(int64_t N, int64_t V);

// dtable[v] (fp32) += Σ_{n: tokens[n] = v} dout[n], each row summed in token order
// onto the existing value — the same additions in the same order as the CPU
// reference, so the result is bit-identical to it for equal inputs. No float
// atomics: the tokens are stably sorted (CUB radix sort), and each run of equal
// tokens is summed by one thread per 8 channels. Out-of-range tokens are skipped.
void embedding_backward(float* dtable, const bf16* dout, const int32_t* tokens, int64_t N, int64_t C, int64_t V,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace spes::cuda
