// PagedKvCache: write / append / compact / release bookkeeping, positions, exhaustion behaviour.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "cache_manager/paged_kv_cache.h"
#include "common/check.h"

namespace kvserve {
namespace {

constexpr int64_t kKV = 2, kD = 8, kBS = 4;

KvPoolOptions opts(int64_t blocks, int64_t kv = kKV, int64_t d = kD, int64_t bs = kBS) {
  KvPoolOptions o;
  o.num_kv_heads = kv;
  o.head_dim = d;
  o.block_size = bs;
  o.num_blocks = blocks;
  return o;
}

torch::Tensor rand_kv(int64_t n, int64_t kv = kKV, int64_t d = kD) { return torch::randn({kv, n, d}); }

// Positions 10·h + j·3 + offset: distinct per head so mix-ups show.
torch::Tensor make_pos(int64_t n, int64_t offset = 0, int64_t kv = kKV) {
  return (torch::arange(n, torch::kLong) * 3 + offset).view({1, n}) + torch::arange(kv, torch::kLong).view({kv, 1}) * 10;
}

void expect_all_free(const PagedKvCache& c) {
  c.check_invariants();
  EXPECT_EQ(c.used_blocks(), 0);
  EXPECT_EQ(c.free_blocks(), c.total_blocks());
}

TEST(PagedKvCache, SizedInBytes) {
  KvPoolOptions o = opts(0);
  const int64_t bb = KvBlockPool::bytes_per_block(kKV, kBS, kD, torch::kFloat32);
  EXPECT_EQ(bb, 2 * kKV * kBS * kD * 4);
  o.kv_cache_bytes = bb * 10 + bb / 2;
  PagedKvCache c(3, o);
  EXPECT_EQ(c.total_blocks(), 10);
  EXPECT_EQ(c.block_bytes(), bb);
  EXPECT_EQ(c.pool().storage().sizes(), (std::vector<int64_t>{10, 2, kKV, kBS, kD}));
  o.kv_cache_bytes = bb - 1;
  EXPECT_THROW(PagedKvCache(3, o), KvError);
  o.kv_cache_bytes = 0;
  o.device_memory_fraction = 0.5;  // CPU pool: a fraction of device memory makes no sense
  EXPECT_THROW(PagedKvCache(3, o), KvError);
}

// A 16-bit KV cache dtype halves the block and doubles the blocks of the same memory.
TEST(PagedKvCache, SixteenBitPoolHoldsTwiceTheBlocks) {
  KvPoolOptions o = opts(0);
  o.kv_cache_bytes = int64_t{1} << 20;
  const int64_t fp32_blocks = PagedKvCache(3, o).total_blocks();
  for (torch::ScalarType t : {torch::kFloat16, torch::kBFloat16}) {
    o.dtype = t;
    PagedKvCache c(3, o);
    EXPECT_EQ(c.block_bytes(), KvBlockPool::bytes_per_block(kKV, kBS, kD, torch::kFloat32) / 2);
    EXPECT_EQ(c.total_blocks(), 2 * fp32_blocks);
    EXPECT_EQ(c.pool().storage().scalar_type(), t);
  }
}

// Prefill writes convert fp32 K/V to the pool's dtype with torch's rounding (to nearest even).
TEST(PagedKvCache, SixteenBitWriteRoundsAsTorch) {
  for (torch::ScalarType t : {torch::kFloat16, torch::kBFloat16}) {
    KvPoolOptions o = opts(16);
    o.dtype = t;
    PagedKvCache c(1, o);
    c.add_sequence(1);
    torch::manual_seed(3);
    auto k = torch::randn({kKV, 21, kD}), v = torch::randn({kKV, 21, kD}) * 1000;
    // Ties: 1 + 2^-11 is halfway between two fp16 values, 1 + 2^-8 between two bf16 values.
    k[0][0][0] = 1.0f + std::ldexp(1.0f, -11);
    k[0][0][1] = 1.0f + std::ldexp(1.0f, -8);
    c.write(1, 0, k, v, torch::zeros({kKV, 21}, torch::kLong));
    auto [gk, gv] = c.gather(1, 0);
    EXPECT_EQ(gk.scalar_type(), t);
    EXPECT_TRUE(torch::equal(gk, k.to(t)));
    EXPECT_TRUE(torch::equal(gv, v.to(t)));
    EXPECT_EQ(gk[0][0][t == torch::kFloat16 ? 0 : 1].item<float>(), 1.0f);  // the tie goes to even, not up
    EXPECT_FALSE(torch::equal(gk.to(torch::kFloat32), k));                   // it really was narrowed
  }
}

TEST(PagedKvCache, WriteGatherPerLayerLengths) {
  PagedKvCache c(3, opts(64));
  c.add_sequence(7);
  const std::vector<int64_t> lens = {9, 1, 16};
  std::vector<torch::Tensor> ks, vs;
  for (int64_t l = 0; l < 3; ++l) {
    ks.push_back(rand_kv(lens[l]));
    vs.push_back(rand_kv(lens[l]));
    c.write(7, l, ks[l], vs[l], make_pos(lens[l], l));
  }
  for (int64_t l = 0; l < 3; ++l) {
    EXPECT_EQ(c.length(7, l), lens[l]);
    auto [k, v] = c.gather(7, l);
    EXPECT_TRUE(torch::equal(k, ks[l]));
    EXPECT_TRUE(torch::equal(v, vs[l]));
    EXPECT_TRUE(torch::equal(c.positions(7, l), make_pos(lens[l], l)));
  }
  EXPECT_EQ(c.blocks_of(7), 3 + 1 + 4);
  EXPECT_EQ(c.bytes_of(7), 8 * c.block_bytes());
  EXPECT_EQ(c.blocks_needed({9, 1, 16}), 8);
  EXPECT_EQ(c.blocks_for_next_token(7), 1);  // only layer 2 is exactly full
  c.check_invariants();
  // Rewriting a layer reuses its blocks: no growth in usage.
  c.write(7, 0, rand_kv(5), rand_kv(5), make_pos(5));
  EXPECT_EQ(c.length(7, 0), 5);
  EXPECT_EQ(c.used_blocks(), 2 + 1 + 4);
  c.write(7, 1, rand_kv(0), rand_kv(0), make_pos(0));
  EXPECT_EQ(c.length(7, 1), 0);
  c.release(7);
  expect_all_free(c);
  EXPECT_FALSE(c.has_sequence(7));
  EXPECT_THROW(c.release(7), KvError);
}

TEST(PagedKvCache, AppendAcrossBlockBoundaries) {
  PagedKvCache c(2, opts(64));
  c.add_sequence(1);
  c.add_sequence(2);
  auto k1 = rand_kv(3), v1 = rand_kv(3), k2 = rand_kv(4), v2 = rand_kv(4);
  c.write(1, 0, k1, v1, make_pos(3));
  c.write(2, 0, k2, v2, make_pos(4));
  std::vector<torch::Tensor> ak, av;
  for (int t = 0; t < 6; ++t) {
    auto k = torch::randn({2, kKV, kD}), v = torch::randn({2, kKV, kD});
    c.append(0, {2, 1}, k, v, {100 + t, 50 + t});
    ak.push_back(k);
    av.push_back(v);
    c.check_invariants();
  }
  EXPECT_EQ(c.length(1, 0), 9);
  EXPECT_EQ(c.length(2, 0), 10);
  EXPECT_EQ(c.length(1, 1), 0);
  EXPECT_EQ(c.layer_blocks(1, 0).blocks.size(), 3u);
  EXPECT_EQ(c.layer_blocks(2, 0).blocks.size(), 3u);
  auto [k, v] = c.gather(1, 0);
  auto appended_k1 = torch::stack(ak).select(1, 1).transpose(0, 1);  // [KV, 6, D]
  EXPECT_TRUE(torch::equal(k, torch::cat({k1, appended_k1}, 1)));
  auto [kk, vv] = c.gather(2, 0);
  EXPECT_TRUE(torch::equal(vv, torch::cat({v2, torch::stack(av).select(1, 0).transpose(0, 1)}, 1)));
  auto p = c.positions(1, 0);
  EXPECT_EQ(p[0][3].item<int64_t>(), 50);
  EXPECT_EQ(p[1][8].item<int64_t>(), 55);
  EXPECT_EQ(p[1][2].item<int64_t>(), 16);
  EXPECT_THROW(c.append(0, {1, 1}, torch::randn({2, kKV, kD}), torch::randn({2, kKV, kD}), {1, 3}), KvError);
  EXPECT_THROW(c.append(0, {1}, torch::randn({1, kKV + 1, kD}), torch::randn({1, kKV + 1, kD}), {1}), KvError);
  EXPECT_THROW(c.append(0, {3}, torch::randn({1, kKV, kD}), torch::randn({1, kKV, kD}), {1}), KvError);
  c.release(1);
  c.release(2);
  expect_all_free(c);
}

TEST(PagedKvCache, CompactKeepsChosenSlotsPerHead) {
  PagedKvCache c(1, opts(64));
  c.add_sequence(3);
  const int64_t n = 14;
  auto k = rand_kv(n), v = rand_kv(n), pos = make_pos(n);
  c.write(3, 0, k, v, pos);
  EXPECT_EQ(c.used_blocks(), 4);
  // Head 0 keeps early slots, head 1 late ones; out-of-order on purpose.
  auto keep = torch::tensor({0, 2, 3, 9, 13, 1, 7, 8, 10, 11, 12, 5}, torch::kLong).view({kKV, 6});
  c.compact(3, 0, keep);
  EXPECT_EQ(c.length(3, 0), 6);
  EXPECT_EQ(c.used_blocks(), 2);  // old blocks went back at once
  auto [kc, vc] = c.gather(3, 0);
  for (int64_t h = 0; h < kKV; ++h) {
    EXPECT_TRUE(torch::equal(kc[h], k[h].index_select(0, keep[h])));
    EXPECT_TRUE(torch::equal(vc[h], v[h].index_select(0, keep[h])));
    EXPECT_TRUE(torch::equal(c.positions(3, 0)[h], pos[h].index_select(0, keep[h])));
  }
  // Decode continues after compaction, then a second compaction down to one slot, then to none.
  c.append(0, {3}, torch::randn({1, kKV, kD}), torch::randn({1, kKV, kD}), {99});
  EXPECT_EQ(c.length(3, 0), 7);
  EXPECT_EQ(c.positions(3, 0)[1][6].item<int64_t>(), 99);
  c.compact(3, 0, torch::tensor({6, 0}, torch::kLong).view({kKV, 1}));
  EXPECT_EQ(c.positions(3, 0)[0][0].item<int64_t>(), 99);
  EXPECT_EQ(c.positions(3, 0)[1][0].item<int64_t>(), pos[1][7].item<int64_t>());  // head 1 slot 0 was old slot 7
  EXPECT_EQ(c.used_blocks(), 1);
  EXPECT_THROW(c.compact(3, 0, torch::tensor({1, 0}, torch::kLong).view({kKV, 1})), KvError);  // slot 1 >= length
  c.compact(3, 0, torch::empty({kKV, 0}, torch::kLong));
  EXPECT_EQ(c.length(3, 0), 0);
  EXPECT_EQ(c.used_blocks(), 0);
  c.release(3);
  expect_all_free(c);
}

TEST(PagedKvCache, ExhaustionLeavesOthersIntact) {
  PagedKvCache c(2, opts(6));
  c.add_sequence(1);
  auto k = rand_kv(8), v = rand_kv(8);
  c.write(1, 0, k, v, make_pos(8));  // 2 blocks
  c.write(1, 1, k, v, make_pos(8));  // 2 blocks
  c.add_sequence(2);
  c.write(2, 0, rand_kv(4), rand_kv(4), make_pos(4));  // 1 block, 1 free left
  const auto expect_one_intact = [&] {
    auto [k1, v1] = c.gather(1, 0);
    EXPECT_TRUE(torch::equal(k1, k));
    EXPECT_TRUE(torch::equal(v1, v));
    EXPECT_EQ(c.length(1, 1), 8);
    c.check_invariants();
  };
  // write
  try {
    c.write(2, 1, rand_kv(12), rand_kv(12), make_pos(12));
    FAIL() << "expected KvError";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("KV pool exhausted: need 3 blocks, 1 free (sequence 2, layer 1)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(c.length(2, 1), 0);
  EXPECT_EQ(c.length(2, 0), 4);
  EXPECT_EQ(c.free_blocks(), 1);
  expect_one_intact();
  // compact needs fresh blocks while the old ones are still read
  c.write(2, 1, rand_kv(4), rand_kv(4), make_pos(4));  // last free block
  EXPECT_EQ(c.free_blocks(), 0);
  EXPECT_THROW(c.compact(1, 0, torch::zeros({kKV, 1}, torch::kLong)), KvError);
  expect_one_intact();
  // append: sequence 2 layer 0 is full (4/4), sequence 1 layer 0 too; nothing changes on failure
  try {
    c.append(0, {1, 2}, torch::randn({2, kKV, kD}), torch::randn({2, kKV, kD}), {8, 4});
    FAIL() << "expected KvError";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("KV pool exhausted: need 2 blocks, 0 free (sequence 1, layer 0)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(c.length(2, 0), 4);
  expect_one_intact();
  // the failing sequence is still consistent and releasable; then the other one can grow
  c.release(2);
  c.append(0, {1}, torch::randn({1, kKV, kD}), torch::randn({1, kKV, kD}), {8});
  EXPECT_EQ(c.length(1, 0), 9);
  c.release(1);
  expect_all_free(c);
}

TEST(PagedKvCache, HighWaterMark) {
  PagedKvCache c(2, opts(32));
  c.add_sequence(1);
  c.write(1, 0, rand_kv(16), rand_kv(16), make_pos(16));  // 4 blocks
  c.reset_high_water();
  EXPECT_EQ(c.high_water_blocks(), 4);
  c.write(1, 1, rand_kv(16), rand_kv(16), make_pos(16));  // +4
  c.compact(1, 1, torch::zeros({kKV, 2}, torch::kLong));  // +1 transient, then -4
  EXPECT_EQ(c.high_water_blocks(), 9);
  EXPECT_EQ(c.used_blocks(), 5);
  c.release(1);
  expect_all_free(c);
}

TEST(PagedKvCache, RandomTrafficKeepsInvariantsAndContent) {
  std::mt19937 rng(99);
  const int64_t L = 3;
  PagedKvCache c(L, opts(48));
  // Shadow copy of every (seq, layer): K, V, positions as [KV, len, ...].
  struct Shadow {
    torch::Tensor k, v, p;
  };
  std::map<int64_t, std::vector<Shadow>> shadow;
  int64_t next_id = 0;
  for (int step = 0; step < 400; ++step) {
    const int op = static_cast<int>(rng() % 5);
    try {
      if (op == 0 || shadow.empty()) {
        const int64_t id = next_id++;
        c.add_sequence(id);
        shadow[id] = std::vector<Shadow>(L, Shadow{rand_kv(0), rand_kv(0), make_pos(0)});
      } else {
        auto it = shadow.begin();
        std::advance(it, rng() % shadow.size());
        const int64_t id = it->first;
        const int64_t l = rng() % L;
        Shadow& s = it->second[l];
        if (op == 1) {
          const int64_t n = rng() % 20;
          Shadow ns{rand_kv(n), rand_kv(n), make_pos(n, step)};
          c.write(id, l, ns.k, ns.v, ns.p);
          s = ns;
        } else if (op == 2 && s.k.size(1) > 0) {
          const int64_t len = s.k.size(1), m = rng() % (len + 1);
          std::vector<torch::Tensor> rows;
          for (int64_t h = 0; h < kKV; ++h) rows.push_back(torch::randperm(len, torch::kLong).narrow(0, 0, m));
          auto keep = torch::stack(rows);
          c.compact(id, l, keep);
          Shadow ns{torch::empty({kKV, m, kD}), torch::empty({kKV, m, kD}), torch::empty({kKV, m}, torch::kLong)};
          for (int64_t h = 0; h < kKV; ++h) {
            ns.k[h] = s.k[h].index_select(0, keep[h]);
            ns.v[h] = s.v[h].index_select(0, keep[h]);
            ns.p[h] = s.p[h].index_select(0, keep[h]);
          }
          s = ns;
        } else if (op == 3) {
          auto k = torch::randn({1, kKV, kD}), v = torch::randn({1, kKV, kD});
          c.append(l, {id}, k, v, {1000 + step});
          s.k = torch::cat({s.k, k.transpose(0, 1)}, 1);
          s.v = torch::cat({s.v, v.transpose(0, 1)}, 1);
          s.p = torch::cat({s.p, torch::full({kKV, 1}, 1000 + step, torch::kLong)}, 1);
        } else if (op == 4) {
          c.release(id);
          shadow.erase(it);
        }
      }
    } catch (const KvError& e) {
      ASSERT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos) << e.what();
    }
    c.check_invariants();
    ASSERT_EQ(c.used_blocks() + c.free_blocks(), c.total_blocks());
    if (step % 25 == 0) {
      for (auto& [id, layers] : shadow) {
        for (int64_t l = 0; l < L; ++l) {
          auto [k, v] = c.gather(id, l);
          ASSERT_TRUE(torch::equal(k, layers[l].k)) << "seq " << id << " layer " << l << " step " << step;
          ASSERT_TRUE(torch::equal(v, layers[l].v));
          ASSERT_TRUE(torch::equal(c.positions(id, l), layers[l].p));
        }
      }
    }
  }
  for (auto& [id, layers] : shadow) c.release(id);
  expect_all_free(c);
}

}  // namespace
}  // namespace kvserve
