#include "cache_manager/prefix_cache.h"

#include <algorithm>
#include <utility>

#include "common/check.h"
#include "common/hash_mix.h"

namespace kvserve {

PrefixCache::PrefixCache(int64_t num_layers, int64_t block_size, uint64_t salt, KeyFn key_fn)
    : num_layers_(num_layers), block_size_(block_size), salt_(salt), key_fn_(std::move(key_fn)) {
  KV_CHECK(num_layers > 0 && block_size > 0, "prefix cache needs layers and a block size");
}

uint64_t PrefixCache::key(uint64_t parent_key, std::span<const int64_t> block_tokens) const {
  if (key_fn_) {
    const uint64_t h = key_fn_(parent_key, block_tokens);
    return h == 0 ? 1 : h;
  }
  uint64_t h = mix64(salt_ ^ mix64(parent_key));
  for (int64_t t : block_tokens) h = mix64(h ^ static_cast<uint64_t>(t));
  // 0 is the root's key: no entry may have it.
  return h == 0 ? 1 : h;
}

void PrefixCache::check_entry(int32_t id) const {
  KV_CHECK(id >= 0 && id < static_cast<int32_t>(entries_.size()) && entries_[id].live,
           "prefix cache: no entry " << id);
}

std::vector<int32_t> PrefixCache::match(std::span<const int64_t> tokens, int64_t max_blocks) const {
  std::vector<int32_t> out;
  uint64_t parent_key = 0;
  int32_t parent = -1;
  const int64_t n = std::min<int64_t>(max_blocks, static_cast<int64_t>(tokens.size()) / block_size_);
  for (int64_t b = 0; b < n; ++b) {
    const auto block = tokens.subspan(static_cast<size_t>(b * block_size_), static_cast<size_t>(block_size_));
    const uint64_t k = key(parent_key, block);
    auto it = index_.find(k);
    if (it == index_.end()) break;
    const Entry& e = entries_[it->second];
    if (e.parent != parent || !std::equal(block.begin(), block.end(), e.tokens.begin(), e.tokens.end())) break;
    out.push_back(it->second);
    parent = it->second;
    parent_key = k;
  }
  return out;
}

const std::vector<int32_t>& PrefixCache::blocks(int32_t entry) const {
  check_entry(entry);
  KV_CHECK(entries_[entry].slot < 0, "prefix cache: entry " << entry << " is in the host tier (promote it first)");
  return entries_[entry].blocks;
}

int32_t PrefixCache::depth(int32_t entry) const {
  check_entry(entry);
  return entries_[entry].depth;
}

bool PrefixCache::on_host(int32_t entry) const {
  check_entry(entry);
  return entries_[entry].slot >= 0;
}

int64_t PrefixCache::users(int32_t entry) const {
  check_entry(entry);
  return entries_[entry].users;
}

// Every change of an entry's users, children, last use or tier goes between these two, which keep
// the eviction orders and the idle / on-host counts.
void PrefixCache::unlist(int32_t id) {
  const Entry& e = entries_[id];
  if (!e.live) return;
  const Victim v = victim(id);
  lru_.erase(v);
  movable_.erase(v);
  host_lru_.erase(v);
  idle_ -= e.slot < 0 && e.users == 0;
  on_host_ -= e.slot >= 0;
}

void PrefixCache::list(int32_t id) {
  const Entry& e = entries_[id];
  if (!e.live) return;
  const Victim v = victim(id);
  if (evictable(e)) lru_.insert(v);
  if (tier_ && movable(e)) movable_.insert(v);
  if (host_evictable(e)) host_lru_.insert(v);
  idle_ += e.slot < 0 && e.users == 0;
  on_host_ += e.slot >= 0;
}

void PrefixCache::acquire(const std::vector<int32_t>& ids) {
  for (int32_t id : ids) {
    check_entry(id);
    unlist(id);
    ++entries_[id].users;
    list(id);
  }
}

void PrefixCache::release(const std::vector<int32_t>& ids) {
  ++clock_;
  for (int32_t id : ids) {
    check_entry(id);
    Entry& e = entries_[id];
    KV_CHECK(e.users > 0, "prefix cache: entry " << id << " released more often than acquired");
    unlist(id);
    e.last_use = clock_;
    --e.users;
    list(id);
  }
}

int32_t PrefixCache::insert(int32_t parent, std::span<const int64_t> block_tokens, const std::vector<int32_t>& blocks,
                            BlockAllocator& alloc) {
  KV_CHECK(static_cast<int64_t>(block_tokens.size()) == block_size_,
           "prefix cache: a block of " << block_tokens.size() << " tokens (block size " << block_size_ << ")");
  KV_CHECK(static_cast<int64_t>(blocks.size()) == num_layers_,
           "prefix cache: " << blocks.size() << " pool blocks for " << num_layers_ << " layers");
  if (parent >= 0) check_entry(parent);
  const uint64_t k = key(parent >= 0 ? entries_[parent].key : 0, block_tokens);
  if (index_.count(k)) return -1;
  int32_t id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<int32_t>(entries_.size());
    entries_.emplace_back();
  }
  if (parent >= 0) {
    unlist(parent);
    ++entries_[parent].children;
    list(parent);
  }
  Entry& e = entries_[id];
  e.live = true;
  e.key = k;
  e.parent = parent;
  e.depth = parent >= 0 ? entries_[parent].depth + 1 : 0;
  e.tokens.assign(block_tokens.begin(), block_tokens.end());
  e.blocks = blocks;
  e.slot = -1;
  e.users = 0;
  e.children = 0;
  // The clock moves on releases only: the blocks a request inserts share its time and go tail first.
  e.last_use = clock_;
  for (int32_t b : blocks) alloc.incref(b);
  index_.emplace(k, id);
  list(id);
  return id;
}

void PrefixCache::evict(int32_t id, BlockAllocator& alloc) {
  unlist(id);
  Entry& e = entries_[id];
  if (e.slot >= 0) {
    tier_->free(e.slot);
  } else {
    for (int32_t b : e.blocks) alloc.decref(b);
  }
  index_.erase(e.key);
  const int32_t parent = e.parent;
  e = Entry{};
  free_ids_.push_back(id);
  if (parent >= 0) {
    unlist(parent);
    --entries_[parent].children;
    list(parent);
  }
}

bool PrefixCache::make_host_room(BlockAllocator& alloc) {
  while (tier_->free_slots() == 0 && !host_lru_.empty()) evict(std::get<2>(*host_lru_.begin()), alloc);
  return tier_->free_slots() > 0;
}

void PrefixCache::move_to_host(int32_t id, BlockAllocator& alloc) {
  unlist(id);
  Entry& e = entries_[id];
  e.slot = tier_->store(e.blocks);
  for (int32_t b : e.blocks) alloc.decref(b);
  e.blocks.clear();
  list(id);
}

const std::vector<int32_t>& PrefixCache::promote(int32_t id, BlockAllocator& alloc) {
  check_entry(id);
  Entry& e = entries_[id];
  if (e.slot < 0) return e.blocks;
  KV_CHECK(e.users > 0, "prefix cache: entry " << id << " promoted without a user");
  reclaim(num_layers_, alloc);
  std::vector<int32_t> blocks = alloc.allocate(num_layers_);  // throws "KV pool exhausted" when short
  tier_->load(e.slot, blocks);
  unlist(id);
  tier_->free(e.slot);
  e.slot = -1;
  e.blocks = std::move(blocks);
  list(id);
  return e.blocks;
}

bool PrefixCache::reclaim(int64_t need, BlockAllocator& alloc) {
  while (alloc.free_blocks() < need) {
    if (tier_ && !movable_.empty() && make_host_room(alloc)) {
      move_to_host(std::get<2>(*movable_.begin()), alloc);
      continue;
    }
    if (lru_.empty()) break;
    evict(std::get<2>(*lru_.begin()), alloc);
  }
  return alloc.free_blocks() >= need;
}

void PrefixCache::clear(BlockAllocator& alloc) {
  // Dropping a leaf can make its parent one: go on until neither order has any.
  while (!lru_.empty() || !host_lru_.empty())
    evict(std::get<2>(lru_.empty() ? *host_lru_.begin() : *lru_.begin()), alloc);
}

void PrefixCache::count_refs(std::vector<int32_t>& refs) const {
  for (const Entry& e : entries_)
    if (e.live)
      for (int32_t b : e.blocks) ++refs[static_cast<size_t>(b)];
}

void PrefixCache::idle_blocks(std::vector<int32_t>& out) const {
  for (const Entry& e : entries_)
    if (movable(e)) out.insert(out.end(), e.blocks.begin(), e.blocks.end());
}

void PrefixCache::check_invariants(int64_t other_tier_slots) const {
  int64_t live = 0, idle = 0, host = 0, leaves = 0, movable_count = 0, host_leaves = 0;
  std::vector<int64_t> children(entries_.size(), 0);
  std::vector<char> slot_seen(tier_ ? static_cast<size_t>(tier_->num_slots()) : 0, 0);
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (!e.live) continue;
    ++live;
    idle += e.slot < 0 && e.users == 0;
    auto it = index_.find(e.key);
    KV_CHECK(it != index_.end() && it->second == static_cast<int32_t>(i), "prefix cache: entry " << i << " not indexed");
    if (e.slot >= 0) {
      ++host;
      KV_CHECK(tier_ && e.slot < tier_->num_slots() && e.blocks.empty(), "prefix cache: entry " << i << " tier slot");
      KV_CHECK(!slot_seen[static_cast<size_t>(e.slot)], "prefix cache: tier slot " << e.slot << " held twice");
      slot_seen[static_cast<size_t>(e.slot)] = 1;
    } else {
      KV_CHECK(static_cast<int64_t>(e.blocks.size()) == num_layers_, "prefix cache: entry " << i << " block count");
    }
    if (e.parent >= 0) {
      KV_CHECK(entries_[e.parent].live, "prefix cache: entry " << i << " outlived its parent " << e.parent);
      KV_CHECK(entries_[e.parent].users >= e.users, "prefix cache: entry " << i << " has more users than its parent");
      ++children[static_cast<size_t>(e.parent)];
    }
    const Victim v = victim(static_cast<int32_t>(i));
    KV_CHECK((lru_.count(v) != 0) == evictable(e), "prefix cache: entry " << i << " eviction order out of date");
    KV_CHECK((movable_.count(v) != 0) == (tier_ && movable(e)), "prefix cache: entry " << i << " tier order out of date");
    KV_CHECK((host_lru_.count(v) != 0) == host_evictable(e), "prefix cache: entry " << i << " host order out of date");
    leaves += evictable(e);
    movable_count += tier_ && movable(e);
    host_leaves += host_evictable(e);
  }
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i].live) KV_CHECK(children[i] == entries_[i].children, "prefix cache: entry " << i << " child count");
  KV_CHECK(live == num_entries(), "prefix cache: " << live << " live entries, " << num_entries() << " indexed");
  KV_CHECK(idle == idle_, "prefix cache: " << idle << " pool entries without users, counted " << idle_);
  KV_CHECK(host == on_host_, "prefix cache: " << host << " entries on the host, counted " << on_host_);
  KV_CHECK(!tier_ || tier_->used_slots() == host + other_tier_slots,
           "prefix cache: tier holds " << (tier_ ? tier_->used_slots() : 0) << " slots for " << host << " entries and "
                                       << other_tier_slots << " other slots");
  KV_CHECK(leaves == static_cast<int64_t>(lru_.size()) && movable_count == static_cast<int64_t>(movable_.size()) &&
               host_leaves == static_cast<int64_t>(host_lru_.size()),
           "prefix cache: stale eviction order");
}

}  // namespace kvserve
