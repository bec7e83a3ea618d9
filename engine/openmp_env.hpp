// OpenMP threads that spin long while waiting make every op crawl as soon as one
// core is shared (another process, or several nodes on one machine); threads that
// sleep at once cost a fifth of the speed on an idle machine. A short spin keeps
// both: bench_train_cpu, tiny config, 2 threads on 2 cores, tokens/s
//                          idle     other core busy
//   libgomp default      18.3k        625
//   passive (no spin)    15.3k      9.8k
//   GOMP_SPINCOUNT=1000  18.6k      8.9k
// libgomp reads its environment when it is loaded, before main, so the only way to
// change its default is to set the variable and re-execute once. A user's own
// OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept. Call first thing in main().
#pragma once
#include <unistd.h>

#include <cstdlib>

namespace spes {

inline void default_to_short_openmp_spin(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
  setenv("GOMP_SPINCOUNT", "1000", 1);
  execv("/proc/self/exe", argv);  // returns only on failure: then run as we are
}

}  // namespace spes
