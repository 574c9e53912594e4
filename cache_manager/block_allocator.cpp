#include "cache_manager/block_allocator.h"

#include <algorithm>
#include <limits>

#include "cache_manager/kv_slabs.h"
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

BlockAllocator::BlockAllocator(std::shared_ptr<KvSlabs> slabs, int64_t per_slab)
    : slabs_(std::move(slabs)), per_slab_(per_slab) {
  KV_CHECK(slabs_ && per_slab > 0, "block allocator on a shared storage needs the storage and blocks per slab");
  const int64_t n = slabs_->num_slabs() * per_slab;
  KV_CHECK(n <= std::numeric_limits<int32_t>::max(), "block count " << n << " out of range");
  refcount_.assign(static_cast<size_t>(n), 0);
  slab_used_.assign(static_cast<size_t>(slabs_->num_slabs()), 0);
  slab_free_.resize(static_cast<size_t>(slabs_->num_slabs()));
  client_ = slabs_->join();
}

BlockAllocator::~BlockAllocator() {
  if (!slabs_) return;
  for (size_t s = 0; s < slab_used_.size(); ++s) {
    if (slabs_->holder(static_cast<int32_t>(s)) == client_) slabs_->give(static_cast<int32_t>(s), client_);
  }
}

int64_t BlockAllocator::free_blocks() const {
  return slabs_ ? held_free_ + slabs_->free_slabs() * per_slab_ : static_cast<int64_t>(free_.size());
}

void BlockAllocator::check_id(int32_t block) const {
  KV_CHECK(block >= 0 && block < total_blocks(), "block id " << block << " out of range [0, " << total_blocks() << ")");
}

void BlockAllocator::take_slab(int64_t need) {
  const int32_t s = slabs_ ? slabs_->take(client_) : -1;
  KV_CHECK(s >= 0, "KV pool exhausted: need " << need << " blocks, " << free_blocks() << " free");
  // Highest first, so the slab's blocks come off its list in ascending order.
  auto& list = slab_free_[static_cast<size_t>(s)];
  for (int64_t b = (int64_t{s} + 1) * per_slab_ - 1; b >= int64_t{s} * per_slab_; --b) list.push_back(static_cast<int32_t>(b));
  held_free_ += per_slab_;
  open_.emplace(0, s);
}

int32_t BlockAllocator::pop_free() {
  if (!slabs_) {
    KV_CHECK(!free_.empty(), "KV pool exhausted: need 1 block, 0 free");
    const int32_t b = free_.back();
    free_.pop_back();
    return b;
  }
  if (open_.empty()) take_slab(1);
  const int32_t s = open_.begin()->second;
  open_.erase(open_.begin());
  auto& list = slab_free_[static_cast<size_t>(s)];
  const int32_t b = list.back();
  list.pop_back();
  --held_free_;
  const int32_t used = ++slab_used_[static_cast<size_t>(s)];
  if (!list.empty()) open_.emplace(-used, s);
  return b;
}

int32_t BlockAllocator::allocate() {
  const int32_t b = pop_free();
  refcount_[b] = 1;
  ++used_;
  high_water_ = std::max(high_water_, used_blocks());
  return b;
}

std::vector<int32_t> BlockAllocator::allocate(int64_t n) {
  KV_CHECK(n >= 0, "negative block count " << n);
  KV_CHECK(n <= free_blocks(), "KV pool exhausted: need " << n << " blocks, " << free_blocks() << " free");
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(pop_free());  // a fresh pool hands out 0, 1, 2, ...
  for (int32_t b : out) refcount_[b] = 1;
  used_ += n;
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
  if (--refcount_[block] != 0) return false;
  --used_;
  if (!slabs_) {
    free_.push_back(block);
    return true;
  }
  const int32_t s = static_cast<int32_t>(block / per_slab_);
  auto& list = slab_free_[static_cast<size_t>(s)];
  int32_t& used = slab_used_[static_cast<size_t>(s)];
  if (!list.empty()) open_.erase({-used, s});
  if (--used == 0) {
    // The slab holds nothing of ours any more: its bytes go back to the storage for any format.
    held_free_ -= static_cast<int64_t>(list.size());
    list.clear();
    slabs_->give(s, client_);
  } else {
    list.push_back(block);
    ++held_free_;
    open_.emplace(-used, s);
  }
  return true;
}

int32_t BlockAllocator::refcount(int32_t block) const {
  check_id(block);
  return refcount_[block];
}

void BlockAllocator::check_invariants() const {
  int64_t used = 0;
  for (int32_t r : refcount_) {
    KV_CHECK(r >= 0, "negative refcount");
    used += (r > 0);
  }
  KV_CHECK(used == used_, used << " blocks have a refcount but " << used_ << " are counted used");
  std::vector<char> seen(refcount_.size(), 0);
  auto see = [&](const std::vector<int32_t>& list) {
    for (int32_t b : list) {
      check_id(b);
      KV_CHECK(refcount_[b] == 0, "free block " << b << " has refcount " << refcount_[b]);
      KV_CHECK(!seen[b], "block " << b << " twice in the free lists");
      seen[b] = 1;
    }
  };
  see(free_);
  int64_t held_free = 0, open = 0;
  for (size_t s = 0; s < slab_free_.size(); ++s) {
    see(slab_free_[s]);
    for (int32_t b : slab_free_[s]) KV_CHECK(b / per_slab_ == static_cast<int64_t>(s), "block " << b << " on slab " << s << "'s free list");
    held_free += static_cast<int64_t>(slab_free_[s].size());
    if (!slab_free_[s].empty()) {
      ++open;
      KV_CHECK(open_.count({-slab_used_[s], static_cast<int32_t>(s)}) == 1, "slab " << s << " has free blocks but is not open");
    }
  }
  KV_CHECK(held_free == held_free_, held_free << " free blocks in held slabs, " << held_free_ << " counted");
  KV_CHECK(open == static_cast<int64_t>(open_.size()), open_.size() << " slabs open, " << open << " have free blocks");
  if (!slabs_) {
    KV_CHECK(used_blocks() + free_blocks() == total_blocks(), "used + free != total");
  } else {
    // A slab is ours exactly while some block of it is used; then every unused block of it is free.
    for (int64_t s = 0; s < static_cast<int64_t>(slab_used_.size()); ++s) {
      int64_t in_use = 0, in_free = 0;
      for (int64_t b = s * per_slab_; b < (s + 1) * per_slab_; ++b) {
        in_use += refcount_[static_cast<size_t>(b)] > 0;
        in_free += seen[static_cast<size_t>(b)];
      }
      const bool ours = slabs_->holder(static_cast<int32_t>(s)) == client_;
      KV_CHECK(in_use == slab_used_[static_cast<size_t>(s)], "slab " << s << " counts " << slab_used_[static_cast<size_t>(s)]
                                                                    << " used blocks, holds " << in_use);
      KV_CHECK(ours == (in_use > 0), "slab " << s << (ours ? " held with no block in use" : " not held but in use"));
      KV_CHECK(in_free == (ours ? per_slab_ - in_use : 0), "slab " << s << ": " << in_free << " of its blocks on the free list");
    }
  }
  KV_CHECK(high_water_ >= used_blocks(), "high-water mark below current usage");
}

}  // namespace kvserve
