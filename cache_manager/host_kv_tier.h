#pragma once
// HostKvTier: host-RAM slots that hold whole prefix-cache entries (every layer's block) outside the KV pool.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "cache_manager/block_allocator.h"
#include "cache_manager/kv_block_pool.h"

namespace kvserve {

// The prefix cache's second tier (cache.prefix_cache_bytes). An idle cached block that the pool
// needs back is copied here instead of being dropped, and copied back into pool blocks when a
// prompt hits it, so cached documents do not take the pool memory that compression frees. One
// slot holds one entry: its blocks of every layer, contiguous [layers, 2, KV, bs, D], so a copy
// either way is one transfer of one slot. On a CUDA pool the slots are pinned and the copies are
// asynchronous on the current stream (stream order keeps them correct: a pool block freed after
// a copy-out is rewritten only by later work on that stream). Not thread-safe.
class HostKvTier {
 public:
  // `bytes` of slots for entries of `num_layers` blocks of `pool`; throws when no slot fits.
  HostKvTier(const KvBlockPool& pool, int64_t num_layers, int64_t bytes);

  static int64_t slot_bytes(const KvBlockPool& pool, int64_t num_layers) { return pool.block_bytes() * num_layers; }

  // Takes a slot and copies the pool blocks (one per layer) into it; throws KvError when full.
  int32_t store(const std::vector<int32_t>& pool_blocks);
  // Copies a slot into the pool blocks (one per layer); the slot stays taken.
  void load(int32_t slot, const std::vector<int32_t>& pool_blocks);
  void free(int32_t slot);

  int64_t num_slots() const { return slots_.total_blocks(); }
  int64_t free_slots() const { return slots_.free_blocks(); }
  int64_t used_slots() const { return slots_.used_blocks(); }
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t total_bytes() const { return slot_bytes_ * num_slots(); }
  // Entries copied out to the tier and back into the pool since the start.
  int64_t stores() const { return stores_; }
  int64_t loads() const { return loads_; }
  void check_invariants() const { slots_.check_invariants(); }

 private:
  torch::Tensor index_of(const std::vector<int32_t>& pool_blocks) const;

  const KvBlockPool& pool_;
  int64_t num_layers_, slot_bytes_;
  BlockAllocator slots_;
  torch::Tensor storage_;  // [slots, layers, 2, KV, bs, D] in host memory (pinned for a CUDA pool)
  int64_t stores_ = 0, loads_ = 0;
};

}  // namespace kvserve
