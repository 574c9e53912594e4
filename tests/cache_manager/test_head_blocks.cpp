// Head-wise block tables (KvPoolOptions::head_blocks): each (sequence, layer, KV head) holds its own
// length and only the blocks that length needs; decode attention reads each head's own tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "cache_manager/paged_kv_cache.h"
#include "cache_manager/paged_kv_memory.h"
#include "common/check.h"
#include "policies/policy_config.h"

namespace kvserve {
namespace {

constexpr int64_t kKV = 4, kG = 2, kD = 8, kBS = 4;

KvPoolOptions opts(int64_t blocks, bool head_blocks) {
  KvPoolOptions o;
  o.num_kv_heads = kKV;
  o.head_dim = kD;
  o.block_size = kBS;
  o.num_blocks = blocks;
  o.head_blocks = head_blocks;
  return o;
}

// Positions 100·h + 2·j: distinct per head and slot.
torch::Tensor make_pos(int64_t n) {
  return (torch::arange(n, torch::kLong) * 2).view({1, n}) + torch::arange(kKV, torch::kLong).view({kKV, 1}) * 100;
}

// Attention of q [H, D] over each KV head's first lens[h] rows of k, v [KV, n, D], in fp64.
torch::Tensor reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const std::vector<int64_t>& lens) {
  auto out = torch::zeros({kKV * kG, kD}, torch::kDouble);
  for (int64_t h = 0; h < kKV * kG; ++h) {
    const int64_t kvh = h / kG, n = lens[static_cast<size_t>(kvh)];
    if (n == 0) continue;
    auto kk = k[kvh].narrow(0, 0, n).to(torch::kDouble), vv = v[kvh].narrow(0, 0, n).to(torch::kDouble);
    auto w = torch::softmax(kk.matmul(q[h].to(torch::kDouble)) / std::sqrt(double(kD)), 0);
    out[h] = w.matmul(vv);
  }
  return out;
}

TEST(HeadBlocks, EachHeadHoldsOnlyItsOwnBlocks) {
  PagedKvCache c(2, opts(64, true));
  EXPECT_EQ(c.lanes(), kKV);
  EXPECT_EQ(c.num_kv_heads(), kKV);
  // A block holds one head: a quarter of a per-layer block.
  EXPECT_EQ(c.block_bytes(), KvBlockPool::bytes_per_block(1, kBS, kD, torch::kFloat32));
  c.add_sequence(7);
  const std::vector<int64_t> lens = {5, 1, 9, 0};
  auto k = torch::randn({kKV, 9, kD}), v = torch::randn({kKV, 9, kD});
  c.write(7, 0, k, v, make_pos(9), lens);
  c.write(7, 1, k, v, make_pos(9));  // every head whole
  c.check_invariants();
  EXPECT_EQ(c.head_lengths(7, 0), lens);
  EXPECT_EQ(c.length(7, 0), 9);
  EXPECT_FALSE(c.uniform(7, 0));
  EXPECT_TRUE(c.uniform(7, 1));
  // ceil(5/4) + ceil(1/4) + ceil(9/4) + 0 in layer 0, 4 x ceil(9/4) in layer 1.
  EXPECT_EQ(c.blocks_of(7), (2 + 1 + 3 + 0) + 4 * 3);
  auto pos = c.positions(7, 0);
  auto want = make_pos(9);
  for (int64_t h = 0; h < kKV; ++h) {
    for (int64_t j = 0; j < 9; ++j) {
      EXPECT_EQ(pos[h][j].item<int64_t>(), j < lens[h] ? want[h][j].item<int64_t>() : -1) << h << " " << j;
    }
  }
  EXPECT_THROW(c.gather(7, 0), KvError);  // a chunk's context needs one length per layer
  c.release(7);
  EXPECT_EQ(c.used_blocks(), 0);
  c.check_invariants();
}

TEST(HeadBlocks, PerLayerLayoutRefusesRaggedHeads) {
  PagedKvCache c(1, opts(64, false));
  c.add_sequence(1);
  auto k = torch::randn({kKV, 6, kD});
  EXPECT_THROW(c.write(1, 0, k, k, make_pos(6), {6, 5, 6, 6}), KvError);
  c.write(1, 0, k, k, make_pos(6), {6, 6, 6, 6});
  EXPECT_EQ(c.length(1, 0), 6);
}

// Decode appends a token to every head and attends over each head's own tokens; the planned step
// (begin_decode / decode_layer) and the one-call path agree with fp64 attention.
TEST(HeadBlocks, DecodeAttendsOverEachHeadsOwnTokens) {
  for (bool planned : {false, true}) {
    PagedKvCache c(1, opts(128, true));
    const std::vector<int64_t> ids = {3, 9};
    std::map<int64_t, std::vector<int64_t>> lens = {{3, {5, 1, 9, 0}}, {9, {4, 13, 2, 7}}};
    std::map<int64_t, torch::Tensor> ks, vs;
    for (int64_t id : ids) {
      c.add_sequence(id);
      ks[id] = torch::randn({kKV, 13, kD});
      vs[id] = torch::randn({kKV, 13, kD});
      c.write(id, 0, ks[id], vs[id], make_pos(13), lens[id]);
    }
    for (int step = 0; step < 6; ++step) {
      auto q = torch::randn({2, kKV * kG, kD}), k = torch::randn({2, kKV, kD}), v = torch::randn({2, kKV, kD});
      torch::Tensor out;
      if (planned) {
        c.begin_decode(ids, {100 + step, 200 + step});
        out = c.decode_layer(0, q, k, v);
      } else {
        out = c.append_and_attend(0, ids, {100 + step, 200 + step}, q, k, v);
      }
      c.check_invariants();
      for (size_t b = 0; b < ids.size(); ++b) {
        const int64_t id = ids[b];
        auto& L = lens[id];
        // The new token goes after each head's own last slot.
        auto kk = ks[id].clone(), vv = vs[id].clone();
        std::vector<int64_t> nl = L;
        auto grow = [&](torch::Tensor& t, const torch::Tensor& row) {
          const int64_t width = *std::max_element(nl.begin(), nl.end()) + 1;
          if (t.size(1) < width) t = torch::cat({t, torch::zeros({kKV, width - t.size(1), kD})}, 1);
          for (int64_t h = 0; h < kKV; ++h) t[h][nl[h]] = row[h];
        };
        grow(kk, k[b]);
        grow(vv, v[b]);
        for (auto& x : nl) ++x;
        ks[id] = kk;
        vs[id] = vv;
        L = nl;
        EXPECT_EQ(c.head_lengths(id, 0), L);
        auto want = reference(q[b], ks[id], vs[id], L);
        EXPECT_LT((out[b].to(torch::kDouble) - want).abs().max().item<double>(), 1e-5) << "step " << step << " seq " << id;
        // Each head's newest position is the step's.
        auto pos = c.positions(id, 0);
        for (int64_t h = 0; h < kKV; ++h) EXPECT_EQ(pos[h][L[h] - 1].item<int64_t>(), (b == 0 ? 100 : 200) + step);
      }
    }
    for (int64_t id : ids) c.release(id);
    EXPECT_EQ(c.used_blocks(), 0);
  }
}

// Uniform heads under the head-wise layout give the per-layer layout's attention, in the same memory.
TEST(HeadBlocks, UniformHeadsMatchThePerLayerLayout) {
  PagedKvCache a(2, opts(64, false)), b(2, opts(64 * kKV, true));
  auto k = torch::randn({kKV, 11, kD}), v = torch::randn({kKV, 11, kD});
  for (PagedKvCache* c : {&a, &b}) {
    c->add_sequence(1);
    for (int64_t l = 0; l < 2; ++l) c->write(1, l, k, v, make_pos(11));
  }
  EXPECT_EQ(a.bytes_of(1), b.bytes_of(1));
  for (int step = 0; step < 3; ++step) {
    auto q = torch::randn({1, kKV * kG, kD}), kn = torch::randn({1, kKV, kD}), vn = torch::randn({1, kKV, kD});
    a.begin_decode({1}, {50 + step});
    b.begin_decode({1}, {50 + step});
    for (int64_t l = 0; l < 2; ++l) {
      auto oa = a.decode_layer(l, q, kn, vn), ob = b.decode_layer(l, q, kn, vn);
      EXPECT_LT((oa - ob).abs().max().item<double>(), 1e-6);
    }
    EXPECT_EQ(a.bytes_of(1), b.bytes_of(1));
    EXPECT_TRUE(torch::equal(a.positions(1, 1), b.positions(1, 1)));
  }
  auto [ga, va] = a.gather(1, 0);
  auto [gb, vb] = b.gather(1, 0);
  EXPECT_TRUE(torch::equal(ga, gb));
  EXPECT_TRUE(torch::equal(va, vb));
}

TEST(HeadBlocks, CompactKeepsPerHeadCounts) {
  PagedKvCache c(1, opts(64, true));
  c.add_sequence(2);
  auto k = torch::randn({kKV, 10, kD});
  c.write(2, 0, k, k, make_pos(10));
  // Head h keeps slots 0, 2, 4, ... its first counts[h] of them.
  auto keep = (torch::arange(5, torch::kLong) * 2).view({1, 5}).expand({kKV, 5}).contiguous();
  c.compact(2, 0, keep, {5, 0, 3, 1});
  c.check_invariants();
  EXPECT_EQ(c.head_lengths(2, 0), (std::vector<int64_t>{5, 0, 3, 1}));
  EXPECT_EQ(c.blocks_of(2), 2 + 0 + 1 + 1);
  auto pos = c.positions(2, 0);
  EXPECT_EQ(pos[2][2].item<int64_t>(), 200 + 8);
  EXPECT_EQ(pos[1][0].item<int64_t>(), -1);
}

// Prefix-cache blocks of a head-wise pool: stored lane-major and shared back whole.
TEST(HeadBlocks, StoredBlocksShareBackPerHead) {
  PagedKvCache c(1, opts(64, true));
  auto k = torch::randn({kKV, 8, kD}), v = torch::randn({kKV, 8, kD});
  auto blocks = c.store_blocks(k, v, 0);
  EXPECT_EQ(blocks.size(), static_cast<size_t>(kKV * 2));
  c.add_sequence(5);
  c.share(5, 0, blocks, 8);
  c.drop(blocks);
  auto [gk, gv] = c.gather(5, 0);
  EXPECT_TRUE(torch::equal(gk, k));
  EXPECT_TRUE(torch::equal(gv, v));
  c.release(5);
  EXPECT_EQ(c.used_blocks(), 0);
}

// A head-adaptive policy on a real pool: each head keeps its own count, the layer's total is the
// uniform policy's, and the sequence holds exactly sum over (layer, head) of ceil(kept / block_size).
TEST(HeadBlocks, AdaptivePolicyHoldsOnlyWhatEachHeadKeeps) {
  constexpr int64_t L = 3, T = 64;
  std::map<std::string, PolicyConfig> policies;
  policies["ada"] = make_policy_config("snapkv", {{"budget", "20"}, {"head_budgets", "adaptive"}});
  policies["ada"].name = "ada";
  policies["snap"] = make_policy_config("snapkv", {{"budget", "20"}});
  policies["snap"].name = "snap";
  EXPECT_THROW(PagedKvMemory(L, opts(512, false), policies), KvError);  // adaptive needs head blocks
  PagedKvMemory kv(L, opts(512, true), policies);
  torch::manual_seed(3);
  std::vector<torch::Tensor> qs, ks, vs;
  for (int64_t l = 0; l < L; ++l) {
    qs.push_back(torch::randn({kKV * kG, T, kD}) * 2);
    ks.push_back(torch::randn({kKV, T, kD}) * 2);
    vs.push_back(torch::randn({kKV, T, kD}));
  }
  for (const char* name : {"ada", "snap"}) {
    const int64_t id = name[0] == 'a' ? 1 : 2;
    kv.begin_prefill(id, T, name);
    for (int64_t l = 0; l < L; ++l) kv.store_prefill(id, l, qs[l], ks[l], vs[l]);
    kv.end_prefill(id);
  }
  int64_t expect_blocks = 0;
  bool ragged = false;
  for (int64_t l = 0; l < L; ++l) {
    const auto lens = kv.cache().head_lengths(1, l);
    int64_t total = 0;
    for (int64_t x : lens) {
      total += x;
      expect_blocks += (x + kBS - 1) / kBS;
      EXPECT_GE(x, 8 + 2);  // the window plus alpha = 0.2 of the 12 scored
    }
    ragged = ragged || !kv.cache().uniform(1, l);
    EXPECT_EQ(total, kKV * 20) << "layer " << l;
    EXPECT_EQ(kv.cache().head_lengths(2, l), std::vector<int64_t>(kKV, 20));
    // The window is kept by every head.
    auto pos = kv.kept_positions(1, l);
    for (int64_t h = 0; h < kKV; ++h) {
      const int64_t n = lens[static_cast<size_t>(h)];
      EXPECT_EQ(pos[h][n - 1].item<int64_t>(), T - 1);
      EXPECT_EQ(pos[h][n - 8].item<int64_t>(), T - 8);
    }
  }
  EXPECT_TRUE(ragged);
  EXPECT_EQ(kv.blocks_held(1), expect_blocks);
  EXPECT_EQ(kv.kept_tokens(1), kv.kept_tokens(2));
  const auto st = kv.head_kept(1);
  EXPECT_LT(st.min, st.max);
  EXPECT_DOUBLE_EQ(st.mean(), 20.0);
  // Admission's peak bounds what the prompt took.
  const auto g = kv.geometry();
  EXPECT_TRUE(g.head_blocks);
  EXPECT_GE(PagedKvMemory::prompt_blocks(policies["ada"], g, T), kv.blocks_held(1));
  // Decode a few steps of both sequences together.
  for (int step = 0; step < 5; ++step) {
    DecodeBatch batch{{1, 2}, {T + step, T + step}};
    kv.begin_decode(batch);
    for (int64_t l = 0; l < L; ++l) {
      auto out = kv.decode_attention(l, batch, torch::randn({2, kKV * kG, kD}), torch::randn({2, kKV, kD}),
                                     torch::randn({2, kKV, kD}));
      EXPECT_TRUE(out.isfinite().all().item<bool>());
    }
  }
  EXPECT_EQ(kv.cache().head_lengths(2, 0), std::vector<int64_t>(kKV, 25));
  kv.release(1);
  kv.release(2);
  EXPECT_EQ(kv.blocks_used(), 0);
  kv.cache().check_invariants();
}

// DynamicKV with head-wise budgets: each re-budget chooses again among what a layer's heads hold;
// every layer ends with KV x its budget tokens, spread unevenly, in exactly the blocks they need.
TEST(HeadBlocks, AdaptiveDynamicKvShrinksEachHeadInPlace) {
  constexpr int64_t L = 5, T = 96;
  std::map<std::string, PolicyConfig> policies;
  policies["dyn_ada"] = make_policy_config(
      "dynamickv", {{"budget", "24"}, {"head_budgets", "adaptive"}, {"m", "2"}, {"r_max", "3"}});
  policies["dyn_ada"].name = "dyn_ada";
  PagedKvMemory kv(L, opts(2048, true), policies);
  torch::manual_seed(5);
  kv.begin_prefill(1, T, "dyn_ada");
  for (int64_t l = 0; l < L; ++l) {
    kv.store_prefill(1, l, torch::randn({kKV * kG, T, kD}) * (1 + l), torch::randn({kKV, T, kD}) * 2,
                     torch::randn({kKV, T, kD}));
  }
  kv.end_prefill(1);
  kv.cache().check_invariants();
  const auto budgets = kv.prefill_budgets(1);
  int64_t expect_blocks = 0, sum = 0;
  bool ragged = false;
  for (int64_t l = 0; l < L; ++l) {
    int64_t total = 0;
    for (int64_t x : kv.cache().head_lengths(1, l)) {
      total += x;
      expect_blocks += (x + kBS - 1) / kBS;
    }
    EXPECT_EQ(total, kKV * budgets[static_cast<size_t>(l)]) << "layer " << l;
    sum += budgets[static_cast<size_t>(l)];
    ragged = ragged || !kv.cache().uniform(1, l);
  }
  EXPECT_TRUE(ragged);
  EXPECT_LE(sum, 24 * L);  // DynamicKV's total (window included)
  EXPECT_EQ(kv.blocks_held(1), expect_blocks);
  kv.release(1);
  EXPECT_EQ(kv.blocks_used(), 0);
}

}  // namespace
}  // namespace kvserve
