// The bulk tensor copy (TMA) and the mbarrier on the device (cuda/tma_check.cu): a ring
// of stages fed box by box gives the matrix back with zeros outside it, and a wgmma
// reads copied boxes as its operands, as the emulator models them. On a GPU this is
// the test that the emulator's copies are the hardware's (the emulator-only misuse
// cases are in tests/emu/test_emu_tma.cpp). Skipped, with the reason, where the
// device or the build has no sm_90a code.
#include <string>

#include "cuda/tma.cuh"
#include "tests/cuda_test.cuh"

GPU_TEST_CASE("TMA: boxes through mbarrier-guarded stages give the matrix back, and a wgmma reads them") {
  spes::test::runtime();
  const std::string why = spes::cuda::tma_unavailable_reason();
  if (!why.empty()) {
    MESSAGE("skipped: " << why);
    return;
  }
  const std::string failure = spes::cuda::tma_check_failure();
  CHECK_MESSAGE(failure.empty(), failure);
}
