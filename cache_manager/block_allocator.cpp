#include "cache_manager/block_allocator.h"

#include <algorithm>
#include <limits>

#include "common/check.h"

namespace kvserve {

BlockAllocator::BlockAllocator(int64_t num_blocks) {
  KV_CHECK(num_blocks >= 0 && num_blocks <= std::numeric_limits<int32_t>::max(),
           "block count " << num_blocks << " out of range");
  refcount_.assign(static_cast<size_t>(num_blocks), 0);
  free_.reserve(static_cast<size_t>(num_blocks));
  // Reverse order so that a fresh pool hands out 0, 1, 2, ... (adjacent memory first).
  for (int64_t b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<int32_t>(b));
}

void BlockAllocator::check_id(int32_t block) const {
  KV_CHECK(block >= 0 && block < total_blocks(), "block id " << block << " out of range [0, " << total_blocks() << ")");
}

int32_t BlockAllocator::allocate() {
  KV_CHECK(!free_.empty(), "KV pool exhausted: need 1 blocks, 0 free");
  const int32_t b = free_.back();
  free_.pop_back();
  refcount_[b] = 1;
  high_water_ = std::max(high_water_, used_blocks());
  return b;
}

std::vector<int32_t> BlockAllocator::allocate(int64_t n) {
  KV_CHECK(n >= 0, "negative block count " << n);
  KV_CHECK(n <= free_blocks(), "KV pool exhausted: need " << n << " blocks, " << free_blocks() << " free");
  std::vector<int32_t> out(free_.end() - n, free_.end());
  std::reverse(out.begin(), out.end());  // keep ascending order for a fresh pool
  free_.resize(free_.size() - static_cast<size_t>(n));
  for (int32_t b : out) refcount_[b] = 1;
  high_water_ = std::max(high_water_, used_blocks());
  return out;
}

void BlockAllocator::incref(int32_t block) {
  check_id(block);
  KV_CHECK(refcount_[block] > 0, "incref of free block " << block);
  ++refcount_[block];
}

bool BlockAllocator::decref(int32_t block) {
  check_id(block);
  KV_CHECK(refcount_[block] > 0, "decref of free block " << block << " (double free)");
  if (--refcount_[block] == 0) {
    free_.push_back(block);
    return true;
  }
  return false;
}

int32_t BlockAllocator::refcount(int32_t block) const {
  check_id(block);
  return refcount_[block];
}

void BlockAllocator::check_invariants() const {
  int64_t zero = 0;
  for (int32_t r : refcount_) {
    KV_CHECK(r >= 0, "negative refcount");
    zero += (r == 0);
  }
  KV_CHECK(zero == free_blocks(), "free list has " << free_blocks() << " blocks but " << zero << " have refcount 0");
  std::vector<char> seen(refcount_.size(), 0);
  for (int32_t b : free_) {
    check_id(b);
    KV_CHECK(refcount_[b] == 0, "free block " << b << " has refcount " << refcount_[b]);
    KV_CHECK(!seen[b], "block " << b << " twice in the free list");
    seen[b] = 1;
  }
  KV_CHECK(used_blocks() + free_blocks() == total_blocks(), "used + free != total");
  KV_CHECK(high_water_ >= used_blocks(), "high-water mark below current usage");
}

}  // namespace kvserve
