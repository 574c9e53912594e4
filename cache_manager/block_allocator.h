#pragma once
// BlockAllocator: which pool blocks are free, and who still references the others.
#include <cstdint>
#include <vector>

namespace kvserve {

// Hands out block ids from a fixed pool; reference counts let several block tables share one
// block later (prefix sharing), so a block returns to the free list only when its last holder lets go.
// Not thread-safe: one engine thread drives a shard's cache.
class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);

  // One block with reference count 1; throws KvError when none is free.
  int32_t allocate();
  // All-or-nothing: n blocks, or a KvError and no change.
  std::vector<int32_t> allocate(int64_t n);
  void incref(int32_t block);
  // Returns true when this released the last reference (the block is free again).
  bool decref(int32_t block);
  int32_t refcount(int32_t block) const;

  int64_t total_blocks() const { return static_cast<int64_t>(refcount_.size()); }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  int64_t used_blocks() const { return total_blocks() - free_blocks(); }
  int64_t high_water_blocks() const { return high_water_; }
  // Starts a new measurement window (e.g. one prefill) at the current usage.
  void reset_high_water() { high_water_ = used_blocks(); }

  // Full O(total) consistency check: used + free == total, free list matches zero refcounts.
  void check_invariants() const;

 private:
  void check_id(int32_t block) const;
  std::vector<int32_t> refcount_;
  std::vector<int32_t> free_;  // LIFO: recently freed blocks are likely still in cache
  int64_t high_water_ = 0;
};

}  // namespace kvserve
