// OpenMP threads that spin while waiting make every op crawl as soon as one core is
// shared (another process, or several nodes on one machine): measured on 2 cores
// with the other core busy, 625 tokens/s spinning vs 9.7k sleeping (bench_train_cpu,
// tiny config). libgomp reads OMP_WAIT_POLICY when it is loaded, before main, so the
// only way to change its default is to set it and re-execute once. A user's own
// setting is kept. Call first thing in main().
#pragma once
#include <unistd.h>

#include <cstdlib>

namespace spes {

inline void default_to_passive_openmp_waits(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY")) return;
  setenv("OMP_WAIT_POLICY", "passive", 1);
  execv("/proc/self/exe", argv);  // returns only on failure: then run as we are
}

}  // namespace spes
