// Budget allocators: PyramidKV (authors' and kvpress arithmetic), uniform, DynamicKV sizes.
#include <gtest/gtest.h>

#include <numeric>

#include "policies/budget_allocator.h"
#include "policies/pyramid_budget.h"

using namespace kvserve;

namespace {
int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); }
}  // namespace

TEST(FloorDiv, MatchesPython) {
  EXPECT_EQ(floor_div(7, 2), 3);
  EXPECT_EQ(floor_div(-7, 2), -4);
  EXPECT_EQ(floor_div(7, -2), -4);
  EXPECT_EQ(floor_div(-8, 2), -4);
}

// (prompt, budget, window, beta, layers) -> first and last layer's kept count (window included).
struct PyramidCase {
  int64_t prompt, budget, window, beta, layers, first, last;
};

TEST(PyramidPaper, Table) {
  const PyramidCase cases[] = {
      // A=120, min=6, max=234, steps=228//31=7
      {1000, 128, 8, 20, 32, 242, 25},
      // clamp: max=234 >= 240-8 -> max=232, min=8, steps=224//31=7
      {240, 128, 8, 20, 32, 240, 23},
      // prompt < 2A: uniform A + w
      {200, 128, 8, 20, 32, 128, 128},
      // prompt <= B: not compressed
      {128, 128, 8, 20, 32, 128, 128},
      {100, 128, 8, 20, 32, 100, 100},
      // one layer: A + w
      {1000, 128, 8, 20, 1, 128, 128},
      // beta = 1: flat
      {1000, 128, 8, 1, 12, 128, 128},
      // two layers: A=56, min=2, max=110, steps=108
      {4096, 64, 8, 20, 2, 118, 10},
  };
  for (const auto& c : cases) {
    auto b = pyramid_budgets_paper(c.prompt, c.budget, c.window, c.beta, c.layers);
    ASSERT_EQ(static_cast<int64_t>(b.size()), c.layers);
    EXPECT_EQ(b.front(), c.first) << "prompt " << c.prompt << " budget " << c.budget << " layers " << c.layers;
    EXPECT_EQ(b.back(), c.last) << "prompt " << c.prompt << " budget " << c.budget << " layers " << c.layers;
    for (size_t l = 1; l < b.size(); ++l) EXPECT_LE(b[l], b[l - 1]);  // non-increasing
    for (auto x : b) EXPECT_LE(x, c.prompt);
  }
}

TEST(PyramidPaper, SumsToTotalWithinFloorRounding) {
  for (int64_t L : {1, 2, 3, 12, 32, 80}) {
    for (int64_t B : {16, 64, 128, 512}) {
      for (int64_t T : std::vector<int64_t>{B + 1, 2 * B, 3 * B + 7, 8192}) {
        auto b = pyramid_budgets_paper(T, B, 8, 20, L);
        if (T >= 2 * (B - 8)) {
          // floor(steps) only adds: the sum overshoots B*L by less than L(L-1)/2 + the clamp's slack.
          EXPECT_GE(sum(b), B * L - L) << T << " " << B << " " << L;
          EXPECT_LE(sum(b), B * L + L * (L - 1) / 2) << T << " " << B << " " << L;
        } else {
          EXPECT_EQ(sum(b), B * L);
        }
      }
    }
  }
}

TEST(PyramidKvpress, HandValues) {
  // kvpress PyramidKVPress: ratio 0.2 kept (compression_ratio 0.8) of 1000 tokens, window 8, 4 layers.
  auto cfg = make_policy_config("pyramidkv", {{"budget_ratio", "0.2"}, {"semantics", "kvpress"}});
  auto b = pyramid_budgets_kvpress(1000, kvpress_kept_average(cfg, 1000), 8, 20, 4);
  EXPECT_EQ(b, (std::vector<int64_t>{390, 263, 137, 10}));
  // Mean budget = kept average (kvpress's own test).
  EXPECT_EQ(sum(b), 800);
  // Fallback: min < window -> uniform round(kept).
  auto f = pyramid_budgets_kvpress(100, 50.0, 64, 20, 4);
  EXPECT_EQ(f, (std::vector<int64_t>{50, 50, 50, 50}));
  // Round half to even: 2.5 -> 2.
  // beta = 1 makes max = min = kept = 2.5: Python's round gives 2 (std::round would give 3).
  EXPECT_EQ(pyramid_budgets_kvpress(1000, 2.5, 0, 1, 1)[0], 2);
  EXPECT_EQ(pyramid_budgets_kvpress(1000, 3.5, 0, 1, 1)[0], 4);
}

TEST(Allocate, UniformPaperAndKvpress) {
  auto snap = make_policy_config("snapkv", {{"budget", "64"}});
  auto b = allocate_layer_budgets(snap, 1000, 4);
  for (const auto& lb : b) {
    EXPECT_FALSE(lb.full);
    EXPECT_EQ(lb.window, 8);
    EXPECT_EQ(lb.scored, 56);
    EXPECT_EQ(lb.kept(1000), 64);
  }
  // prompt <= budget: kept whole.
  for (const auto& lb : allocate_layer_budgets(snap, 64, 4)) EXPECT_TRUE(lb.full);
  // kvpress ratio: int(1000 * (1 - (1 - 0.3))) = 300 with the window inside.
  auto kv = make_policy_config("snapkv", {{"budget_ratio", "0.3"}, {"semantics", "kvpress"}});
  auto kb = allocate_layer_budgets(kv, 1000, 2);
  EXPECT_EQ(kb[0].kept(1000), 300);
  EXPECT_EQ(kb[0].window, 8);
  // Budget below the window under kvpress: the window itself is truncated.
  auto small = budget_with_window_inside(5, 8, 100);
  EXPECT_EQ(small.window, 5);
  EXPECT_EQ(small.scored, 0);
}

TEST(Allocate, KnormSkipsLayersAndPrompt) {
  auto kn = make_policy_config("knorm", {{"budget_ratio", "0.5"}});
  auto b = allocate_layer_budgets(kn, 100, 4);
  EXPECT_TRUE(b[0].full);
  EXPECT_TRUE(b[1].full);
  EXPECT_EQ(b[2].kept(100), 50);
  EXPECT_EQ(b[2].window, 0);
  auto kv = make_policy_config("knorm", {{"budget_ratio", "0.5"}, {"semantics", "kvpress"}});
  for (const auto& lb : allocate_layer_budgets(kv, 100, 4)) EXPECT_EQ(lb.kept(100), 50);
}

TEST(Allocate, PyramidLayerBudgetsAndFull) {
  auto p = make_policy_config("pyramidkv", {{"budget", "128"}});
  auto b = allocate_layer_budgets(p, 1000, 32);
  EXPECT_EQ(kept_counts(b, 1000), pyramid_budgets_paper(1000, 128, 8, 20, 32));
  for (const auto& lb : allocate_layer_budgets(p, 128, 32)) EXPECT_TRUE(lb.full);
  for (const auto& lb : allocate_layer_budgets(make_policy_config("full"), 1000, 3)) EXPECT_TRUE(lb.full);
}

// Gemma 3's mix (five sliding-window layers to one global): local layers keep everything and the
// pyramid runs over the global layers alone, in their order; skip_layers still name model layers.
TEST(Allocate, LocalLayersAreOutsideTheBudget) {
  auto p = make_policy_config("pyramidkv", {{"budget", "128"}});
  p.local_layers = {0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16};  // 18 layers, 3 global
  auto b = allocate_layer_budgets(p, 1000, 18);
  const auto global = pyramid_budgets_paper(1000, 128, 8, 20, 3);
  EXPECT_EQ(b[5].kept(1000), global[0]);
  EXPECT_EQ(b[11].kept(1000), global[1]);
  EXPECT_EQ(b[17].kept(1000), global[2]);
  EXPECT_GT(global[0], global[2]);
  for (int64_t l : p.local_layers) EXPECT_TRUE(b[static_cast<size_t>(l)].full) << l;
  EXPECT_TRUE(p.skips_layer(3));
  EXPECT_FALSE(p.skips_layer(5));
  auto s = make_policy_config("snapkv", {{"budget", "64"}});
  s.local_layers = {0, 2};
  s.skip_layers = {3};
  b = allocate_layer_budgets(s, 500, 5);
  EXPECT_TRUE(b[0].full && b[2].full && b[3].full);
  EXPECT_EQ(b[1].kept(500), 64);
  EXPECT_EQ(b[4].kept(500), 64);
  s.local_layers = {0, 1};  // no global layer: nothing to compress
  for (const auto& lb : allocate_layer_budgets(s, 500, 2)) EXPECT_TRUE(lb.full);
}

TEST(Allocate, DynamicCandidates) {
  auto d = make_policy_config("dynamickv", {{"budget", "64"}});
  auto s = dynamic_sizes(d, 1000);
  EXPECT_EQ(s.base, 56);
  EXPECT_EQ(s.bs, 560);
  auto s2 = dynamic_sizes(d, 300);  // bs capped at prompt - window
  EXPECT_EQ(s2.bs, 292);
  auto b = allocate_layer_budgets(d, 1000, 4);
  EXPECT_EQ(b[0].kept(1000), 568);
  for (const auto& lb : allocate_layer_budgets(d, 60, 4)) EXPECT_TRUE(lb.full);
}
