// A node's training figures as it reports them with each push (protocol.fbs,
// TrainFigures): what the coordinator's status page shows of every site's progress
// without access to its machine. They move nothing in a round (the coordinator owns
// the step). Plain values, so the trainer can fill them (engine/sync_hook.hpp).
#pragma once
#include <cmath>
#include <cstdint>

namespace spes::net {

struct TrainFigures {
  int64_t step = 0;           // optimizer steps done
  double loss = NAN;          // training loss of the last step
  double tokens_per_s = NAN;  // the last step's tokens per second (its compute, before the sync round)
  double val_ce = NAN;        // the last validation CE (NaN: never evaluated) ...
  int64_t val_step = -1;      // ... and the step it was measured at
  double sync_ms = NAN;       // wall time of the node's previous sync round (NaN: none yet)
};

}  // namespace spes::net
