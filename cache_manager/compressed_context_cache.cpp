#include "cache_manager/compressed_context_cache.h"

#include <algorithm>

#include "cache_manager/host_kv_tier.h"
#include "common/check.h"

namespace kvserve {

CompressedContextCache::CompressedContextCache(int64_t tables) : tables_(tables) {
  KV_CHECK(tables > 0, "compressed context cache needs at least one block table per entry");
}

void CompressedContextCache::check_entry(int32_t id) const {
  KV_CHECK(id >= 0 && id < static_cast<int32_t>(entries_.size()) && entries_[static_cast<size_t>(id)].live,
           "compressed context cache: no entry " << id);
}

int32_t CompressedContextCache::find(uint64_t key, std::span<const int64_t> tokens) const {
  auto it = index_.find(key);
  if (it == index_.end()) return -1;
  const Entry& e = entries_[static_cast<size_t>(it->second)];
  return std::equal(tokens.begin(), tokens.end(), e.tokens.begin(), e.tokens.end()) ? it->second : -1;
}

const std::vector<CompressedContextCache::Table>& CompressedContextCache::tables(int32_t entry) const {
  check_entry(entry);
  return entries_[static_cast<size_t>(entry)].tables;
}

int32_t CompressedContextCache::insert(uint64_t key, std::vector<int64_t> tokens, std::vector<Table> tables,
                                       int64_t full_blocks) {
  KV_CHECK(static_cast<int64_t>(tables.size()) == tables_,
           "compressed context cache: an entry has " << tables_ << " block tables, got " << tables.size());
  if (index_.count(key)) return -1;
  int32_t id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<int32_t>(entries_.size());
    entries_.emplace_back();
  }
  Entry& e = entries_[static_cast<size_t>(id)];
  e.live = true;
  e.key = key;
  e.tokens = std::move(tokens);
  e.tables = std::move(tables);
  e.blocks = 0;
  for (const Table& t : e.tables) e.blocks += static_cast<int64_t>(t.blocks.size());
  e.full_blocks = full_blocks;
  e.users = 0;
  e.last_use = ++clock_;
  index_[key] = id;
  lru_.insert({e.last_use, id});
  blocks_ += e.blocks;
  idle_blocks_ += e.blocks;
  full_blocks_ += e.full_blocks;
  return id;
}

void CompressedContextCache::acquire(int32_t entry) {
  check_entry(entry);
  Entry& e = entries_[static_cast<size_t>(entry)];
  if (e.users++ == 0) {
    if (!e.slots.empty()) {
      host_lru_.erase({e.last_use, entry});
    } else {
      lru_.erase({e.last_use, entry});
      idle_blocks_ -= e.blocks;
    }
  }
}

void CompressedContextCache::release(int32_t entry) {
  check_entry(entry);
  Entry& e = entries_[static_cast<size_t>(entry)];
  KV_CHECK(e.users > 0, "compressed context cache: entry " << entry << " released more often than acquired");
  e.last_use = ++clock_;
  if (--e.users == 0) {
    if (!e.slots.empty()) {
      host_lru_.insert({e.last_use, entry});
    } else {
      lru_.insert({e.last_use, entry});
      idle_blocks_ += e.blocks;
    }
  }
}

int64_t CompressedContextCache::users(int32_t entry) const {
  check_entry(entry);
  return entries_[static_cast<size_t>(entry)].users;
}

void CompressedContextCache::evict(int32_t id, BlockAllocator& alloc) {
  Entry& e = entries_[static_cast<size_t>(id)];
  KV_CHECK(e.live && e.users == 0, "compressed context cache: entry " << id << " is in use");
  index_.erase(e.key);
  if (!e.slots.empty()) {
    host_lru_.erase({e.last_use, id});
    for (int32_t slot : e.slots) tier_->free(slot);
    --host_entries_;
    host_slots_ -= static_cast<int64_t>(e.slots.size());
  } else {
    lru_.erase({e.last_use, id});
    for (Table& t : e.tables)
      for (int32_t b : t.blocks) alloc.decref(b);
    blocks_ -= e.blocks;
    idle_blocks_ -= e.blocks;
  }
  full_blocks_ -= e.full_blocks;
  e = Entry{};
  free_ids_.push_back(id);
}

bool CompressedContextCache::reclaim(int64_t need, BlockAllocator& alloc) {
  while (alloc.free_blocks() < need && !lru_.empty()) evict(lru_.begin()->second, alloc);
  return alloc.free_blocks() >= need;
}

void CompressedContextCache::clear(BlockAllocator& alloc) {
  while (!lru_.empty()) evict(lru_.begin()->second, alloc);
  while (!host_lru_.empty()) evict(host_lru_.begin()->second, alloc);
}

bool CompressedContextCache::on_host(int32_t entry) const {
  check_entry(entry);
  return !entries_[static_cast<size_t>(entry)].slots.empty();
}

void CompressedContextCache::drop(int32_t entry, BlockAllocator& alloc) {
  check_entry(entry);
  evict(entry, alloc);
}

bool CompressedContextCache::make_tier_room(int64_t slots, BlockAllocator& alloc) {
  if (!tier_) return false;
  while (tier_->free_slots() < slots && !host_lru_.empty()) evict(host_lru_.begin()->second, alloc);
  return tier_->free_slots() >= slots;
}

void CompressedContextCache::moved_to_host(int32_t entry, std::vector<int32_t> slots, std::vector<int32_t> positions,
                                           BlockAllocator& alloc) {
  check_entry(entry);
  Entry& e = entries_[static_cast<size_t>(entry)];
  KV_CHECK(tier_ && e.users == 0 && e.slots.empty() && !slots.empty(),
           "compressed context cache: entry " << entry << " cannot move to the host tier");
  lru_.erase({e.last_use, entry});
  e.table_blocks.clear();
  for (Table& t : e.tables) {
    e.table_blocks.push_back(static_cast<int64_t>(t.blocks.size()));
    for (int32_t b : t.blocks) alloc.decref(b);
    t.blocks.clear();
  }
  blocks_ -= e.blocks;
  idle_blocks_ -= e.blocks;
  host_slots_ += static_cast<int64_t>(slots.size());
  ++host_entries_;
  e.slots = std::move(slots);
  e.positions = std::move(positions);
  host_lru_.insert({e.last_use, entry});
}

const std::vector<int32_t>& CompressedContextCache::host_slots(int32_t entry) const {
  check_entry(entry);
  return entries_[static_cast<size_t>(entry)].slots;
}

const std::vector<int32_t>& CompressedContextCache::host_positions(int32_t entry) const {
  check_entry(entry);
  return entries_[static_cast<size_t>(entry)].positions;
}

void CompressedContextCache::moved_to_pool(int32_t entry, const std::vector<int32_t>& blocks) {
  check_entry(entry);
  Entry& e = entries_[static_cast<size_t>(entry)];
  KV_CHECK(!e.slots.empty() && e.users > 0 && static_cast<int64_t>(blocks.size()) == e.blocks,
           "compressed context cache: entry " << entry << " cannot come back with " << blocks.size() << " blocks");
  size_t next = 0;
  for (size_t i = 0; i < e.tables.size(); ++i) {
    Table& t = e.tables[i];
    const auto n = static_cast<size_t>(e.table_blocks.at(i));
    t.blocks.assign(blocks.begin() + static_cast<std::ptrdiff_t>(next), blocks.begin() + static_cast<std::ptrdiff_t>(next + n));
    next += n;
  }
  for (int32_t slot : e.slots) tier_->free(slot);
  --host_entries_;
  host_slots_ -= static_cast<int64_t>(e.slots.size());
  e.slots.clear();
  e.positions.clear();
  e.table_blocks.clear();
  blocks_ += e.blocks;
}

void CompressedContextCache::count_refs(std::vector<int32_t>& refs) const {
  for (const Entry& e : entries_)
    if (e.live)
      for (const Table& t : e.tables)
        for (int32_t b : t.blocks) ++refs[static_cast<size_t>(b)];
}

void CompressedContextCache::idle_blocks(std::vector<int32_t>& out) const {
  for (const auto& [last_use, id] : lru_)
    for (const Table& t : entries_[static_cast<size_t>(id)].tables) out.insert(out.end(), t.blocks.begin(), t.blocks.end());
}

void CompressedContextCache::check_invariants() const {
  int64_t live = 0, blocks = 0, idle = 0, full = 0, idle_entries = 0, host_entries = 0, host_slots = 0, host_idle = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (!e.live) continue;
    ++live;
    auto it = index_.find(e.key);
    KV_CHECK(it != index_.end() && it->second == static_cast<int32_t>(i), "compressed context cache: entry " << i
                                                                              << " is not indexed under its key");
    const bool host = !e.slots.empty();
    int64_t n = 0;
    for (size_t ti = 0; ti < e.tables.size(); ++ti) {
      const Table& t = e.tables[ti];
      const int64_t held = host ? e.table_blocks.at(ti) : static_cast<int64_t>(t.blocks.size());
      KV_CHECK(t.length >= 0 && (t.length == 0) == (held == 0) && (!host || t.blocks.empty()),
               "compressed context cache: entry " << i << " holds " << held << " blocks for " << t.length << " slots");
      n += held;
    }
    KV_CHECK(n == e.blocks, "compressed context cache: entry " << i << " counts " << e.blocks << " blocks, holds " << n);
    full += e.full_blocks;
    const Victim v{e.last_use, static_cast<int32_t>(i)};
    const bool listed = (host ? host_lru_ : lru_).count(v) != 0;
    KV_CHECK(listed == (e.users == 0), "compressed context cache: entry " << i << " with " << e.users
                                                                            << " users is " << (listed ? "" : "not ")
                                                                            << "in the eviction order");
    KV_CHECK((host ? lru_ : host_lru_).count(v) == 0, "compressed context cache: entry " << i << " listed in the wrong tier");
    if (host) {
      ++host_entries, host_slots += static_cast<int64_t>(e.slots.size());
      host_idle += e.users == 0;
      KV_CHECK(tier_ && !e.positions.empty(), "compressed context cache: entry " << i << " is in a tier without one");
      continue;
    }
    blocks += n;
    if (e.users == 0) idle += n, ++idle_entries;
  }
  KV_CHECK(host_entries == host_entries_ && host_slots == host_slots_ && host_idle == static_cast<int64_t>(host_lru_.size()),
           "compressed context cache: " << host_entries << " tier entries holding " << host_slots << " slots, counted "
                                        << host_entries_ << " and " << host_slots_);
  KV_CHECK(live == static_cast<int64_t>(index_.size()) && idle_entries == static_cast<int64_t>(lru_.size()),
           "compressed context cache: " << live << " entries, " << index_.size() << " indexed, " << lru_.size()
                                        << " idle listed");
  KV_CHECK(blocks == blocks_ && idle == idle_blocks_ && full == full_blocks_,
           "compressed context cache: block counts drifted");
}

}  // namespace kvserve
