#include "cache_manager/prefix_cache.h"

#include <algorithm>
#include <utility>

#include "common/check.h"

namespace kvserve {
namespace {

// splitmix64's finaliser: every input bit reaches every output bit.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

PrefixCache::PrefixCache(int64_t num_layers, int64_t block_size, uint64_t salt, KeyFn key_fn)
    : num_layers_(num_layers), block_size_(block_size), salt_(salt), key_fn_(std::move(key_fn)) {
  KV_CHECK(num_layers > 0 && block_size > 0, "prefix cache needs layers and a block size");
}

uint64_t PrefixCache::key(uint64_t parent_key, std::span<const int64_t> block_tokens) const {
  if (key_fn_) {
    const uint64_t h = key_fn_(parent_key, block_tokens);
    return h == 0 ? 1 : h;
  }
  uint64_t h = mix(salt_ ^ mix(parent_key));
  for (int64_t t : block_tokens) h = mix(h ^ static_cast<uint64_t>(t));
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
  return entries_[entry].blocks;
}

void PrefixCache::acquire(const std::vector<int32_t>& ids) {
  for (int32_t id : ids) {
    check_entry(id);
    Entry& e = entries_[id];
    if (evictable(e)) lru_.erase(victim(id));
    if (e.users++ == 0) --idle_;
  }
}

void PrefixCache::release(const std::vector<int32_t>& ids) {
  ++clock_;
  for (int32_t id : ids) {
    check_entry(id);
    Entry& e = entries_[id];
    KV_CHECK(e.users > 0, "prefix cache: entry " << id << " released more often than acquired");
    e.last_use = clock_;
    if (--e.users == 0) ++idle_;
    if (evictable(e)) lru_.insert(victim(id));
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
  Entry& e = entries_[id];
  e.live = true;
  e.key = k;
  e.parent = parent;
  e.depth = parent >= 0 ? entries_[parent].depth + 1 : 0;
  e.tokens.assign(block_tokens.begin(), block_tokens.end());
  e.blocks = blocks;
  e.users = 0;
  e.children = 0;
  e.last_use = ++clock_;
  for (int32_t b : blocks) alloc.incref(b);
  index_.emplace(k, id);
  ++idle_;
  if (parent >= 0) {
    Entry& p = entries_[parent];
    if (evictable(p)) lru_.erase(victim(parent));
    ++p.children;
  }
  lru_.insert(victim(id));
  return id;
}

void PrefixCache::evict(int32_t id, BlockAllocator& alloc) {
  Entry& e = entries_[id];
  lru_.erase(victim(id));
  for (int32_t b : e.blocks) alloc.decref(b);
  index_.erase(e.key);
  --idle_;
  if (e.parent >= 0) {
    Entry& p = entries_[e.parent];
    --p.children;
    if (evictable(p)) lru_.insert(victim(e.parent));
  }
  e = Entry{};
  free_ids_.push_back(id);
}

bool PrefixCache::reclaim(int64_t need, BlockAllocator& alloc) {
  while (alloc.free_blocks() < need && !lru_.empty()) evict(std::get<2>(*lru_.begin()), alloc);
  return alloc.free_blocks() >= need;
}

void PrefixCache::count_refs(std::vector<int32_t>& refs) const {
  for (const Entry& e : entries_)
    if (e.live)
      for (int32_t b : e.blocks) ++refs[static_cast<size_t>(b)];
}

void PrefixCache::check_invariants() const {
  int64_t live = 0, idle = 0, leaves = 0;
  std::vector<int64_t> children(entries_.size(), 0);
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (!e.live) continue;
    ++live;
    idle += e.users == 0;
    auto it = index_.find(e.key);
    KV_CHECK(it != index_.end() && it->second == static_cast<int32_t>(i), "prefix cache: entry " << i << " not indexed");
    KV_CHECK(static_cast<int64_t>(e.blocks.size()) == num_layers_, "prefix cache: entry " << i << " block count");
    if (e.parent >= 0) {
      KV_CHECK(entries_[e.parent].live, "prefix cache: entry " << i << " outlived its parent " << e.parent);
      KV_CHECK(entries_[e.parent].users >= e.users, "prefix cache: entry " << i << " has more users than its parent");
      ++children[static_cast<size_t>(e.parent)];
    }
    const bool in_lru = lru_.count(victim(static_cast<int32_t>(i))) != 0;
    KV_CHECK(in_lru == evictable(e), "prefix cache: entry " << i << " eviction order out of date");
    leaves += in_lru;
  }
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i].live) KV_CHECK(children[i] == entries_[i].children, "prefix cache: entry " << i << " child count");
  KV_CHECK(live == num_entries(), "prefix cache: " << live << " live entries, " << num_entries() << " indexed");
  KV_CHECK(idle == idle_, "prefix cache: " << idle << " entries without users, counted " << idle_);
  KV_CHECK(leaves == static_cast<int64_t>(lru_.size()), "prefix cache: stale eviction order");
}

}  // namespace kvserve
