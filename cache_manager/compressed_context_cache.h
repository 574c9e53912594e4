#pragma once
// CompressedContextCache: a context's compressed KV (a query-agnostic policy's kept entries), kept after its request for the next questions.
#include <cstdint>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cache_manager/block_allocator.h"

namespace kvserve {

class HostKvTier;

// Compress once, serve many (docs/architecture.md, "Compressed contexts"). A policy whose kept set
// depends on the context alone (kvzip, or knorm / streamingllm with `compress: context`) makes the
// compressed KV of a context a pure function of its tokens, the policy and the model: an entry
// holds it as the sequence that compressed it left it, one block table per (layer, lane) of the
// shard with its own length, and one reference on each of its blocks. Unlike PrefixCache's
// per-block chain an entry is the whole context or nothing: a kept set is only valid for the
// context it was selected from. A request that uses an entry shares its full blocks and copies its
// partly filled last blocks (PagedKvCache::adopt), so nothing ever writes an entry's blocks.
// Entries no request uses are reclaimable, least recently used first, after the prefix cache's.
// With the host-RAM tier (cache.prefix_cache_bytes, shared with the prefix cache) a reclaimed entry
// moves there instead of being dropped (PagedKvCache copies its blocks out and back; the entry keeps
// its table lengths, its tier slots and its blocks' positions), and only entries the tier cannot
// hold are dropped, tier entries least recently used first. Not thread-safe: one engine thread drives a shard's caches.
class CompressedContextCache {
 public:
  // One (layer, lane)'s kept entries: its blocks in slot order and how many slots are filled.
  struct Table {
    std::vector<int32_t> blocks;
    int64_t length = 0;
  };

  // `tables`: block tables per entry (layers x lanes of the shard).
  explicit CompressedContextCache(int64_t tables);

  // The entry for `key` holding exactly `tokens` (-1: none; a key that matches other tokens is a miss).
  int32_t find(uint64_t key, std::span<const int64_t> tokens) const;
  const std::vector<Table>& tables(int32_t entry) const;
  // Inserts an entry that takes over the references in `tables`; `full_blocks` is what the
  // context holds uncompressed (shown beside the entry's own count). Returns -1 when the key is
  // taken (the caller keeps, and drops, its references).
  int32_t insert(uint64_t key, std::vector<int64_t> tokens, std::vector<Table> tables, int64_t full_blocks);

  // A request starts (acquire) or stops (release) using an entry; release marks it used now.
  void acquire(int32_t entry);
  void release(int32_t entry);
  int64_t users(int32_t entry) const;

  // Drops entries without users, least recently used first, until `alloc` has `need` free blocks
  // or none is left; returns whether it has them.
  bool reclaim(int64_t need, BlockAllocator& alloc);
  // Drops every entry without users (in the pool and in the tier).
  void clear(BlockAllocator& alloc);

  // --- the host tier (PagedKvCache moves the data; the cache keeps the books) -------------------
  void attach_tier(HostKvTier* tier) { tier_ = tier; }
  // Whether an entry's blocks are in the tier (its tables then hold lengths only).
  bool on_host(int32_t entry) const;
  // The least recently used entry without users in the pool (-1: none).
  int32_t oldest_idle() const { return lru_.empty() ? -1 : lru_.begin()->second; }
  // Drops one idle entry (freeing its blocks, or its tier slots).
  void drop(int32_t entry, BlockAllocator& alloc);
  // Drops idle tier entries, least recently used first, until the tier has `slots` free; whether it has.
  bool make_tier_room(int64_t slots, BlockAllocator& alloc);
  // An idle pool entry whose blocks (in table order) the caller copied into tier `slots`, with
  // their per-head positions: the entry gives up its pool blocks.
  void moved_to_host(int32_t entry, std::vector<int32_t> slots, std::vector<int32_t> positions, BlockAllocator& alloc);
  // A tier entry's slots and positions, for the copy back.
  const std::vector<int32_t>& host_slots(int32_t entry) const;
  const std::vector<int32_t>& host_positions(int32_t entry) const;
  // A tier entry (in use: the caller acquired it) whose data the caller copied into `blocks` (one
  // reference each, table order): the entry holds them and frees its tier slots.
  void moved_to_pool(int32_t entry, const std::vector<int32_t>& blocks);
  // Entries in the tier and the slots they hold.
  int64_t host_entries() const { return host_entries_; }
  int64_t host_slots_used() const { return host_slots_; }

  int64_t num_entries() const { return static_cast<int64_t>(index_.size()); }
  // Pool blocks the entries hold (shared with requests or not), those of entries without users, and
  // what the same contexts would hold uncompressed (tier entries included).
  int64_t cached_blocks() const { return blocks_; }
  int64_t reclaimable_blocks() const { return idle_blocks_; }
  int64_t full_blocks() const { return full_blocks_; }
  // References the cache holds on each pool block (for the pool's invariant check).
  void count_refs(std::vector<int32_t>& refs) const;
  // Appends the pool blocks of the entries without users (reclaimable_blocks() of them).
  void idle_blocks(std::vector<int32_t>& out) const;
  void check_invariants() const;

 private:
  struct Entry {
    bool live = false;
    uint64_t key = 0;
    std::vector<int64_t> tokens;
    std::vector<Table> tables;
    int64_t blocks = 0, full_blocks = 0;  // blocks: what its tables hold in the pool (also while in the tier)
    // In the tier: its slots, its blocks' per-head positions and each table's block count.
    std::vector<int32_t> slots, positions;
    std::vector<int64_t> table_blocks;
    int64_t users = 0;
    uint64_t last_use = 0;
  };
  using Victim = std::pair<uint64_t, int32_t>;  // last_use, id
  void check_entry(int32_t id) const;
  void evict(int32_t id, BlockAllocator& alloc);

  int64_t tables_;
  std::vector<Entry> entries_;
  std::vector<int32_t> free_ids_;
  std::unordered_map<uint64_t, int32_t> index_;
  std::set<Victim> lru_;       // pool entries without users
  std::set<Victim> host_lru_;  // tier entries without users
  HostKvTier* tier_ = nullptr;
  int64_t blocks_ = 0, idle_blocks_ = 0, full_blocks_ = 0;
  int64_t host_entries_ = 0, host_slots_ = 0;
  uint64_t clock_ = 0;
};

}  // namespace kvserve
