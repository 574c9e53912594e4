// CompressedContextCache on its own (whole-context entries, users, least-recently-used reclaim and
// the references it holds) and through PagedKvCache (snapshot and adopt share whole blocks and copy a
// partly filled last block, so that appending after an entry never writes the entry's blocks).
#include <gtest/gtest.h>

#include <vector>

#include "cache_manager/compressed_context_cache.h"
#include "cache_manager/host_kv_tier.h"
#include "cache_manager/paged_kv_cache.h"
#include "common/check.h"

namespace kvserve {
namespace {

using Table = CompressedContextCache::Table;

std::vector<Table> tables(BlockAllocator& alloc, std::vector<int64_t> lengths, int64_t bs = 4) {
  std::vector<Table> out;
  for (int64_t n : lengths) out.push_back({alloc.allocate(blocks_for_tokens(n, bs)), n});
  return out;
}

TEST(CompressedContextCache, FindsWholeContextsOnly) {
  BlockAllocator alloc(32);
  CompressedContextCache cc(2);
  const std::vector<int64_t> ctx = {1, 2, 3, 4, 5};
  const int32_t e = cc.insert(77, ctx, tables(alloc, {5, 3}), 4);
  ASSERT_GE(e, 0);
  EXPECT_EQ(cc.find(77, ctx), e);
  EXPECT_EQ(cc.find(77, std::vector<int64_t>{1, 2, 3, 4}), -1);     // a key hit with other tokens is a miss
  EXPECT_EQ(cc.find(78, ctx), -1);
  EXPECT_EQ(cc.insert(77, ctx, {{}, {}}, 4), -1);  // the key is taken
  EXPECT_EQ(cc.cached_blocks(), 3);
  EXPECT_EQ(cc.full_blocks(), 4);
  EXPECT_EQ(cc.tables(e)[0].length, 5);
  EXPECT_THROW(cc.insert(79, ctx, tables(alloc, {1}), 1), KvError);  // one table per (layer, lane)
  cc.check_invariants();
}

TEST(CompressedContextCache, UsersPinEntriesAndIdleOnesGoLeastRecentlyUsedFirst) {
  BlockAllocator alloc(6);
  CompressedContextCache cc(1);
  const int32_t a = cc.insert(1, {1}, tables(alloc, {8}), 2);  // 2 blocks each
  const int32_t b = cc.insert(2, {2}, tables(alloc, {8}), 2);
  const int32_t c = cc.insert(3, {3}, tables(alloc, {8}), 2);
  EXPECT_TRUE(a != b && b != c && a != c);
  EXPECT_EQ(alloc.free_blocks(), 0);
  EXPECT_EQ(cc.reclaimable_blocks(), 6);
  cc.acquire(a);
  cc.release(a);  // a is now the most recently used
  cc.acquire(b);  // b is pinned
  EXPECT_EQ(cc.reclaimable_blocks(), 4);
  EXPECT_TRUE(cc.reclaim(2, alloc));
  EXPECT_EQ(cc.find(3, std::vector<int64_t>{3}), -1);  // c went first
  EXPECT_EQ(cc.find(1, std::vector<int64_t>{1}), a);
  EXPECT_FALSE(cc.reclaim(6, alloc));  // b is in use: only a could go
  EXPECT_EQ(cc.num_entries(), 1);
  EXPECT_EQ(cc.users(b), 1);
  EXPECT_THROW(cc.release(a), KvError);  // evicted
  cc.release(b);
  EXPECT_THROW(cc.release(b), KvError);
  cc.clear(alloc);
  EXPECT_EQ(alloc.free_blocks(), 6);
  EXPECT_EQ(cc.num_entries(), 0);
  cc.check_invariants();
  alloc.check_invariants();
}

KvPoolOptions pool_options(bool head_blocks) {
  KvPoolOptions o;
  o.num_kv_heads = 2;
  o.head_dim = 8;
  o.block_size = 4;
  o.num_blocks = 64;
  o.head_blocks = head_blocks;
  return o;
}

void fill(PagedKvCache& cache, int64_t seq, int64_t layer, std::vector<int64_t> head_lengths, float base) {
  const int64_t n = *std::max_element(head_lengths.begin(), head_lengths.end());
  auto k = torch::arange(2 * n * 8, torch::kFloat32).reshape({2, n, 8}) + base;
  auto pos = torch::arange(n, torch::kInt64).unsqueeze(0).expand({2, n}).contiguous() * 3;
  cache.write(seq, layer, k, -k, pos, cache.head_blocks() ? head_lengths : std::vector<int64_t>{});
}

void snapshot_then_adopt(bool head_blocks) {
  PagedKvCache cache(2, pool_options(head_blocks));
  cache.enable_context_cache();
  cache.add_sequence(1);
  fill(cache, 1, 0, head_blocks ? std::vector<int64_t>{6, 9} : std::vector<int64_t>{6, 6}, 0.f);
  fill(cache, 1, 1, {8, 8}, 100.f);  // whole blocks only
  const int64_t before = cache.allocator().free_blocks();
  auto snap = cache.snapshot(1);
  // One copy per partly filled table (layer 0's lanes), nothing for whole blocks.
  EXPECT_EQ(before - cache.allocator().free_blocks(), head_blocks ? 2 : 1);
  CompressedContextCache& cc = *cache.context_cache();
  const int32_t e = cc.insert(5, {1, 2, 3}, snap, 8);
  ASSERT_GE(e, 0);
  cc.acquire(e);
  cache.check_invariants();

  cache.add_sequence(2);
  cache.adopt(2, cc.tables(e));
  cache.check_invariants();
  for (int64_t l = 0; l < 2; ++l) {
    EXPECT_EQ(cache.head_lengths(2, l), cache.head_lengths(1, l));
    EXPECT_TRUE(torch::equal(cache.positions(2, l), cache.positions(1, l)));
    auto [k1, v1, n1] = cache.gather_padded(1, l);
    auto [k2, v2, n2] = cache.gather_padded(2, l);
    EXPECT_EQ(n1, n2);
    EXPECT_TRUE(torch::equal(k1, k2));
    EXPECT_TRUE(torch::equal(v1, v2));
  }
  // Appending to both sequences leaves the entry's blocks as they were.
  std::vector<torch::Tensor> entry_k;
  for (const Table& t : cc.tables(e))
    for (int32_t b : t.blocks) entry_k.push_back(cache.pool().keys().select(0, b).clone());
  for (int64_t seq : {1, 2}) {
    for (int64_t l = 0; l < 2; ++l) {
      auto k = torch::full({2, 3, 8}, 7.f + static_cast<float>(seq));
      auto pos = torch::full({2, 3}, 50, torch::kInt64);
      cache.extend(seq, l, k, k, pos);
    }
  }
  size_t i = 0;
  for (const Table& t : cc.tables(e))
    for (int32_t b : t.blocks) EXPECT_TRUE(torch::equal(cache.pool().keys().select(0, b), entry_k[i++]));
  cache.check_invariants();
  cache.release(1);
  cache.release(2);
  cc.release(e);
  EXPECT_EQ(cache.used_blocks(), 0);  // the idle entry counts as free
  EXPECT_TRUE(cache.reclaim(cache.total_blocks()));
  EXPECT_EQ(cache.allocator().free_blocks(), cache.total_blocks());
  cache.check_invariants();
}

TEST(PagedKvCacheContexts, SnapshotAndAdoptLayerwise) { snapshot_then_adopt(false); }
TEST(PagedKvCacheContexts, SnapshotAndAdoptHeadwise) { snapshot_then_adopt(true); }

// What a sequence that adopts entry e sees, layer by layer: K, V, per-head lengths and positions.
struct Seen {
  std::vector<torch::Tensor> k, v, pos;
  std::vector<std::vector<int64_t>> lengths;
};

Seen adopt_and_read(PagedKvCache& cache, int32_t e, int64_t seq) {
  CompressedContextCache& cc = *cache.context_cache();
  cc.acquire(e);
  if (cc.on_host(e)) cache.context_to_pool(e);
  cache.add_sequence(seq);
  cache.adopt(seq, cc.tables(e));
  Seen out;
  for (int64_t l = 0; l < 2; ++l) {
    auto [k, v, n] = cache.gather_padded(seq, l);
    out.k.push_back(k), out.v.push_back(v), out.lengths.push_back(n);
    out.pos.push_back(cache.positions(seq, l));
  }
  cache.release(seq);
  cc.release(e);
  cache.check_invariants();
  return out;
}

void expect_same(const Seen& a, const Seen& b) {
  for (size_t l = 0; l < a.k.size(); ++l) {
    EXPECT_EQ(a.lengths[l], b.lengths[l]) << l;
    EXPECT_TRUE(torch::equal(a.k[l], b.k[l])) << l;
    EXPECT_TRUE(torch::equal(a.v[l], b.v[l])) << l;
    EXPECT_TRUE(torch::equal(a.pos[l], b.pos[l])) << l;
  }
}

// An entry made from a sequence whose layer 0 keeps `head_lengths` and layer 1 `whole` slots.
int32_t make_entry(PagedKvCache& cache, int64_t seq, uint64_t key, std::vector<int64_t> head_lengths, int64_t whole,
                   float base) {
  cache.add_sequence(seq);
  fill(cache, seq, 0, head_lengths, base);
  fill(cache, seq, 1, {whole, whole}, base + 100.f);
  const int32_t e = cache.context_cache()->insert(key, {static_cast<int64_t>(key)}, cache.snapshot(seq), 8);
  cache.release(seq);
  return e;
}

// cache.prefix_cache_bytes: an idle compressed context that the pool needs back moves to the host
// tier with its kept positions and comes back for the next request as it was; the tier drops its
// least recently used contexts when a newer one needs the room, and an entry it cannot hold is dropped.
void contexts_through_the_host_tier(bool head_blocks) {
  PagedKvCache cache(2, pool_options(head_blocks));
  const int64_t slot = HostKvTier::slot_bytes(cache.pool(), 2 * cache.lanes());
  // A slot holds 2 blocks (4 head-wise): entry a takes 3 slots, b 2, c 3; the tier holds 5.
  cache.enable_prefix_cache(9, nullptr, 5 * slot);
  cache.enable_context_cache();
  CompressedContextCache& cc = *cache.context_cache();
  const std::vector<int64_t> ragged = head_blocks ? std::vector<int64_t>{6, 9} : std::vector<int64_t>{9, 9};
  const int32_t a = make_entry(cache, 1, 11, ragged, 8, 0.f);
  const int32_t b = make_entry(cache, 2, 12, {5, 5}, 4, 1000.f);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  const Seen want_a = adopt_and_read(cache, a, 10), want_b = adopt_and_read(cache, b, 11);
  // b was used last: a goes to the tier first, then b.
  const int64_t pool_blocks = cc.cached_blocks();
  ASSERT_TRUE(cache.reclaim(cache.total_blocks() - pool_blocks + 1));
  EXPECT_TRUE(cc.on_host(a));
  EXPECT_FALSE(cc.on_host(b));
  ASSERT_TRUE(cache.reclaim(cache.total_blocks()));
  EXPECT_TRUE(cc.on_host(b));
  EXPECT_EQ(cc.cached_blocks(), 0);
  EXPECT_EQ(cc.host_entries(), 2);
  EXPECT_EQ(cache.allocator().free_blocks(), cache.total_blocks());
  cache.check_invariants();
  // Overwrite the pool: the entries' data lives in the tier alone now.
  cache.pool().storage().fill_(-7.f);
  expect_same(adopt_and_read(cache, a, 12), want_a);
  EXPECT_FALSE(cc.on_host(a));
  EXPECT_EQ(cache.host_tier()->loads(), 3);  // a's slots
  expect_same(adopt_and_read(cache, b, 13), want_b);
  // A third entry that needs the room: the least recently used tier entry is dropped for it.
  ASSERT_TRUE(cache.reclaim(cache.total_blocks()));
  EXPECT_EQ(cc.host_entries(), 2);
  const int32_t c = make_entry(cache, 3, 13, {9, 9}, 8, 2000.f);
  const Seen want_c = adopt_and_read(cache, c, 14);
  ASSERT_TRUE(cache.reclaim(cache.total_blocks()));
  EXPECT_TRUE(cc.on_host(c));
  EXPECT_EQ(cc.find(11, std::vector<int64_t>{11}), -1) << "a was used least recently";
  EXPECT_EQ(cc.find(12, std::vector<int64_t>{12}), b);
  expect_same(adopt_and_read(cache, c, 15), want_c);
  expect_same(adopt_and_read(cache, b, 16), want_b);
  ASSERT_TRUE(cache.reclaim(cache.total_blocks()));
  EXPECT_EQ(cache.allocator().free_blocks(), cache.total_blocks());
  EXPECT_EQ(cc.host_entries(), 2);
  cache.check_invariants();
}

TEST(PagedKvCacheContexts, HostTierLayerwise) { contexts_through_the_host_tier(false); }
TEST(PagedKvCacheContexts, HostTierHeadwise) { contexts_through_the_host_tier(true); }

// Without room in the tier (or without a tier) a reclaimed context is dropped.
TEST(PagedKvCacheContexts, AContextTheTierCannotHoldIsDropped) {
  PagedKvCache cache(2, pool_options(false));
  cache.enable_prefix_cache(9, nullptr, HostKvTier::slot_bytes(cache.pool(), 2));  // one slot of 2 blocks
  cache.enable_context_cache();
  CompressedContextCache& cc = *cache.context_cache();
  const int32_t a = make_entry(cache, 1, 11, {9, 9}, 8, 0.f);  // 5 blocks: 3 slots
  ASSERT_GE(a, 0);
  ASSERT_TRUE(cache.reclaim(cache.total_blocks()));
  EXPECT_EQ(cc.num_entries(), 0);
  EXPECT_EQ(cache.host_tier()->used_slots(), 0);
  cache.check_invariants();
}

}  // namespace
}  // namespace kvserve
