// cuda/attention.cu, unchanged, compiled as C++ for the emulator: first the CUDA
// built-ins a host compiler lacks, then the real source, whose #include "cuda/ptx.cuh"
// finds tests/emu/cuda/ptx.cuh (tests/emu/ leads this target's include path).
#include "tests/emu/builtins.hpp"

#include "cuda/attention.cu"
