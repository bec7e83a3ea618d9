// Finiteness of float buffers: nothing non-finite is persisted or published (a
// checkpoint, an import, an export, the coordinator's θ), so every writer asks here.
#pragma once
#include <cstdint>
#include <string>

namespace spes {

// Index of the first non-finite value of x[0, n), or -1. Scans in blocks with a
// branch-free test, so checking a model's state costs a fraction of writing it.
int64_t first_non_finite(const float* x, int64_t n);

// "" when x[0, n) is all finite; else "element I is nan" (or inf, -inf), for a
// message that names the buffer before it.
std::string describe_non_finite(const float* x, int64_t n);

}  // namespace spes
