#include "model/owned_space.hpp"

#include <stdexcept>

namespace spes {

OwnedSpace::OwnedSpace(const std::vector<Range>& flat_ranges) {
  for (const Range& r : flat_ranges) {
    if (r.size() < 0 || (!ranges_.empty() && r.begin < ranges_.back().end))
      throw std::invalid_argument("OwnedSpace: ranges must be ascending and disjoint");
    if (r.size() == 0) continue;
    if (!ranges_.empty() && ranges_.back().end == r.begin) ranges_.back().end = r.end;
    else ranges_.push_back(r);
  }
  for (const Range& r : ranges_) {
    segments_.push_back({r, size_});
    size_ += r.size();
  }
}

int64_t OwnedSpace::packed_index(int64_t flat) const {
  for (const OwnedSegment& s : segments_) {
    if (flat < s.flat.begin) return -1;
    if (flat < s.flat.end) return s.packed_begin + (flat - s.flat.begin);
  }
  return -1;
}

int64_t OwnedSpace::packed_offset(const Range& r) const {
  const int64_t i = packed_index(r.begin);
  if (i < 0) {
    if (r.size() > 0 && packed_index(r.end - 1) >= 0)
      throw std::logic_error("OwnedSpace: range straddles frozen and owned parameters");
    return -1;
  }
  if (r.size() > 0 && packed_index(r.end - 1) != i + r.size() - 1)
    throw std::logic_error("OwnedSpace: range straddles owned and frozen parameters");
  return i;
}

}  // namespace spes
