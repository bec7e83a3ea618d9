// Is there a usable GPU? Plain C++ header so CPU-only code (tests' main, the
// trainer's device = "auto") can ask without including CUDA headers.
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

}  // namespace spes::cuda
