// The emulator's twin of <cooperative_groups.h>: the thread-block cluster calls the
// kernels make (cg::this_cluster() and the cluster_group members below, same names
// and signatures), forwarding to tests/emu/emu.hpp. tests/emu/ leads the emulated
// build's include path, so a kernel file's #include <cooperative_groups.h> finds this
// file; the real header declares nothing for a host compiler.
#pragma once
#include "tests/emu/emu.hpp"

namespace cooperative_groups {

class cluster_group {
 public:
  static void sync() { emu::cluster_sync(); }
  static unsigned block_rank() { return emu::cluster_block_rank(); }
  static unsigned num_blocks() { return emu::cluster_num_blocks(); }
  // addr's twin in the shared memory of the cluster's CTA `rank` (distributed shared
  // memory): the same variable, or the same offset of the dynamic shared memory.
  template <typename T>
  static T* map_shared_rank(T* addr, int rank) {
    return static_cast<T*>(emu::map_shared_rank(addr, rank));
  }
};

inline cluster_group this_cluster() { return {}; }

}  // namespace cooperative_groups
