// The prefix cache's host-RAM tier: HostKvTier copies whole entries out of the pool and back
// bit for bit; PrefixCache moves idle entries there instead of dropping them, brings a hit back
// with its data, drops the tier's own least recently used leaves when it is full, and keeps its
// invariants under a random mix of requests.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "cache_manager/host_kv_tier.h"
#include "cache_manager/kv_block_pool.h"
#include "cache_manager/prefix_cache.h"
#include "common/check.h"

namespace kvserve {
namespace {

constexpr int64_t kBs = 4, kLayers = 3, kKv = 2, kD = 8;

KvBlockPool make_pool(int64_t blocks) {
  KvPoolOptions o;
  o.num_kv_heads = kKv;
  o.head_dim = kD;
  o.block_size = kBs;
  o.num_blocks = blocks;
  return KvBlockPool(o);
}

int64_t entry_bytes(const KvBlockPool& pool) { return HostKvTier::slot_bytes(pool, kLayers); }

// Tokens of `blocks` blocks: block b of prompt `salt` holds salt*1000 + b*kBs + j.
std::vector<int64_t> prompt(int64_t blocks, int64_t salt) {
  std::vector<int64_t> t;
  for (int64_t i = 0; i < blocks * kBs; ++i) t.push_back(salt * 1000 + i);
  return t;
}

// What a cached block of layer l holds when its tokens start with `first_token` (each entry's data
// is a function of its content, so a block that comes back can be checked).
float fill_value(int64_t first_token, int64_t layer) { return static_cast<float>(first_token * 10 + layer); }

// Takes the cached chain of `tokens` for a request as PagedKvMemory does: acquire, bring entries
// on the host back while the pool has room, give up the rest. Returns the entries in use.
std::vector<int32_t> use_cached(PrefixCache& pc, BlockAllocator& alloc, const std::vector<int64_t>& tokens) {
  std::vector<int32_t> hit = pc.match(tokens, 1 << 20);
  pc.acquire(hit);
  size_t ok = 0;
  for (; ok < hit.size(); ++ok) {
    if (!pc.on_host(hit[ok])) continue;
    if (!pc.reclaim(kLayers, alloc)) break;
    pc.promote(hit[ok], alloc);
  }
  pc.release(std::vector<int32_t>(hit.begin() + static_cast<std::ptrdiff_t>(ok), hit.end()));
  hit.resize(ok);
  return hit;
}

// A request over `tokens` that then caches its blocks after the cached chain (pool blocks written,
// handed to the cache, used until the request ends); returns the whole chain.
std::vector<int32_t> cache_prompt(PrefixCache& pc, BlockAllocator& alloc, const KvBlockPool& pool,
                                  const std::vector<int64_t>& tokens) {
  std::vector<int32_t> chain = use_cached(pc, alloc, tokens);
  int32_t parent = chain.empty() ? -1 : chain.back();
  for (int64_t b = static_cast<int64_t>(chain.size()); b < static_cast<int64_t>(tokens.size()) / kBs; ++b) {
    if (!pc.reclaim(kLayers, alloc)) break;
    std::vector<int32_t> blocks = alloc.allocate(kLayers);
    for (int64_t l = 0; l < kLayers; ++l) pool.storage()[blocks[l]].fill_(fill_value(tokens[b * kBs], l));
    const int32_t id = pc.insert(parent, std::span<const int64_t>(tokens).subspan(b * kBs, kBs), blocks, alloc);
    for (int32_t blk : blocks) alloc.decref(blk);
    if (id < 0) break;
    pc.acquire({id});
    chain.push_back(id);
    parent = id;
  }
  pc.release(chain);
  return chain;
}

// Every block of a chain in the pool holds what its tokens wrote.
void expect_data(const PrefixCache& pc, const KvBlockPool& pool, const std::vector<int64_t>& tokens,
                 const std::vector<int32_t>& chain) {
  for (size_t b = 0; b < chain.size(); ++b) {
    ASSERT_FALSE(pc.on_host(chain[b]));
    for (int64_t l = 0; l < kLayers; ++l) {
      const torch::Tensor blk = pool.storage()[pc.blocks(chain[b])[l]];
      const float want = fill_value(tokens[b * kBs], l);
      EXPECT_TRUE(torch::equal(blk, torch::full_like(blk, want))) << "entry " << b << " layer " << l;
    }
  }
}

TEST(HostKvTier, CopiesAnEntryOutAndBackBitForBit) {
  KvBlockPool pool = make_pool(16);
  pool.storage().copy_(torch::randn(pool.storage().sizes()));
  const torch::Tensor before = pool.storage().clone();
  HostKvTier tier(pool, kLayers, 2 * entry_bytes(pool) + 1);
  EXPECT_EQ(tier.num_slots(), 2);
  const std::vector<int32_t> src = {5, 1, 9}, dst = {2, 3, 14};
  const int32_t slot = tier.store(src);
  pool.storage().zero_();
  tier.load(slot, dst);
  for (int64_t l = 0; l < kLayers; ++l) EXPECT_TRUE(torch::equal(pool.storage()[dst[l]], before[src[l]])) << l;
  EXPECT_EQ(tier.stores(), 1);
  EXPECT_EQ(tier.loads(), 1);
  tier.store(src);
  EXPECT_THROW(tier.store(src), KvError) << "full";
  EXPECT_THROW(tier.store({1, 2}), KvError) << "one block per layer";
  tier.free(slot);
  EXPECT_THROW(tier.load(slot, dst), KvError) << "a free slot";
  tier.check_invariants();
}

TEST(HostKvTier, TooSmallToHoldOneEntryIsAnErrorNamingTheSetting) {
  KvBlockPool pool = make_pool(4);
  try {
    HostKvTier tier(pool, kLayers, entry_bytes(pool) - 1);
    FAIL() << "no error";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("cache.prefix_cache_bytes"), std::string::npos) << e.what();
  }
}

TEST(HostTierPrefixCache, AReclaimedEntryMovesToTheHostAndAHitBringsItBack) {
  KvBlockPool pool = make_pool(6 * kLayers);  // six entries
  BlockAllocator alloc(pool.num_blocks());
  HostKvTier tier(pool, kLayers, 4 * entry_bytes(pool));
  PrefixCache pc(kLayers, kBs, 7);
  pc.attach_tier(&tier);
  const auto a = prompt(3, 1), b = prompt(3, 2);
  const auto ca = cache_prompt(pc, alloc, pool, a);
  const auto cb = cache_prompt(pc, alloc, pool, b);
  ASSERT_EQ(ca.size(), 3u);
  ASSERT_EQ(cb.size(), 3u);
  pc.acquire(ca);  // a is used again: b is the least recently used
  pc.release(ca);
  ASSERT_TRUE(pc.reclaim(2 * kLayers, alloc));
  EXPECT_EQ(pc.host_entries(), 2);
  EXPECT_TRUE(pc.on_host(cb[2]) && pc.on_host(cb[1]) && !pc.on_host(cb[0])) << "the tail moves first";
  EXPECT_EQ(pc.cached_blocks(), 4 * kLayers);
  EXPECT_EQ(pc.match(b, 10), cb) << "entries on the host still match";
  EXPECT_THROW(pc.blocks(cb[2]), KvError) << "no pool blocks while on the host";
  pc.check_invariants();
  // Something else takes the freed blocks; then b is asked for again.
  std::vector<int32_t> other = alloc.allocate(2 * kLayers);
  for (int32_t blk : other) pool.storage()[blk].fill_(-1.0f);
  pc.acquire(cb);
  for (int32_t id : cb) pc.promote(id, alloc);  // a's entries move out to make room
  EXPECT_EQ(pc.host_entries(), 2);
  EXPECT_TRUE(pc.on_host(ca[2]) && pc.on_host(ca[1]));
  expect_data(pc, pool, b, cb);
  EXPECT_EQ(tier.loads(), 2);
  pc.check_invariants();
  pc.acquire(ca);  // b still in use: the pool is full of what is in use
  EXPECT_THROW(pc.promote(ca[1], alloc), KvError);
  EXPECT_TRUE(pc.on_host(ca[1])) << "a failed promotion leaves the entry on the host";
  pc.check_invariants();
  for (int32_t blk : other) alloc.decref(blk);
  for (int32_t id : ca) pc.promote(id, alloc);
  expect_data(pc, pool, a, ca);
  pc.release(ca);
  pc.release(cb);
  pc.check_invariants();
  alloc.check_invariants();
  tier.check_invariants();
}

TEST(HostTierPrefixCache, AFullTierDropsItsOldestLeavesAndThenThePoolDropsAsBefore) {
  KvBlockPool pool = make_pool(4 * kLayers);
  BlockAllocator alloc(pool.num_blocks());
  HostKvTier tier(pool, kLayers, 2 * entry_bytes(pool));
  PrefixCache pc(kLayers, kBs, 7);
  pc.attach_tier(&tier);
  const auto a = prompt(2, 1), b = prompt(2, 2), c = prompt(3, 3);
  const auto ca = cache_prompt(pc, alloc, pool, a);
  const auto cb = cache_prompt(pc, alloc, pool, b);
  // c needs three of the four entries' room: a (the oldest) goes to the tier, tail first, which
  // fills it; then b's tail must go too, so the tier drops its own oldest leaf (a's tail).
  const auto cc = cache_prompt(pc, alloc, pool, c);
  ASSERT_EQ(cc.size(), 3u);
  EXPECT_EQ(pc.match(a, 10), std::vector<int32_t>{ca[0]});
  EXPECT_TRUE(pc.on_host(ca[0]));
  EXPECT_EQ(pc.match(b, 10), cb);
  EXPECT_TRUE(!pc.on_host(cb[0]) && pc.on_host(cb[1]));
  EXPECT_EQ(tier.stores(), 3);
  pc.check_invariants();
  // With c in use, b's head goes to the tier (dropping a's head there), and then nothing is left.
  pc.acquire(cc);
  EXPECT_FALSE(pc.reclaim(kLayers + 1, alloc));
  EXPECT_TRUE(pc.match(a, 10).empty());
  EXPECT_TRUE(pc.on_host(cb[0]) && pc.on_host(cb[1]));
  EXPECT_EQ(alloc.free_blocks(), kLayers);
  pc.release(cc);
  pc.check_invariants();
  pc.clear(alloc);
  EXPECT_EQ(pc.num_entries(), 0);
  EXPECT_EQ(alloc.free_blocks(), alloc.total_blocks());
  EXPECT_EQ(tier.used_slots(), 0);
  pc.check_invariants();
}

// Random requests over shared prefixes: whatever moves between the pool and the tier, every
// chain that is brought back holds its own data and the bookkeeping stays consistent.
TEST(HostTierPrefixCache, RandomRequestsKeepDataAndInvariants) {
  std::mt19937 rng(1234);
  KvBlockPool pool = make_pool(10 * kLayers);
  BlockAllocator alloc(pool.num_blocks());
  HostKvTier tier(pool, kLayers, 7 * entry_bytes(pool));
  PrefixCache pc(kLayers, kBs, 7);
  pc.attach_tier(&tier);
  // Prompts share leading blocks: prompt p = the first (p % 3) + 1 blocks of family p / 3's stem,
  // then its own blocks.
  auto make = [](int64_t p) {
    std::vector<int64_t> t = prompt(1 + p % 3, p / 3 + 1);
    const auto own = prompt(1 + p % 2, 100 + p);
    t.insert(t.end(), own.begin(), own.end());
    return t;
  };
  int64_t promoted = 0, stored = 0;
  std::vector<std::pair<std::vector<int64_t>, std::vector<int32_t>>> in_use;
  for (int round = 0; round < 400; ++round) {
    const int64_t p = static_cast<int64_t>(rng() % 12);
    const auto tokens = make(p);
    if (rng() % 3 == 0 && !in_use.empty()) {  // a request ends
      pc.release(in_use.back().second);
      in_use.pop_back();
    } else if (rng() % 2 == 0) {  // a request hits what is cached and uses it
      const std::vector<int32_t> hit = use_cached(pc, alloc, tokens);
      expect_data(pc, pool, tokens, hit);
      in_use.emplace_back(tokens, hit);
      if (in_use.size() > 3) {
        pc.release(in_use.front().second);
        in_use.erase(in_use.begin());
      }
    } else {  // a request finishes and its prompt is cached
      cache_prompt(pc, alloc, pool, tokens);
    }
    stored = tier.stores();
    promoted = tier.loads();
    pc.check_invariants();
    tier.check_invariants();
    alloc.check_invariants();
    std::vector<int32_t> refs(static_cast<size_t>(alloc.total_blocks()), 0);
    pc.count_refs(refs);
    for (int64_t blk = 0; blk < alloc.total_blocks(); ++blk) ASSERT_EQ(refs[blk], alloc.refcount(static_cast<int32_t>(blk)));
  }
  EXPECT_GT(promoted, 20);
  EXPECT_GT(stored, 20);
  for (auto& [t, hit] : in_use) pc.release(hit);
  pc.clear(alloc);
  EXPECT_EQ(alloc.free_blocks(), alloc.total_blocks());
  EXPECT_EQ(tier.used_slots(), 0);
}

}  // namespace
}  // namespace kvserve
