#pragma once
// PrefixCache: full-precision prompt blocks kept after their request, content-addressed by a hash chain.
#include <cstdint>
#include <functional>
#include <set>
#include <span>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cache_manager/block_allocator.h"

namespace kvserve {

// Automatic prefix caching for one shard's pool (docs/architecture.md, "Prefix caching"). An entry
// is one full block of prompt tokens at a fixed place in a prompt: its key hashes the parent
// entry's key, the block's tokens and a salt naming everything else that changes the K/V (model,
// dtypes, RoPE, shard layout). It holds one pool block per layer of the shard, each with one
// reference of its own, so the K/V outlive the request that computed them. A request that uses an
// entry is one of its users; entries without users are reclaimable and go least recently used
// first, leaves before their parents (a child is unreachable without its parent), so that the
// pool sees them as free. Not thread-safe: one engine thread drives a shard's cache.
class PrefixCache {
 public:
  // How a block's key is made from its parent's key and its tokens (the default mixes in the salt;
  // tests pass a weak one to make collisions happen).
  using KeyFn = std::function<uint64_t(uint64_t parent_key, std::span<const int64_t> block_tokens)>;
  PrefixCache(int64_t num_layers, int64_t block_size, uint64_t salt, KeyFn key_fn = nullptr);

  int64_t block_size() const { return block_size_; }
  // The chain key of a block under `parent_key` (0 for the first block).
  uint64_t key(uint64_t parent_key, std::span<const int64_t> block_tokens) const;

  // Entries (ids, in prompt order) of the longest run of cached blocks that starts `tokens`, at
  // most max_blocks. A key that matches with other tokens or another parent is a miss (no aliasing).
  std::vector<int32_t> match(std::span<const int64_t> tokens, int64_t max_blocks) const;
  // The pool blocks of an entry, one per layer of the shard.
  const std::vector<int32_t>& blocks(int32_t entry) const;

  // A request starts (acquire) or stops (release) using the entries; release marks them used now.
  void acquire(const std::vector<int32_t>& entries);
  void release(const std::vector<int32_t>& entries);

  // Inserts the block of tokens that follows `parent` (-1: the first block of a prompt), held in
  // `blocks` (one per layer; the cache takes a reference on each). Returns the new entry, or -1
  // when the key is taken (the same content was cached meanwhile, or a collision): the caller then
  // stops caching that prompt, so an entry's users are always users of its parent too.
  int32_t insert(int32_t parent, std::span<const int64_t> block_tokens, const std::vector<int32_t>& blocks,
                 BlockAllocator& alloc);

  // Evicts reclaimable entries, least recently used first, until `alloc` has `need` free blocks
  // or none is left; returns whether it has them.
  bool reclaim(int64_t need, BlockAllocator& alloc);
  // Drops every reclaimable entry (tests, a cache flush).
  void clear(BlockAllocator& alloc) { reclaim(alloc.total_blocks() + 1, alloc); }

  int64_t num_entries() const { return static_cast<int64_t>(index_.size()); }
  // Pool blocks held by entries (reclaimable or not), and by reclaimable ones.
  int64_t cached_blocks() const { return num_entries() * num_layers_; }
  int64_t reclaimable_blocks() const { return idle_ * num_layers_; }
  // References the cache holds on each pool block (for the pool's invariant check).
  void count_refs(std::vector<int32_t>& refs) const;
  // Full consistency check: index, tree links, users and the eviction order agree.
  void check_invariants() const;

 private:
  struct Entry {
    bool live = false;
    uint64_t key = 0;
    int32_t parent = -1;
    int32_t depth = 0;
    std::vector<int64_t> tokens;
    std::vector<int32_t> blocks;
    int64_t users = 0;
    int64_t children = 0;
    uint64_t last_use = 0;
  };
  // Eviction order: oldest use first, then the deepest (a prompt's tail goes before its head).
  using Victim = std::tuple<uint64_t, int32_t, int32_t>;  // last_use, -depth, id
  Victim victim(int32_t id) const { return {entries_[id].last_use, -entries_[id].depth, id}; }
  bool evictable(const Entry& e) const { return e.live && e.users == 0 && e.children == 0; }
  void check_entry(int32_t id) const;
  void evict(int32_t id, BlockAllocator& alloc);

  int64_t num_layers_, block_size_;
  uint64_t salt_;
  KeyFn key_fn_;
  std::vector<Entry> entries_;
  std::vector<int32_t> free_ids_;
  std::unordered_map<uint64_t, int32_t> index_;
  std::set<Victim> lru_;  // evictable entries
  int64_t idle_ = 0;      // live entries without users
  uint64_t clock_ = 0;
};

}  // namespace kvserve
