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
#include "cache_manager/host_kv_tier.h"

namespace kvserve {

// Automatic prefix caching for one shard's pool (docs/architecture.md, "Prefix caching"). An entry
// is one full block of prompt tokens at a fixed place in a prompt: its key hashes the parent
// entry's key, the block's tokens and a salt naming everything else that changes the K/V (model,
// dtypes, RoPE, shard layout). It holds one pool block per layer of the shard, each with one
// reference of its own, so the K/V outlive the request that computed them. A request that uses an
// entry is one of its users; entries without users are reclaimable and go least recently used
// first, leaves before their parents (a child is unreachable without its parent), so that the
// pool sees them as free. With a host tier attached, an idle entry the pool needs back is moved
// there (copied out, its pool blocks freed) rather than dropped, and a hit on it is moved back
// (promote); only entries the tier cannot take are dropped. Not thread-safe: one engine thread
// drives a shard's cache.
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
  // The pool blocks of an entry, one per layer of the shard (it must be in the pool: promote first).
  const std::vector<int32_t>& blocks(int32_t entry) const;
  // The entry's block index in its prompt (its tokens are at positions depth * block_size + i).
  int32_t depth(int32_t entry) const;

  // A second tier for idle entries (cache.prefix_cache_bytes); the tier must outlive the cache.
  void attach_tier(HostKvTier* tier) { tier_ = tier; }
  const HostKvTier* tier() const { return tier_; }
  // Whether an entry's blocks are in the host tier, not the pool.
  bool on_host(int32_t entry) const;
  // Requests using the entry now (acquire minus release).
  int64_t users(int32_t entry) const;
  // Brings an entry that is on the host back into fresh pool blocks (reclaiming others if the pool
  // is short) and returns them; the entry must have a user (acquire first). Throws KvError when
  // the pool has no room, leaving the entry on the host.
  const std::vector<int32_t>& promote(int32_t entry, BlockAllocator& alloc);

  // A request starts (acquire) or stops (release) using the entries; release marks them used now.
  void acquire(const std::vector<int32_t>& entries);
  void release(const std::vector<int32_t>& entries);

  // Inserts the block of tokens that follows `parent` (-1: the first block of a prompt), held in
  // `blocks` (one per layer; the cache takes a reference on each). Returns the new entry, or -1
  // when the key is taken (the same content was cached meanwhile, or a collision): the caller then
  // stops caching that prompt, so an entry's users are always users of its parent too.
  int32_t insert(int32_t parent, std::span<const int64_t> block_tokens, const std::vector<int32_t>& blocks,
                 BlockAllocator& alloc);

  // Frees pool blocks of reclaimable entries, least recently used first, until `alloc` has `need`
  // free blocks or none is left; returns whether it has them. With a tier, an entry is moved there
  // while it has room (making room by dropping its own least recently used leaves); else dropped.
  bool reclaim(int64_t need, BlockAllocator& alloc);
  // Drops every entry without users, in the pool and in the tier (tests, a cache flush).
  void clear(BlockAllocator& alloc);

  int64_t num_entries() const { return static_cast<int64_t>(index_.size()); }
  // Pool blocks held by entries (reclaimable or not), and by reclaimable ones.
  int64_t cached_blocks() const { return (num_entries() - on_host_) * num_layers_; }
  int64_t reclaimable_blocks() const { return idle_ * num_layers_; }
  // Entries whose blocks are in the host tier.
  int64_t host_entries() const { return on_host_; }
  // References the cache holds on each pool block (for the pool's invariant check).
  void count_refs(std::vector<int32_t>& refs) const;
  // Appends the pool blocks of the reclaimable entries (reclaimable_blocks() of them).
  void idle_blocks(std::vector<int32_t>& out) const;
  // Full consistency check: index, tree links, users and the eviction order agree.
  // other_tier_slots: tier slots held by others (compressed contexts share the tier).
  void check_invariants(int64_t other_tier_slots = 0) const;

 private:
  struct Entry {
    bool live = false;
    uint64_t key = 0;
    int32_t parent = -1;
    int32_t depth = 0;
    std::vector<int64_t> tokens;
    std::vector<int32_t> blocks;  // pool blocks, one per layer (empty while on the host)
    int32_t slot = -1;            // host tier slot while on the host
    int64_t users = 0;
    int64_t children = 0;
    uint64_t last_use = 0;
  };
  // Eviction order: oldest use first, then the deepest (a prompt's tail goes before its head).
  using Victim = std::tuple<uint64_t, int32_t, int32_t>;  // last_use, -depth, id
  Victim victim(int32_t id) const { return {entries_[id].last_use, -entries_[id].depth, id}; }
  // Idle entries in the pool: their blocks can go to the tier (any of them) or be dropped (leaves).
  bool movable(const Entry& e) const { return e.live && e.slot < 0 && e.users == 0; }
  bool evictable(const Entry& e) const { return movable(e) && e.children == 0; }
  // Entries in the tier that can be dropped to make room there.
  bool host_evictable(const Entry& e) const { return e.live && e.slot >= 0 && e.users == 0 && e.children == 0; }
  // Takes an entry out of the eviction orders before its state changes, and puts it back after.
  void unlist(int32_t id);
  void list(int32_t id);
  void check_entry(int32_t id) const;
  void evict(int32_t id, BlockAllocator& alloc);
  void move_to_host(int32_t id, BlockAllocator& alloc);
  bool make_host_room(BlockAllocator& alloc);

  int64_t num_layers_, block_size_;
  uint64_t salt_;
  KeyFn key_fn_;
  std::vector<Entry> entries_;
  std::vector<int32_t> free_ids_;
  std::unordered_map<uint64_t, int32_t> index_;
  std::set<Victim> lru_;       // evictable entries
  std::set<Victim> movable_;   // movable entries (with a tier)
  std::set<Victim> host_lru_;  // host_evictable entries
  HostKvTier* tier_ = nullptr;
  int64_t idle_ = 0;     // entries in the pool without users
  int64_t on_host_ = 0;  // entries in the tier
  uint64_t clock_ = 0;
};

}  // namespace kvserve
