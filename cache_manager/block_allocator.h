#pragma once
// BlockAllocator: which pool blocks are free, and who still references the others.
#include <cstdint>
#include <memory>
#include <set>
#include <utility>
#include <vector>

namespace kvserve {

class KvSlabs;

// Hands out block ids from a fixed pool; reference counts let several block tables share one
// block later (prefix sharing), so a block returns to the free list only when its last holder lets go.
// Not thread-safe: one engine thread drives a shard's cache.
class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);
  // Blocks carved from the slabs of a storage shared with other allocators (cache_manager/kv_slabs.h):
  // per_slab blocks fill one slab, block b lies in slab b / per_slab, and ids cover the whole
  // storage. A slab is taken when no slab held has a free block and given back as soon as none of
  // its blocks is used, so free_blocks() counts the storage's free slabs too. Allocations fill the
  // fullest slab held first: the emptiest ones then drain and go back to the storage, where a LIFO
  // list would keep handing out the block freed last and leave every slab a few blocks used.
  BlockAllocator(std::shared_ptr<KvSlabs> slabs, int64_t per_slab);
  ~BlockAllocator();
  BlockAllocator(BlockAllocator&&) noexcept = default;
  BlockAllocator(const BlockAllocator&) = delete;
  BlockAllocator& operator=(const BlockAllocator&) = delete;
  BlockAllocator& operator=(BlockAllocator&&) = delete;

  // One block with reference count 1; throws KvError when none is free.
  int32_t allocate();
  // All-or-nothing: n blocks, or a KvError and no change.
  std::vector<int32_t> allocate(int64_t n);
  void incref(int32_t block);
  // Returns true when this released the last reference (the block is free again).
  bool decref(int32_t block);
  int32_t refcount(int32_t block) const;

  int64_t total_blocks() const { return static_cast<int64_t>(refcount_.size()); }
  // What an allocation may take now: on a shared storage this allocator's free blocks and every
  // free slab's (so used + free < total while other allocators hold slabs).
  int64_t free_blocks() const;
  int64_t used_blocks() const { return used_; }
  int64_t high_water_blocks() const { return high_water_; }
  // Starts a new measurement window (e.g. one prefill) at the current usage.
  void reset_high_water() { high_water_ = used_blocks(); }

  // A shared storage's allocator: its client id there and blocks per slab (-1 / 0 otherwise).
  int slab_client() const { return client_; }
  int64_t blocks_per_slab() const { return per_slab_; }
  // A shared storage's slab: this allocator's blocks in use there (0 for a slab it does not hold).
  int32_t slab_used(int64_t slab) const { return slab_used_.at(static_cast<size_t>(slab)); }

  // Full O(total) consistency check: used + free == total (alone), free list matches zero refcounts.
  void check_invariants() const;

 private:
  void check_id(int32_t block) const;
  // A free block taken off its list (a shared storage's fullest slab with one, else a new slab).
  int32_t pop_free();
  // Takes a slab from the shared storage; throws the exhaustion error when none is free.
  void take_slab(int64_t need);
  std::vector<int32_t> refcount_;
  std::vector<int32_t> free_;  // own pool: LIFO, recently freed blocks are likely still in cache
  int64_t used_ = 0;
  int64_t high_water_ = 0;
  std::shared_ptr<KvSlabs> slabs_;
  int client_ = -1;
  int64_t per_slab_ = 0;
  std::vector<int32_t> slab_used_;                // per slab of the storage: this allocator's used blocks in it
  std::vector<std::vector<int32_t>> slab_free_;   // per slab held: its free blocks (LIFO within the slab)
  std::set<std::pair<int32_t, int32_t>> open_;    // (-used, slab) of the held slabs with a free block: fullest first
  int64_t held_free_ = 0;                         // free blocks in held slabs
};

}  // namespace kvserve
