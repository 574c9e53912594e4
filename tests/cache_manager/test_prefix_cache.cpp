// PrefixCache on its own: chain matching, token comparison on a key hit, users, the eviction order
// (least recently used, a prompt's tail before its head) and the pool references it holds.
#include <gtest/gtest.h>

#include <vector>

#include "cache_manager/prefix_cache.h"
#include "common/check.h"

namespace kvserve {
namespace {

constexpr int64_t kBs = 4, kLayers = 2;

// Tokens of `blocks` blocks: block b of prompt `salt` holds salt*1000 + b*kBs + j.
std::vector<int64_t> prompt(int64_t blocks, int64_t salt, int64_t tail = 0) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < blocks * kBs + tail; ++i) t.push_back(salt * 1000 + i);
  return t;
}

// Caches every full block of `tokens` after `hit` entries, as a finished request would; returns the chain.
std::vector<int32_t> cache_prompt(PrefixCache& pc, BlockAllocator& alloc, const std::vector<int64_t>& tokens) {
  std::vector<int32_t> chain = pc.match(tokens, 1 << 20);
  int32_t parent = chain.empty() ? -1 : chain.back();
  for (int64_t b = static_cast<int64_t>(chain.size()); b < static_cast<int64_t>(tokens.size()) / kBs; ++b) {
    std::vector<int32_t> blocks = alloc.allocate(kLayers);
    const int32_t id = pc.insert(parent, std::span<const int64_t>(tokens).subspan(b * kBs, kBs), blocks, alloc);
    for (int32_t blk : blocks) alloc.decref(blk);  // the request is done: only the cache holds them
    if (id < 0) break;
    chain.push_back(id);
    parent = id;
  }
  return chain;
}

TEST(PrefixCache, MatchesTheLongestCachedChainOfWholeBlocks) {
  BlockAllocator alloc(64);
  PrefixCache pc(kLayers, kBs, 7);
  const auto a = prompt(3, 1, 2);
  EXPECT_TRUE(pc.match(a, 10).empty());
  const auto chain = cache_prompt(pc, alloc, a);
  ASSERT_EQ(chain.size(), 3u);  // the partial last block is not cached
  EXPECT_EQ(pc.cached_blocks(), 3 * kLayers);
  EXPECT_EQ(alloc.used_blocks(), 3 * kLayers);
  EXPECT_EQ(pc.reclaimable_blocks(), 3 * kLayers);
  EXPECT_EQ(pc.match(a, 10), chain);
  EXPECT_EQ(pc.match(a, 2).size(), 2u);
  // Same first block, different second: one block matches.
  auto b = a;
  b[static_cast<size_t>(kBs + 1)] += 1;
  EXPECT_EQ(pc.match(b, 10).size(), 1u);
  // A block that matches a cached block at another place in the prompt does not.
  const std::vector<int64_t> shifted(a.begin() + kBs, a.end());
  EXPECT_TRUE(pc.match(shifted, 10).empty());
  pc.check_invariants();
  alloc.check_invariants();
}

TEST(PrefixCache, AKeyCollisionIsAMissNotAnAlias) {
  BlockAllocator alloc(64);
  // Every block of every prompt gets the same key: only the token comparison tells them apart.
  PrefixCache pc(kLayers, kBs, 0, [](uint64_t, std::span<const int64_t>) { return uint64_t{42}; });
  const auto a = prompt(1, 1), b = prompt(1, 2);
  ASSERT_EQ(cache_prompt(pc, alloc, a).size(), 1u);
  EXPECT_TRUE(pc.match(b, 10).empty());
  // Nor can b be cached over a's entry: the key is taken.
  std::vector<int32_t> blocks = alloc.allocate(kLayers);
  EXPECT_EQ(pc.insert(-1, b, blocks, alloc), -1);
  for (int32_t blk : blocks) alloc.decref(blk);
  EXPECT_EQ(pc.match(a, 10).size(), 1u);
  pc.check_invariants();
}

TEST(PrefixCache, EvictsLeastRecentlyUsedTailFirstAndNeverWhatIsInUse) {
  BlockAllocator alloc(12);  // room for 6 entries of 2 layers
  PrefixCache pc(kLayers, kBs, 7);
  const auto a = prompt(3, 1), b = prompt(3, 2);
  const auto ca = cache_prompt(pc, alloc, a);
  const auto cb = cache_prompt(pc, alloc, b);
  EXPECT_EQ(alloc.free_blocks(), 0);
  // a is used again (acquired and released): b is now the least recently used.
  pc.acquire(ca);
  pc.release(ca);
  ASSERT_TRUE(pc.reclaim(2, alloc));
  EXPECT_EQ(pc.match(b, 10).size(), 2u);  // b's tail went first
  EXPECT_EQ(pc.match(a, 10).size(), 3u);
  // Entries in use are never evicted, even when that leaves the request short.
  pc.acquire(ca);
  EXPECT_FALSE(pc.reclaim(12, alloc));
  EXPECT_EQ(pc.match(a, 10).size(), 3u);
  EXPECT_TRUE(pc.match(b, 10).empty());
  EXPECT_EQ(pc.reclaimable_blocks(), 0);
  pc.check_invariants();
  pc.release(ca);
  EXPECT_EQ(pc.reclaimable_blocks(), 3 * kLayers);
  pc.clear(alloc);
  EXPECT_EQ(pc.num_entries(), 0);
  EXPECT_EQ(alloc.free_blocks(), 12);
  pc.check_invariants();
  alloc.check_invariants();
}

TEST(PrefixCache, UsersAreCountedAndChecked) {
  BlockAllocator alloc(16);
  PrefixCache pc(kLayers, kBs, 7);
  const auto chain = cache_prompt(pc, alloc, prompt(2, 3));
  pc.acquire(chain);
  pc.acquire({chain[0]});
  EXPECT_EQ(pc.reclaimable_blocks(), 0);
  pc.release(chain);
  EXPECT_EQ(pc.reclaimable_blocks(), kLayers);  // the second block has no user left
  pc.release({chain[0]});
  EXPECT_THROW(pc.release({chain[0]}), KvError);
  EXPECT_THROW(pc.acquire({99}), KvError);
  pc.check_invariants();
}

}  // namespace
}  // namespace kvserve
