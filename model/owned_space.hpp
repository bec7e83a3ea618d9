// Owned space (README, Architecture: Ownership): a node trains the shared block and its own experts, a
// few ranges of the flat parameter layout. Everything that exists only for trained
// parameters — gradients, fp32 master weights, AdamW moments, the sync base, codec
// residuals — is stored packed: those ranges laid end to end. OwnedSpace is the one
// map between flat offsets and packed offsets; nothing else re-derives it.
#pragma once
#include <cstdint>
#include <vector>

namespace spes {

// [begin, end) of the flat parameter buffer.
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range&) const = default;
};

// One owned flat range and where it starts in packed space.
struct OwnedSegment {
  Range flat;
  int64_t packed_begin = 0;
};

class OwnedSpace {
 public:
  OwnedSpace() = default;
  // Ranges ascending and disjoint (adjacent ones are merged into one segment).
  explicit OwnedSpace(const std::vector<Range>& flat_ranges);

  const std::vector<Range>& ranges() const { return ranges_; }
  const std::vector<OwnedSegment>& segments() const { return segments_; }
  int64_t size() const { return size_; }  // packed elements

  // Packed index of flat element `flat`, or -1 when it is not owned (frozen).
  int64_t packed_index(int64_t flat) const;
  // Packed offset of flat range r, which lies inside one owned range; -1 when it is
  // not owned at all. A range that straddles owned and frozen parameters is a bug.
  int64_t packed_offset(const Range& r) const;

  // packed[i] = flat[flat offset of i] for every owned element, and back.
  template <class T>
  void gather(const T* flat, T* packed) const {
    for (const OwnedSegment& s : segments_)
      for (int64_t i = 0; i < s.flat.size(); ++i) packed[s.packed_begin + i] = flat[s.flat.begin + i];
  }
  template <class T>
  void scatter(const T* packed, T* flat) const {
    for (const OwnedSegment& s : segments_)
      for (int64_t i = 0; i < s.flat.size(); ++i) flat[s.flat.begin + i] = packed[s.packed_begin + i];
  }

  bool operator==(const OwnedSpace& o) const { return ranges_ == o.ranges_; }

 private:
  std::vector<Range> ranges_;
  std::vector<OwnedSegment> segments_;
  int64_t size_ = 0;
};

}  // namespace spes
