// doctest main. CUDA test files are registered with ctest as `--gpu-file`: without
// a GPU they print why and exit 77, which ctest reports as skipped (never passed).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#ifdef SPES_HAVE_CUDA
#include "cuda/device_probe.hpp"
#endif

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool gpu_file = false;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--gpu-file") == 0) gpu_file = true;
    else args.push_back(argv[i]);
  }
  if (gpu_file) {
    std::string why = "built without CUDA";
#ifdef SPES_HAVE_CUDA
    if (spes::cuda::gpu_available(&why)) why.clear();
#endif
    if (!why.empty()) {
      std::printf("SKIPPED: no GPU (%s)\n", why.c_str());
      return 77;
    }
  }
  doctest::Context context(static_cast<int>(args.size()), args.data());
  // GPU test cases (GPU_TEST_CASE, tests/gpu_test.hpp) are skipped without a usable
  // GPU. Probed here, in main(): during static initialization not every kernel is
  // registered with the CUDA runtime yet.
  bool gpu = false;
#ifdef SPES_HAVE_CUDA
  gpu = spes::cuda::gpu_available();
#endif
  if (!gpu) context.addFilter("test-suite-exclude", "gpu");
  return context.run();
}
