// The emulator's twin of cuda/launch.cuh: same names and signatures, forwarding to
// tests/emu/emu.hpp. The emulated kernels' build puts tests/emu/ first on the include
// path, so the kernel files, compiled unchanged, include this file instead.
#pragma once
#include <cstddef>
#include <type_traits>
#include <vector>

#include "tests/emu/emu.hpp"

// The emulator is an H100 that runs the kernels' sm_90 code (clusters among it), and
// says so to the launchers: cudaFuncGetAttributes reports ptxVersion 90.
#define SPES_SM90_DEVICE_CODE 1

namespace spes::cuda {

// dynamic_smem<T> converts to the running CTA's dynamic shared memory as T*, which is
// all a kernel does with it (`float* smem = dynamic_smem<float>;`).
template <typename T>
struct DynamicSmem {
  operator T*() const { return reinterpret_cast<T*>(emu::dynamic_smem); }
};
template <typename T>
inline constexpr DynamicSmem<T> dynamic_smem{};

template <typename... Params>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
            std::type_identity_t<Params>... args) {
  emu::require_current_device(stream, "kernel launch");
  emu::require_device_pointers(reinterpret_cast<const void*>(kernel), args...);
  emu::on_stream(stream, [=] {
    emu::launch(reinterpret_cast<const void*>(kernel), grid, block, smem_bytes, [&] { kernel(args...); });
  });
}

template <typename... Params>
cudaError_t launch_ex(const cudaLaunchConfig_t& config, void (*kernel)(Params...),
                      std::type_identity_t<Params>... args) {
  emu::require_current_device(config.stream, "kernel launch");
  emu::require_device_pointers(reinterpret_cast<const void*>(kernel), args...);
  if (!emu::capturing(config.stream))
    return emu::launch_ex(reinterpret_cast<const void*>(kernel), config, [&] { kernel(args...); });
  // A captured cluster launch: its attributes are copied, as cudaLaunchKernelEx does.
  std::vector<cudaLaunchAttribute> attrs(config.attrs, config.attrs + config.numAttrs);
  emu::on_stream(config.stream, [=] {
    cudaLaunchConfig_t c = config;
    c.attrs = const_cast<cudaLaunchAttribute*>(attrs.data());
    if (emu::launch_ex(reinterpret_cast<const void*>(kernel), c, [&] { kernel(args...); }) != cudaSuccess)
      emu::fail("a captured cluster launch failed at its replay");
  });
  return cudaSuccess;
}

}  // namespace spes::cuda
