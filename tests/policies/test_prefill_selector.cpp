// PrefillSelector: kept sets respect budgets, always hold the window, and DynamicKV shrinks earlier
// layers to subsets.
#include <gtest/gtest.h>

#include <numeric>
#include <map>
#include <set>
#include <string>

#include <torch/torch.h>

#include "common/check.h"
#include "policies/prefill_selector.h"
#include "policies/score_exchange.h"
#include "policies/pyramid_budget.h"
#include "policies/token_scorer.h"
#include "policies/top_select.h"

using namespace kvserve;

namespace {

struct Qk {
  torch::Tensor q, k;
};

Qk random_qk(int64_t h, int64_t kv, int64_t t, int64_t d, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({h, t, d}), torch::randn({kv, t, d})};
}

void expect_valid(const torch::Tensor& kept, int64_t kv, int64_t t, int64_t window, int64_t max_count) {
  ASSERT_EQ(kept.dim(), 2);
  ASSERT_EQ(kept.scalar_type(), torch::kInt64);
  ASSERT_EQ(kept.size(0), kv);
  EXPECT_LE(kept.size(1), max_count);
  auto c = kept.contiguous();
  for (int64_t h = 0; h < kv; ++h) {
    const int64_t* p = c.data_ptr<int64_t>() + h * c.size(1);
    for (int64_t i = 1; i < c.size(1); ++i) ASSERT_LT(p[i - 1], p[i]) << "not strictly ascending";
    if (c.size(1) > 0) {
      ASSERT_GE(p[0], 0);
      ASSERT_LT(p[c.size(1) - 1], t);
    }
    std::set<int64_t> s(p, p + c.size(1));
    for (int64_t pos = t - window; pos < t; ++pos) EXPECT_TRUE(s.count(pos)) << "window position " << pos << " dropped";
  }
}

bool is_subset(const torch::Tensor& small, const torch::Tensor& big) {
  for (int64_t h = 0; h < small.size(0); ++h) {
    auto s = small[h].contiguous();
    auto b = big[h].contiguous();
    std::set<int64_t> bs(b.data_ptr<int64_t>(), b.data_ptr<int64_t>() + b.numel());
    for (int64_t i = 0; i < s.numel(); ++i)
      if (!bs.count(s.data_ptr<int64_t>()[i])) return false;
  }
  return true;
}

}  // namespace

TEST(PrefillSelector, FullAndShortPromptsKeepEverything) {
  auto qk = random_qk(4, 2, 50, 16, 1);
  for (const auto& name : policy_names()) {
    auto cfg = make_policy_config(name, name == "knorm" ? std::map<std::string, std::string>{{"budget", "64"}}
                                                        : std::map<std::string, std::string>{{"budget", "64"}});
    PrefillSelector sel(cfg, 3, 2, 50);
    EXPECT_FALSE(sel.compresses()) << name;
    for (int64_t l = 0; l < 3; ++l) {
      auto kept = sel.on_layer(l, qk.q, qk.k);
      EXPECT_TRUE(torch::equal(kept, torch::arange(50).expand({2, 50}))) << name;
    }
    sel.finish();
    EXPECT_TRUE(sel.take_updates().empty());
    EXPECT_EQ(sel.budgets(), (std::vector<int64_t>{50, 50, 50})) << name;
  }
}

TEST(PrefillSelector, UniformAndPyramidRespectBudgets) {
  const int64_t H = 8, KV = 2, T = 300, D = 16, L = 4;
  for (const std::string name : {"snapkv", "pyramidkv", "h2o", "streamingllm", "knorm", "random"}) {
    for (const std::string sem : {"paper", "kvpress"}) {
      auto cfg = make_policy_config(name, {{"budget", "40"}, {"semantics", sem}});
      PrefillSelector sel(cfg, L, KV, T);
      ASSERT_TRUE(sel.compresses());
      auto planned = sel.budgets();
      for (int64_t l = 0; l < L; ++l) {
        auto qk = random_qk(H, KV, T, D, 10 + l);
        auto kept = sel.on_layer(l, qk.q, qk.k);
        const bool skipped = cfg.skips_layer(l);
        expect_valid(kept, KV, T, cfg.window, skipped ? T : planned[l]);
        EXPECT_EQ(kept.size(1), planned[l]) << name << " " << sem << " layer " << l;
        if (!skipped && cfg.allocator == AllocatorKind::kUniform) { EXPECT_EQ(kept.size(1), 40) << name; }
      }
      sel.finish();
      EXPECT_TRUE(sel.take_updates().empty());
      if (name == "pyramidkv" && sem == "paper") { EXPECT_EQ(planned, pyramid_budgets_paper(T, 40, 8, 20, L)); }
    }
  }
}

TEST(PrefillSelector, StreamingKeepsSinksAndRecent) {
  auto cfg = make_policy_config("streamingllm", {{"budget", "20"}});
  PrefillSelector sel(cfg, 1, 2, 100);
  auto kept = sel.on_layer(0, {}, torch::randn({2, 100, 4}));
  std::vector<int64_t> expect = {0, 1, 2, 3};
  for (int64_t p = 84; p < 100; ++p) expect.push_back(p);
  for (int64_t h = 0; h < 2; ++h) {
    auto row = kept[h].contiguous();
    EXPECT_EQ(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + row.numel()), expect);
  }
}

TEST(PrefillSelector, KnormKeepsLowestNorms) {
  auto cfg = make_policy_config("knorm", {{"budget", "3"}, {"skip_layers", ""}});
  auto k = torch::zeros({1, 6, 2});
  // norms: 5, 1, 4, 1, 0.5, 9 -> keep positions 1, 3, 4 (ties 1 == 1 both fit)
  k[0][0][0] = 5;
  k[0][1][0] = 1;
  k[0][2][0] = 4;
  k[0][3][1] = 1;
  k[0][4][0] = 0.5;
  k[0][5][0] = 9;
  PrefillSelector sel(cfg, 1, 1, 6);
  auto kept = sel.on_layer(0, {}, k);
  EXPECT_TRUE(torch::equal(kept, torch::tensor({{1, 3, 4}}, torch::kInt64)));
}

TEST(PrefillSelector, TiesGoToLowerPositions) {
  auto cfg = make_policy_config("knorm", {{"budget", "3"}, {"skip_layers", ""}});
  PrefillSelector sel(cfg, 1, 2, 10);
  auto kept = sel.on_layer(0, {}, torch::ones({2, 10, 4}));
  EXPECT_TRUE(torch::equal(kept, torch::tensor({{0, 1, 2}, {0, 1, 2}}, torch::kInt64)));
}

TEST(PrefillSelector, DynamicShrinksEarlierLayersToSubsets) {
  const int64_t H = 4, KV = 2, T = 400, D = 8;
  for (int64_t L : {4, 6, 9}) {
    auto cfg = make_policy_config("dynamickv", {{"budget", "24"}, {"r_max", "5"}});
    PrefillSelector sel(cfg, L, KV, T);
    ASSERT_TRUE(sel.is_dynamic());
    std::vector<torch::Tensor> held(L);
    int updates = 0;
    for (int64_t l = 0; l < L; ++l) {
      auto qk = random_qk(H, KV, T, D, 100 + l);
      held[l] = sel.on_layer(l, qk.q, qk.k);
      expect_valid(held[l], KV, T, 8, 16 * 5 + 8);
      EXPECT_EQ(held[l].size(1), 16 * 5 + 8);
      for (auto& [layer, kept] : sel.take_updates()) {
        ASSERT_LE(layer, l);
        EXPECT_TRUE(is_subset(kept, held[layer])) << "layer " << layer;
        expect_valid(kept, KV, T, 8, held[layer].size(1));
        held[layer] = kept;
        ++updates;
      }
    }
    sel.finish();
    for (auto& [layer, kept] : sel.take_updates()) {
      EXPECT_TRUE(is_subset(kept, held[layer]));
      held[layer] = kept;
      ++updates;
    }
    EXPECT_GT(updates, 0);
    auto b = sel.budgets();
    int64_t total = 0;
    for (int64_t l = 0; l < L; ++l) {
      EXPECT_EQ(held[l].size(1), b[l]) << "L=" << L << " layer " << l;
      total += b[l];
    }
    EXPECT_LE(total, 24 * L) << "L=" << L;  // every layer ends inside the total budget
  }
}

// A score exchange that pretends a second shard holding KV heads with the same scores.
class DoublingExchange final : public ScoreExchange {
 public:
  int calls = 0;
  bool gathers_queries() const override { return false; }
  torch::Tensor gather_queries(const torch::Tensor& q) override { return q; }
  torch::Tensor gather_scores(int64_t, const torch::Tensor& local) override {
    ++calls;
    EXPECT_EQ(local.size(0), 2);
    EXPECT_EQ(local.size(1), 192);
    return torch::cat({local, local}, 0);
  }
  LayerScores receive_scores() override { return {}; }
  void send_scores(const LayerScores&) override {}
  std::vector<int64_t> agree_final_budgets(const std::vector<int64_t>& own) override { return own; }
};

TEST(PrefillSelector, DynamicExchangeSeesLocalScores) {
  auto cfg = make_policy_config("dynamickv", {{"budget", "24"}, {"m", "2"}});
  PrefillSelector sel(cfg, 2, 2, 200);
  DoublingExchange exchange;
  sel.set_exchange(exchange);
  for (int64_t l = 0; l < 2; ++l) {
    auto qk = random_qk(4, 2, 200, 8, l);
    sel.on_layer(l, qk.q, qk.k);
  }
  EXPECT_EQ(exchange.calls, 2);
  EXPECT_EQ(sel.layer_scores(0).size(0), 4);
  auto b = sel.budgets();
  EXPECT_LE(b[0] + b[1], 48);
}

TEST(PrefillSelector, WorksOnBf16) {
  auto qk = random_qk(4, 2, 120, 16, 5);
  auto cfg = make_policy_config("pyramidkv", {{"budget", "32"}});
  PrefillSelector sel(cfg, 2, 2, 120);
  auto kept = sel.on_layer(0, qk.q.to(torch::kBFloat16), qk.k.to(torch::kBFloat16));
  expect_valid(kept, 2, 120, 8, sel.budgets()[0]);
}

TEST(PrefillSelector, Errors) {
  auto cfg = make_policy_config("snapkv", {{"budget", "16"}});
  PrefillSelector sel(cfg, 2, 2, 100);
  auto qk = random_qk(4, 2, 100, 8, 0);
  EXPECT_THROW(sel.on_layer(2, qk.q, qk.k), KvError);                          // layer out of range
  EXPECT_THROW(sel.on_layer(0, qk.q, torch::randn({3, 100, 8})), KvError);    // wrong KV heads
  EXPECT_THROW(sel.on_layer(0, qk.q, torch::randn({2, 99, 8})), KvError);     // wrong length
  EXPECT_THROW(sel.on_layer(0, torch::randn({3, 100, 8}), qk.k), KvError);    // H not multiple of KV
  sel.on_layer(1, qk.q, qk.k);
  EXPECT_THROW(sel.on_layer(0, qk.q, qk.k), KvError);  // out of order
  EXPECT_THROW(PrefillSelector(cfg, 0, 2, 100), KvError);
  EXPECT_THROW(sel.layer_scores(0), KvError);  // not dynamic
}

TEST(PrefillSelector, DynamicAuthorsKeepsEachQueryHeadsChoiceAndChargesTheUnion) {
  const int64_t H = 6, KV = 2, T = 300, D = 8, L = 6, w = 8;
  auto cfg = make_policy_config("dynamickv", {{"budget", "24"}, {"r_max", "3"}, {"variant", "authors"}});
  PrefillSelector sel(cfg, L, KV, T);
  EXPECT_EQ(sel.budgets()[0], T);  // before any score the union may cover the whole scored region
  std::vector<torch::Tensor> held(L), q(L), k(L);
  for (int64_t l = 0; l < L; ++l) {
    auto qk = random_qk(H, KV, T, D, 200 + l);
    q[l] = qk.q;
    k[l] = qk.k;
    held[l] = sel.on_layer(l, qk.q, qk.k);
    expect_valid(held[l], KV, T, w, T);
    for (auto& [layer, kept] : sel.take_updates()) {
      EXPECT_TRUE(is_subset(kept, held[layer])) << "layer " << layer;
      held[layer] = kept;
    }
  }
  sel.finish();
  EXPECT_TRUE(sel.take_updates().empty());  // no final update in the authors' schedule
  const auto b = sel.dynamic_budgets();
  EXPECT_EQ(b[4], 3 * 16);  // trailing layers keep bs
  EXPECT_EQ(b[5], 3 * 16);
  const auto counts = sel.budgets();
  for (int64_t l = 0; l < L; ++l) {
    EXPECT_EQ(held[l].size(1), counts[l]) << "layer " << l;
    EXPECT_GE(held[l].size(1), b[l] + w);  // at least one query head's choice
    // Every query head's own top b[l] is held by its KV head.
    auto hs = window_attention_head_scores(q[l], k[l], w, cfg.kernel, cfg.pooling, false);
    auto top = stable_top_positions(hs, b[l]);
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_TRUE(is_subset(top.narrow(0, h, 1), held[l].narrow(0, h / (H / KV), 1))) << "layer " << l << " head " << h;
    }
  }
}

TEST(PrefillSelector, DynamicVariantsStayInsideTheBudget) {
  const int64_t H = 4, KV = 2, T = 400, D = 8, L = 9;
  for (const auto& params : std::vector<std::map<std::string, std::string>>{
           {{"normalize", "head"}}, {{"min_ratio", "0.5"}}, {{"prior", "pyramid"}, {"prior_weight", "0.5"}},
           {{"normalize", "layer"}, {"min_ratio", "0.25"}}}) {
    auto p = params;
    p["budget"] = "24";
    p["r_max"] = "5";
    auto cfg = make_policy_config("dynamickv", p);
    PrefillSelector sel(cfg, L, KV, T);
    std::vector<torch::Tensor> held(L);
    for (int64_t l = 0; l < L; ++l) {
      auto qk = random_qk(H, KV, T, D, 300 + l);
      held[l] = sel.on_layer(l, qk.q, qk.k);
      for (auto& [layer, kept] : sel.take_updates()) {
        EXPECT_TRUE(is_subset(kept, held[layer]));
        held[layer] = kept;
      }
    }
    sel.finish();
    for (auto& [layer, kept] : sel.take_updates()) held[layer] = kept;
    int64_t total = 0;
    const auto b = sel.budgets();
    for (int64_t l = 0; l < L; ++l) {
      EXPECT_EQ(held[l].size(1), b[l]);
      total += b[l];
      if (p.count("min_ratio")) { EXPECT_GE(b[l] - 8, static_cast<int64_t>(std::stod(p["min_ratio"]) * 16)) << l; }
    }
    EXPECT_LE(total, 24 * L + L) << p.begin()->first;  // integer rounding of the mix: at most 1 a layer
  }
}

// DynamicKV on a model with sliding-window layers budgets its global layers as a model of those
// alone would: the same kept positions per global layer (and the same re-selections) as a selector
// over the global layers only, while every local layer keeps its whole prompt. Every variant, the
// pyramid prior and head-adaptive budgets; update interval 1 and 2 so that re-budgets happen.
TEST(PrefillSelector, DynamicOnLocalLayersEqualsAModelOfTheGlobalLayers) {
  const int64_t H = 4, KV = 2, T = 300, D = 8;
  const std::vector<int64_t> local{0, 1, 3, 4, 5, 7};  // global: 2, 6, 8, 9
  const int64_t L = 10;
  for (const auto& params : std::vector<std::map<std::string, std::string>>{
           {{"update_interval", "1"}}, {{"update_interval", "2"}, {"variant", "authors"}},
           {{"update_interval", "1"}, {"prior", "pyramid"}, {"prior_weight", "0.5"}},
           {{"update_interval", "3"}, {"variant", "paper"}, {"head_budgets", "adaptive"}}}) {
    auto p = params;
    p["budget"] = "24";
    p["r_max"] = "4";
    PolicyConfig whole = make_policy_config("dynamickv", p);
    whole.local_layers = local;
    const PolicyConfig compact = make_policy_config("dynamickv", p);
    PrefillSelector mixed(whole, L, KV, T), globals(compact, L - static_cast<int64_t>(local.size()), KV, T);
    std::map<int64_t, torch::Tensor> want, got;  // by global layer's place
    int64_t g = 0;
    for (int64_t l = 0; l < L; ++l) {
      auto qk = random_qk(H, KV, T, D, 500 + l);
      auto kept = mixed.on_layer(l, qk.q, qk.k);
      if (whole.is_local_layer(l)) {
        EXPECT_TRUE(torch::equal(kept, position_range(KV, 0, T, kept.device()))) << "local layer " << l;
        EXPECT_TRUE(mixed.take_updates().empty());
        continue;
      }
      got[g] = kept;
      want[g] = globals.on_layer(g, qk.q, qk.k);
      for (auto& [layer, k] : globals.take_updates()) want[layer] = k;
      for (auto& [layer, k] : mixed.take_updates()) {
        const auto it = std::find(local.begin(), local.end(), layer);
        ASSERT_EQ(it, local.end()) << "a local layer was re-selected";
        got[layer - std::count_if(local.begin(), local.end(), [&](int64_t x) { return x < layer; })] = k;
      }
      ++g;
    }
    mixed.finish();
    globals.finish();
    for (auto& [layer, k] : globals.take_updates()) want[layer] = k;
    for (auto& [layer, k] : mixed.take_updates())
      got[layer - std::count_if(local.begin(), local.end(), [&](int64_t x) { return x < layer; })] = k;
    const std::string what = p.begin()->first + "=" + p.begin()->second + " " + p.rbegin()->first;
    ASSERT_EQ(got.size(), want.size()) << what;
    for (const auto& [i, k] : want) EXPECT_TRUE(torch::equal(got[i], k)) << what << " global layer " << i;
    const auto bm = mixed.budgets(), bg = globals.budgets();
    const auto dm = mixed.dynamic_budgets(), dg = globals.dynamic_budgets();
    int64_t i = 0;
    for (int64_t l = 0; l < L; ++l) {
      if (whole.is_local_layer(l)) {
        EXPECT_EQ(bm[l], T) << what << " layer " << l;
        EXPECT_EQ(dm[l], -1) << what << " layer " << l;
      } else {
        EXPECT_EQ(bm[l], bg[i]) << what << " layer " << l;
        EXPECT_EQ(dm[l], dg[i++]) << what << " layer " << l;
      }
    }
    // An earlier pipeline stage settles to the last stage's final budgets, given per model layer.
    PrefillSelector stage(whole, L, KV, T);
    for (int64_t l = 0; l < 3; ++l) {
      auto qk = random_qk(H, KV, T, D, 500 + l);
      stage.on_layer(l, qk.q, qk.k);
    }
    stage.take_updates();
    stage.apply_final_budgets(dm);
    for (auto& [layer, k] : stage.take_updates()) {
      EXPECT_EQ(layer, 2) << what;
      if (!whole.head_adaptive()) { EXPECT_EQ(k.size(1), bm[2]) << what; }
    }
    // The budget moved: some global layer ends below the candidates it started with.
    EXPECT_LT(*std::min_element(bg.begin(), bg.end()), 16 * 4 + 8) << what;
  }
}
