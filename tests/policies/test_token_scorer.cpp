// Token scorers against straightforward dense computations.
#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "common/check.h"
#include "policies/token_scorer.h"
#include "policies/top_select.h"

using namespace kvserve;

namespace {

// Dense per-query-head causal attention probabilities [H, T, T] (fp32), keys repeated for GQA.
torch::Tensor dense_probs(const torch::Tensor& q, const torch::Tensor& k) {
  const int64_t h = q.size(0), kv = k.size(0), t = k.size(1), d = k.size(2);
  auto kr = k.repeat_interleave(h / kv, 0);
  auto logits = torch::matmul(q, kr.transpose(1, 2)) / std::sqrt(static_cast<double>(d));
  auto mask = torch::ones({t, t}, torch::kBool).triu(1);
  logits.masked_fill_(mask, -INFINITY);
  return torch::softmax(logits, -1);
}

}  // namespace

TEST(WindowAttention, MatchesDenseComputation) {
  torch::manual_seed(0);
  const int64_t H = 6, KV = 2, T = 57, D = 8, W = 5;
  auto q = torch::randn({H, T, D}), k = torch::randn({KV, T, D});
  auto probs = dense_probs(q, k);  // [H, T, T]
  auto win = probs.narrow(1, T - W, W).narrow(2, 0, T - W);  // [H, W, T-W]
  for (bool mean : {false, true}) {
    for (auto pool : {PoolingKind::kMax, PoolingKind::kAvg}) {
      auto red = mean ? win.mean(1) : win.sum(1);  // [H, n]
      torch::Tensor pooled;
      if (pool == PoolingKind::kMax) {
        pooled = torch::max_pool1d(red.unsqueeze(0), {7}, {1}, {3}).squeeze(0);
      } else {
        // count_include_pad: zero padding, always divide by the kernel.
        auto padded = torch::constant_pad_nd(red, {3, 3}, 0);
        pooled = padded.unfold(1, 7, 1).sum(-1) / 7.0;
      }
      auto expect = pooled.view({KV, H / KV, T - W}).mean(1);
      auto got = window_attention_scores(q, k, W, 7, pool, mean);
      ASSERT_EQ(got.sizes(), expect.sizes());
      EXPECT_TRUE(torch::allclose(got, expect, 1e-5, 1e-7)) << "mean=" << mean << " pool=" << to_string(pool);
    }
  }
  // Only the window's queries are needed.
  auto only_window = window_attention_scores(q.narrow(1, T - W, W), k, W, 7, PoolingKind::kMax, false);
  EXPECT_TRUE(torch::allclose(only_window, window_attention_scores(q, k, W, 7, PoolingKind::kMax, false)));
  EXPECT_THROW(window_attention_scores(q.narrow(1, 0, 3), k, W, 7, PoolingKind::kMax, false), KvError);
}

TEST(AccumulatedAttention, ChunkedEqualsDense) {
  torch::manual_seed(1);
  const int64_t H = 4, KV = 2, T = 70, D = 8;
  auto q = torch::randn({H, T, D}), k = torch::randn({KV, T, D});
  auto probs = dense_probs(q, k);
  auto counts = torch::arange(T, 0, -1).to(torch::kFloat32);
  auto expect = (probs.sum(1) / counts).view({KV, H / KV, T}).mean(1).narrow(1, 0, T - 4);
  for (int64_t chunk : {0, 1, 7, 70}) {
    auto got = accumulated_attention_scores(q, k, 4, chunk);
    EXPECT_TRUE(torch::allclose(got, expect, 1e-5, 1e-7)) << "chunk " << chunk;
  }
}

TEST(KeyNorm, NegativeNormInFp32) {
  auto k = torch::tensor({{{3.0f, 4.0f}, {0.0f, 1.0f}, {1.0f, 0.0f}}});
  auto s = key_norm_scores(k.to(torch::kBFloat16), 3);
  EXPECT_EQ(s.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::allclose(s, torch::tensor({{-5.0f, -1.0f, -1.0f}})));
  EXPECT_EQ(key_norm_scores(k, 2).size(1), 2);
}

TEST(SinkRecent, SinksThenRecency) {
  auto s = sink_recent_scores(2, 10, 4, torch::kCPU);
  auto top = stable_top_positions(s, 6);
  EXPECT_TRUE(torch::equal(top, torch::tensor({{0, 1, 2, 3, 8, 9}, {0, 1, 2, 3, 8, 9}}, torch::kInt64)));
}

TEST(RandomScores, Seeded) {
  EXPECT_TRUE(torch::equal(random_scores(2, 20, 5, torch::kCPU), random_scores(2, 20, 5, torch::kCPU)));
  EXPECT_FALSE(torch::equal(random_scores(2, 20, 5, torch::kCPU), random_scores(2, 20, 6, torch::kCPU)));
}

TEST(TopSelect, StableAndSorted) {
  auto s = torch::tensor({{1.0f, 3.0f, 3.0f, 2.0f, 3.0f}});
  EXPECT_TRUE(torch::equal(stable_top_positions(s, 2), torch::tensor({{1, 2}}, torch::kInt64)));
  EXPECT_TRUE(torch::equal(stable_rank_order(s, 4), torch::tensor({{1, 2, 4, 3}}, torch::kInt64)));
  EXPECT_EQ(stable_top_positions(s, 0).size(1), 0);
  EXPECT_TRUE(torch::equal(stable_top_positions(s, 5), torch::arange(5).unsqueeze(0)));
  EXPECT_THROW(stable_top_positions(s, 6), KvError);
}

TEST(TopSelect, MatchesStableSortWithManyTies) {
  torch::manual_seed(11);
  for (int64_t n : {1, 5, 37, 99, 100}) {
    auto s = torch::randint(0, 6, {3, 100}).to(torch::kFloat32);  // heavy ties
    auto order = std::get<1>(torch::sort(s, /*stable=*/true, 1, /*descending=*/true)).narrow(1, 0, n);
    EXPECT_TRUE(torch::equal(stable_rank_order(s, n), order)) << "n=" << n;
    EXPECT_TRUE(torch::equal(stable_top_positions(s, n), std::get<0>(torch::sort(order, 1)))) << "n=" << n;
  }
}
