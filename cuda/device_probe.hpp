// Is there a usable GPU, and how fast is it? Plain C++ header so CPU-only code
// (tests' main, the trainer's device = "auto") can ask without including CUDA headers.
#pragma once
#include <string>

namespace spes::cuda {

// True when a CUDA device can be used. Any failure (no driver, "driver version is
// insufficient", no device, no code in this binary for the device, cuBLASLt
// NOT_INITIALIZED) means "no GPU"; `reason`
// then says which.
bool gpu_available(std::string* reason = nullptr);
// Devices visible to this process (0 when there is no driver).
int gpu_count();

class Runtime;
// The dense bf16 tensor-core peak of rt's device in FLOP/s, MFU's denominator: the
// datasheet's for a device known by name, otherwise a 4096³ bf16 GEMM timed once on
// rt's stream. `source` receives where the number comes from, for the log.
double bf16_peak_flops(const Runtime& rt, std::string* source);

}  // namespace spes::cuda
