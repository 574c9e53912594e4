// DynamicKV budgets: global top-k hits with deterministic ties, integer re-budgeting, schedule.
#include <gtest/gtest.h>

#include <numeric>

#include <torch/torch.h>

#include "policies/dynamic_budget.h"

using namespace kvserve;

namespace {
int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }
}  // namespace

TEST(DynamicHits, CountsPerLayerWithTiesToLowerLayer) {
  auto l0 = torch::tensor({{0.9f, 0.1f, 0.5f}});
  auto l1 = torch::tensor({{0.8f, 0.5f, 0.2f}});
  // top-3: 0.9 (l0), 0.8 (l1), then 0.5 ties between l0 and l1 -> lower layer wins.
  EXPECT_EQ(dynamic_topk_hits({l0, l1}, 3), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(dynamic_topk_hits({l0, l1}, 4), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(dynamic_topk_hits({l0, l1}, 6), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(dynamic_topk_hits({l0, l1}, 0), (std::vector<int64_t>{0, 0}));
  auto flat = torch::ones({2, 5});
  EXPECT_EQ(dynamic_topk_hits({flat, flat, flat}, 12), (std::vector<int64_t>{10, 2, 0}));
}

TEST(DynamicHits, MatchesStableSortOnRandomScores) {
  torch::manual_seed(3);
  std::vector<torch::Tensor> layers;
  for (int i = 0; i < 5; ++i) layers.push_back(torch::randint(0, 20, {3, 40}).to(torch::kFloat32));  // many ties
  auto all = torch::cat({layers[0].reshape(-1), layers[1].reshape(-1), layers[2].reshape(-1), layers[3].reshape(-1),
                         layers[4].reshape(-1)});
  for (int64_t k : {1, 17, 120, 333, 600}) {
    auto idx = std::get<1>(torch::sort(all, true, 0, true)).narrow(0, 0, k);
    auto layer = torch::div(idx, 120, "floor");
    auto counts = torch::bincount(layer, {}, 5);
    std::vector<int64_t> expect(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + 5);
    EXPECT_EQ(dynamic_topk_hits(layers, k), expect) << "k=" << k;
  }
}

TEST(DynamicRebudget, Arithmetic) {
  // 4 layers seen of 8, bs = 100, base = 20: total 160.
  // hits {40, 20, 12, 8} // 4 = {10, 5, 3, 2}; sum 20 -> b = {50, 25, 15, 10} (sum 100)
  // rescale to 160: {80, 40, 24, 16} sum 160 -> no remainder; cap 100; only shrink vs bs.
  auto b = dynamic_rebudget({40, 20, 12, 8}, 100, 20, 8, 1000, {100, 100, 100, 100});
  EXPECT_EQ(b, (std::vector<int64_t>{80, 40, 24, 16}));
  // Remainder to the last layer: hits {3, 3, 3} // 3 = {1,1,1}: b = {33,33,33} -> *60//99 = {20,20,20}.
  auto r = dynamic_rebudget({3, 3, 3}, 100, 20, 3, 1000, {100, 100, 100});
  EXPECT_EQ(r, (std::vector<int64_t>{20, 20, 20}));
  auto r2 = dynamic_rebudget({7, 3, 1}, 100, 10, 3, 1000, {100, 100, 100});
  // c = {2, 1, 0}; b = {66, 33, 0}; *30//99 = {20, 10, 0}; sum 30.
  EXPECT_EQ(r2, (std::vector<int64_t>{20, 10, 0}));
  // Only shrink and cap.
  auto s = dynamic_rebudget({40, 20, 12, 8}, 100, 20, 8, 50, {100, 30, 100, 100});
  EXPECT_EQ(s, (std::vector<int64_t>{50, 30, 24, 16}));
  // All int-divided counts zero: falls back to raw hits.
  auto z = dynamic_rebudget({1, 1, 0}, 10, 1, 3, 100, {10, 10, 10});
  EXPECT_EQ(sum(z), 3);
}

TEST(DynamicBudget, ScheduleAndFinalUpdate) {
  torch::manual_seed(0);
  const int64_t L = 6, m = 4, base = 10, bs = 50, heads = 2, n = 200;
  DynamicBudget d(L, base, bs, m);
  for (int64_t l = 0; l < L; ++l) {
    d.set_layer_scores(l, torch::rand({heads, n}));
    if (d.update_due_after(l)) {
      EXPECT_EQ(l, 3);
      auto nb = d.update(l + 1);
      EXPECT_EQ(nb.size(), 4u);
      for (auto x : nb) EXPECT_LE(x, bs);
    }
  }
  EXPECT_TRUE(d.final_update_due());
  auto fin = d.final_update();
  ASSERT_TRUE(fin.has_value());
  EXPECT_LE(sum(*fin), base * L);
  EXPECT_GE(sum(*fin), base * L / 2);  // only-shrink may cost some; never more than the total
  EXPECT_FALSE(d.final_update_due());
  EXPECT_FALSE(d.final_update().has_value());
  for (auto x : d.budgets()) EXPECT_LE(x, bs);
}

TEST(DynamicBudget, MissingScoresIsAnError) {
  DynamicBudget d(4, 10, 50, 2);
  d.set_layer_scores(1, torch::rand({2, 100}));
  EXPECT_THROW(d.update(2), std::exception);
}

TEST(DynamicShape, MinimumTakenFromTheLayersAbove) {
  DynamicOptions o;
  o.min_ratio = 0.5;  // base 20 -> minimum 10
  // Raise 10 (layer 0); the excess above 10 is {0, 0, 40}: layer 2 gives it all.
  EXPECT_EQ(dynamic_shape({0, 10, 50}, o, 20, {}), (std::vector<int64_t>{10, 10, 40}));
  // Excess {10, 30}: raise 8 taken 2 and 6.
  EXPECT_EQ(dynamic_shape({2, 20, 40}, o, 20, {}), (std::vector<int64_t>{10, 18, 34}));
  EXPECT_EQ(dynamic_shape({12, 30}, o, 20, {}), (std::vector<int64_t>{12, 30}));  // nothing below
}

TEST(DynamicShape, PriorMix) {
  DynamicOptions o;
  o.prior = BudgetPrior::kPyramid;
  o.prior_weight = 0.25;
  // 0.25 * b + 0.75 * prior over the layers seen.
  EXPECT_EQ(dynamic_shape({100, 0}, o, 20, {20, 40, 60}), (std::vector<int64_t>{40, 30}));
  o.prior_weight = 1.0;
  EXPECT_EQ(dynamic_shape({100, 0}, o, 20, {20, 40, 60}), (std::vector<int64_t>{100, 0}));
}

TEST(DynamicNormalize, RowsAndLayers) {
  auto s = torch::tensor({{1.0f, 3.0f, 2.0f, 2.0f}, {4.0f, 4.0f, 0.0f, 8.0f}});
  EXPECT_TRUE(torch::allclose(normalize_scores(s, ScoreNorm::kLayer, 4).sum(), torch::tensor(1.0f)));
  // Rows of 2 positions (two query heads side by side per KV head): each row sums to 1.
  auto h = normalize_scores(s, ScoreNorm::kHead, 2).view({4, 2});
  EXPECT_TRUE(torch::allclose(h.sum(1), torch::ones({4})));
  auto m = normalize_scores(s, ScoreNorm::kMax, 4);
  EXPECT_TRUE(torch::allclose(std::get<0>(m.max(1)), torch::ones({2})));
  EXPECT_TRUE(torch::equal(normalize_scores(s, ScoreNorm::kNone, 4), s));
}

TEST(DynamicBudget, NormalisedHeadsShareTheTotalMoreEvenly) {
  // Layer 0's scores are 100x layer 1's: unnormalised, layer 1 gets no hit; per head sums equal
  // both ways, so normalised both layers get hits.
  const int64_t L = 2, base = 10, bs = 40;
  torch::manual_seed(1);
  auto s0 = torch::rand({2, 100}) * 100, s1 = torch::rand({2, 100});
  DynamicBudget plain(L, base, bs, 2, 100);
  DynamicOptions o;
  o.norm = ScoreNorm::kHead;
  DynamicBudget normed(L, base, bs, 2, 100, o);
  for (auto* d : {&plain, &normed}) {
    d->set_layer_scores(0, s0);
    d->set_layer_scores(1, s1);
    d->update(2);
  }
  EXPECT_EQ(plain.budgets()[1], 0);
  EXPECT_GT(normed.budgets()[1], 5);
  EXPECT_EQ(normed.layer_scores(0).sum().item<float>(), s0.sum().item<float>());  // raw scores kept
}

TEST(DynamicBudget, AuthorsVariantLeavesTrailingLayers) {
  DynamicOptions o;
  o.variant = DynamicVariant::kAuthors;
  DynamicBudget d(6, 10, 50, 4, 100, o);
  for (int64_t l = 0; l < 6; ++l) {
    d.set_layer_scores(l, torch::rand({2, 3 * 100}));  // 2 KV heads x 3 query heads x 100 positions
    if (d.update_due_after(l)) d.update(l + 1);
  }
  EXPECT_FALSE(d.final_update_due());
  EXPECT_FALSE(d.final_update().has_value());
  EXPECT_EQ(d.budgets()[4], 50);
  EXPECT_EQ(d.budgets()[5], 50);
  EXPECT_LE(sum(std::vector<int64_t>(d.budgets().begin(), d.budgets().begin() + 4)), 10 * 6);
  EXPECT_THROW(d.set_layer_scores(0, torch::rand({2, 150})), std::exception);  // not rows of 100
}

TEST(DynamicNormalize, KthBestScoresOne) {
  auto s = torch::tensor({{5.0f, 1.0f, 3.0f, 2.0f}, {0.4f, 0.8f, 0.1f, 0.2f}});
  auto k = normalize_scores(s, ScoreNorm::kKth, 4, 2);  // second best of each row -> 1
  EXPECT_TRUE(torch::allclose(k, torch::tensor({{5.0f / 3, 1.0f / 3, 1.0f, 2.0f / 3}, {1.0f, 2.0f, 0.25f, 0.5f}})));
  EXPECT_TRUE(torch::allclose(normalize_scores(s, ScoreNorm::kKth, 4, 99).select(1, 2), torch::tensor({3.0f, 1.0f})));
}
