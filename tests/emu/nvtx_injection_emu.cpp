// NVTX's hook for a statically linked tool (nvtx3/nvtxDetail/nvtxExtInit.h): a strong
// definition of the pointer that NVTX's headers define weak (and null) in every file
// that includes them — hence a file of its own that does not. NVTX calls it at the
// first memory-extension call; tests/emu/nvtx_emu.cpp answers.
struct nvtxExtModuleInfo_t;

extern "C" {
int spes_emu_nvtx_initialize(nvtxExtModuleInfo_t* module);
// Type: NvtxExtInitializeInjectionFunc_t.
int (*InitializeInjectionNvtxExtension_fnptr)(nvtxExtModuleInfo_t*) = &spes_emu_nvtx_initialize;
}
