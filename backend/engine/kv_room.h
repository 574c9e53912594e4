#pragma once
// KvRoom: the KV cache room one shard has left while the scheduler plans a step.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvserve {

// Counted in the shard's units (ShardUsage::units). One pool: a single free count every sequence
// draws from. Several KV formats on one slab storage (MixedKvMemory::Room): each format's room in
// the slabs it holds, which only it can fill, and whole free slabs any format may take; a format
// draws on its own room first, then takes whole slabs, whose rest becomes its own room.
class KvRoom {
 public:
  KvRoom() = default;
  explicit KvRoom(int64_t free) : own_{free} {}
  KvRoom(std::vector<int64_t> own, int64_t free_slabs, int64_t slab_units);

  bool fits(size_t format, int64_t units) const;
  // Whether every format's demand (units, by format) fits at once.
  bool fits(const std::vector<int64_t>& units) const;
  // Where a demand that does not fit should shrink: whether it needs slabs (a demand of a format that
  // fits in its own room frees nothing for the others by shrinking). One pool: always.
  bool draws_slabs(size_t format, int64_t units) const;
  // Takes units for a format; where they do not fit the room goes short, and nothing fits after.
  void take(size_t format, int64_t units);
  // Units a release frees, counted as their own format's room only: whether they empty whole slabs
  // shows in the next step's report (so this errs towards too little room, never too much).
  void give(size_t format, int64_t units);

  int64_t own(size_t format) const { return own_.at(at(format)); }
  int64_t free_slabs() const { return free_slabs_; }

 private:
  size_t at(size_t format) const { return slab_units_ == 0 ? 0 : format; }
  // Slabs a format's demand takes beyond its own room (-1: it cannot take slabs at all).
  int64_t slabs_for(size_t format, int64_t units) const;
  std::vector<int64_t> own_{0};
  int64_t free_slabs_ = 0, slab_units_ = 0;
};

}  // namespace kvserve
