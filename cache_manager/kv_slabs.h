#pragma once
// KvSlabs: one storage of KV bytes shared by paged caches that store K/V in different formats.
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "cache_manager/kv_block_pool.h"

namespace kvserve {

// A sequence's KV precision may differ from its neighbours' (an int8 cache and an int4 cache side
// by side, each with its own block tables and kernels) while the bytes stay one budget: the storage
// is cut into slabs of slab_bytes(), a common multiple of every format's block bytes (9 int8 blocks
// = 17 int4 blocks at any head_dim), and each cache's BlockAllocator takes a slab when its free list
// runs dry and gives it back once none of its blocks is used. A slab belongs to one allocator at a
// time, so no two formats ever see the same bytes, and no kernel learns of the sharing: each cache
// reads a KvBlockPool view of the whole storage in its own block size.
// Not thread-safe: one engine thread drives every cache of a shard.
class KvSlabs {
 public:
  // The caches' formats (KvPoolOptions as PagedKvCache takes them: dtype, quant, heads, head_dim,
  // block_size, device, head_blocks); sized as formats[0]'s own pool would be (num_blocks,
  // kv_cache_bytes or device_memory_fraction, counted in formats[0]'s blocks), rounded down to slabs.
  explicit KvSlabs(const std::vector<KvPoolOptions>& formats);
  // A bare storage of num_slabs slabs (allocators and tests that need no formats).
  KvSlabs(int64_t num_slabs, int64_t slab_bytes, torch::Device device = torch::kCPU);

  // The least common multiple of the formats' block bytes; throws naming them when it would hold
  // more than kMaxBlocksPerSlab of the smallest format's blocks, or when they differ in device.
  static int64_t slab_bytes_of(const std::vector<KvPoolOptions>& formats);
  static constexpr int64_t kMaxBlocksPerSlab = 2048;
  // Bytes of one block of a cache built with these options (a head-wise cache's block holds one head).
  static int64_t block_bytes_of(const KvPoolOptions& o);

  const torch::Tensor& storage() const { return storage_; }  // uint8 [num_slabs * slab_bytes]
  int64_t num_slabs() const { return static_cast<int64_t>(holder_.size()); }
  int64_t slab_bytes() const { return slab_bytes_; }
  int64_t free_slabs() const { return static_cast<int64_t>(free_.size()); }
  torch::Device device() const { return storage_.device(); }
  // The most slabs held at once since the start or the last reset (a new measurement window).
  int64_t high_water_slabs() const { return high_water_; }
  void reset_high_water() { high_water_ = num_slabs() - free_slabs(); }

  // A new holder of slabs (one per allocator); its id names it to take, give and holder.
  int join();
  // A free slab for `client` (-1 when none is free), and one it gives back.
  int32_t take(int client);
  void give(int32_t slab, int client);
  // Who holds a slab (-1: free).
  int holder(int32_t slab) const;

  // What a cache runs when another cache is short of slabs: free cached blocks no request uses
  // (prefix-cache and compressed-context entries) until free_slabs() >= slabs or it has none left.
  using Reclaimer = std::function<void(int64_t slabs)>;
  void set_reclaimer(int client, Reclaimer fn);
  // Asks every other client's reclaimer in turn until free_slabs() >= slabs; whether it is.
  bool reclaim_for(int client, int64_t slabs);

  void check_invariants() const;

 private:
  static int64_t slabs_for(const std::vector<KvPoolOptions>& formats);
  void check_slab(int32_t slab) const;
  int64_t slab_bytes_ = 0;
  torch::Tensor storage_;
  std::vector<int> holder_;     // per slab: its client, -1 when free
  std::vector<int32_t> free_;   // LIFO; a fresh storage hands out 0, 1, 2, ...
  std::vector<Reclaimer> reclaimers_;  // per client (empty: nothing to reclaim)
  int64_t high_water_ = 0;
  bool reclaiming_ = false;     // a reclaimer that frees blocks never asks the others in turn
};

}  // namespace kvserve
