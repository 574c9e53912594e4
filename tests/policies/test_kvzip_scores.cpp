// KVzip's score bookkeeping (policies/kvzip_scores.h) and its policy config.
#include <gtest/gtest.h>

#include <cmath>

#include "common/check.h"
#include "policies/kvzip_scores.h"
#include "policies/policy_config.h"
#include "policies/prefill_selector.h"
#include "policies/top_select.h"

namespace kvserve {
namespace {

std::vector<int64_t> row(const torch::Tensor& t, int64_t r, int64_t n = -1) {
  auto x = t[r].to(torch::kCPU).to(torch::kInt64).contiguous();
  if (n >= 0) x = x.narrow(0, 0, n);
  return std::vector<int64_t>(x.data_ptr<int64_t>(), x.data_ptr<int64_t>() + x.numel());
}

TEST(KvzipPolicy, DefaultsAndKvpressChunk) {
  PolicyConfig c = make_policy_config("kvzip");
  EXPECT_EQ(c.allocator, AllocatorKind::kGlobal);
  EXPECT_EQ(c.scorer, ScorerKind::kReconstruction);
  EXPECT_TRUE(c.head_adaptive());
  EXPECT_TRUE(c.scores_after_prefill());
  EXPECT_EQ(c.sink, 4);
  EXPECT_EQ(c.window, 0);
  EXPECT_EQ(c.chunk_size, 2000);
  EXPECT_DOUBLE_EQ(c.budget_ratio, 0.25);
  EXPECT_EQ(make_policy_config("kvzip", {{"semantics", "kvpress"}}).chunk_size, 2048);
  EXPECT_EQ(make_policy_config("kvzip", {{"semantics", "kvpress"}, {"chunk_size", "64"}}).chunk_size, 64);
  EXPECT_EQ(to_json(c)["chunk_size"], 2000);
  EXPECT_EQ(to_json(c)["allocator"], "global");
  // The scores drive the per-layer allocators too.
  PolicyConfig u = make_policy_config("kvzip", {{"allocator", "uniform"}, {"head_budgets", "uniform"}});
  EXPECT_FALSE(u.head_adaptive());
  EXPECT_NO_THROW(make_policy_config("kvzip", {{"allocator", "pyramid"}, {"budget", "64"}}));
  EXPECT_NO_THROW(make_policy_config("kvzip", {{"allocator", "dynamic"}, {"budget", "64"}}));
}

TEST(KvzipPolicy, Refusals) {
  EXPECT_THROW(make_policy_config("kvzip", {{"head_budgets", "uniform"}}), KvError);  // global needs per-head lengths
  EXPECT_THROW(make_policy_config("snapkv", {{"allocator", "global"}}), KvError);     // global needs reconstruction
  EXPECT_THROW(make_policy_config("kvzip", {{"decode_budget", "256"}}), KvError);
  EXPECT_THROW(make_policy_config("kvzip", {{"prefix_reuse", "compressed"}}), KvError);
  EXPECT_THROW(make_policy_config("kvzip", {{"chunk_size", "0"}}), KvError);
  EXPECT_THROW(make_policy_config("kvzip", {{"skip_layers", "0"}}), KvError);
}

TEST(KvzapPolicy, DefaultsAndRefusals) {
  PolicyConfig c = make_policy_config("kvzap");
  EXPECT_EQ(c.allocator, AllocatorKind::kGlobal);
  EXPECT_EQ(c.scorer, ScorerKind::kPredicted);
  EXPECT_TRUE(c.head_adaptive());
  EXPECT_TRUE(c.scores_after_prefill());
  EXPECT_TRUE(c.query_agnostic());
  EXPECT_TRUE(c.compress_context);
  EXPECT_EQ(c.sink, 4);
  EXPECT_EQ(c.window, 0);
  EXPECT_DOUBLE_EQ(c.budget_ratio, 0.25);
  EXPECT_EQ(c.predictor, "");
  EXPECT_EQ(to_json(c)["scorer"], "predicted");
  // The predictor is part of the policy (and so of a compressed context's cache key).
  PolicyConfig p = make_policy_config("kvzap", {{"predictor", "/models/x/kvzap-mlp"}});
  EXPECT_EQ(p.predictor, "/models/x/kvzap-mlp");
  EXPECT_NE(to_json(p).dump(), to_json(c).dump());
  EXPECT_NO_THROW(make_policy_config("kvzap", {{"allocator", "uniform"}, {"head_budgets", "uniform"}}));
  EXPECT_NO_THROW(make_policy_config("kvzap", {{"allocator", "dynamic"}, {"budget", "64"}}));
  EXPECT_NO_THROW(make_policy_config("snapkv", {{"allocator", "uniform"}}));
  EXPECT_THROW(make_policy_config("kvzap", {{"decode_budget", "256"}}), KvError);
  EXPECT_THROW(make_policy_config("kvzap", {{"prefix_reuse", "compressed"}}), KvError);
  EXPECT_THROW(make_policy_config("kvzap", {{"predictor", ""}}), KvError);
  EXPECT_THROW(make_policy_config("snapkv", {{"predictor", "/tmp/p"}}), KvError);  // not its scorer's parameter
  EXPECT_THROW(make_policy_config("knorm", {{"allocator", "global"}, {"head_budgets", "adaptive"}}), KvError);
}

TEST(KvzipPlan, ChunksWindowAndBegin) {
  PolicyConfig c = make_policy_config("kvzip", {{"chunk_size", "4"}, {"window", "2"}});
  ReconstructionPlan p = plan_reconstruction(c, 15, 3);
  EXPECT_EQ(p.begin, 3);
  EXPECT_EQ(p.end, 13);
  EXPECT_EQ(p.sink, 4);
  ASSERT_EQ(p.chunks.size(), 3u);
  EXPECT_EQ(p.chunks[0], (std::pair<int64_t, int64_t>{3, 7}));
  EXPECT_EQ(p.chunks[2], (std::pair<int64_t, int64_t>{11, 13}));
  // A begin past the context: nothing to reconstruct.
  EXPECT_TRUE(plan_reconstruction(c, 15, 40).chunks.empty());
  // kvpress's sink keys: none while the chunk starts at 0, then min(n_sink, start).
  EXPECT_EQ(score_sink_keys(4, 0), 0);
  EXPECT_EQ(score_sink_keys(4, 2), 2);
  EXPECT_EQ(score_sink_keys(4, 100), 4);
}

// Naive reference: for each query head and query, softmax over [sinks, chunk, own<=i].
torch::Tensor naive_max(const torch::Tensor& q, const torch::Tensor& sk, const torch::Tensor& ck, const torch::Tensor& ok) {
  const int64_t H = q.size(0), n = q.size(1), D = q.size(2), KV = ok.size(0), G = H / KV, c = ck.size(1);
  auto out = torch::zeros({KV, c}, torch::kFloat64);
  for (int64_t h = 0; h < H; ++h) {
    const int64_t kvh = h / G;
    for (int64_t i = 0; i < n; ++i) {
      auto keys = torch::cat({sk[kvh], ck[kvh], ok[kvh].narrow(0, 0, i + 1)}, 0).to(torch::kFloat64);
      auto w = torch::softmax(torch::mv(keys, q[h][i].to(torch::kFloat64)) / std::sqrt(static_cast<double>(D)), 0);
      out[kvh] = torch::maximum(out[kvh], w.narrow(0, sk.size(1), c));
    }
  }
  return out;
}

TEST(KvzipAttention, MaxOverGroupAndQueriesMatchesNaive) {
  torch::manual_seed(3);
  const int64_t H = 6, KV = 2, D = 8, n = 7, s = 3, c = 5;
  auto q = torch::randn({H, n, D}) * 2;
  auto sk = torch::randn({KV, s, D}), ck = torch::randn({KV, c, D}), ok = torch::randn({KV, n, D});
  auto got = reconstruction_attention_max(q, sk, ck, ok);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{KV, c}));
  EXPECT_TRUE(torch::allclose(got.to(torch::kFloat64), naive_max(q, sk, ck, ok), 1e-5, 1e-6));
  // No sink keys (a first chunk at position 0).
  auto none = torch::empty({KV, 0, D});
  EXPECT_TRUE(torch::allclose(reconstruction_attention_max(q, none, ck, ok).to(torch::kFloat64), naive_max(q, none, ck, ok),
                              1e-5, 1e-6));
  // The tensor path (other dtypes and devices: the mask added, a log-sum-exp), in fp64 here; and
  // the fp32 CPU loop over more queries than one tile (300 > 256).
  auto q64 = q.to(torch::kFloat64);
  EXPECT_TRUE(torch::allclose(reconstruction_attention_max(q64, sk.to(torch::kFloat64), ck.to(torch::kFloat64),
                                                           ok.to(torch::kFloat64)),
                              naive_max(q, sk, ck, ok), 1e-9, 1e-12));
  auto qb = torch::randn({H, 300, D}), okb = torch::randn({KV, 300, D});
  EXPECT_TRUE(torch::allclose(reconstruction_attention_max(qb, sk, ck, okb).to(torch::kFloat64), naive_max(qb, sk, ck, okb),
                              1e-5, 1e-6));
  // Large logits: most of a row's exponentials underflow (the vectorized exp's cut-off at -87.3).
  auto qs = qb * 40;
  EXPECT_TRUE(torch::allclose(reconstruction_attention_max(qs, sk, ck, okb).to(torch::kFloat64), naive_max(qs, sk, ck, okb),
                              1e-5, 1e-6));
  EXPECT_THROW(reconstruction_attention_max(q.narrow(0, 0, 5), sk, ck, ok), KvError);  // H not a multiple of KV
}

TEST(KvzipScoreBoard, MaxMergesChunksAndProtectsSinks) {
  KvzipScoreBoard b(2, 1, 6, torch::TensorOptions().dtype(torch::kFloat32));
  b.record(0, 2, torch::tensor({{0.5f, 0.1f}}));
  b.record(0, 3, torch::tensor({{0.3f, 0.2f}}));  // overlapping: the maximum stays
  b.record(1, 0, torch::tensor({{0.9f, 0.0f, 0.0f, 0.0f, 0.0f, 0.7f}}));
  EXPECT_TRUE(torch::equal(b.layer_scores(0), torch::tensor({{0.0f, 0.0f, 0.5f, 0.3f, 0.2f, 0.0f}})));
  b.protect_sinks(2);  // every layer's sinks above the largest score of any layer
  EXPECT_TRUE(torch::equal(b.layer_scores(0), torch::tensor({{1.9f, 1.9f, 0.5f, 0.3f, 0.2f, 0.0f}})));
  EXPECT_FLOAT_EQ(b.layer_scores(1)[0][1].item<float>(), 1.9f);
  EXPECT_THROW(b.record(0, 5, torch::tensor({{0.5f, 0.1f}})), KvError);  // past the scored positions
}

TEST(KvzipSelection, GlobalTotals) {
  PolicyConfig paper = make_policy_config("kvzip", {{"budget", "10"}});
  EXPECT_EQ(global_kept_total(paper, 3, 2, 40), 3 * 2 * 10);
  PolicyConfig ratio = make_policy_config("kvzip", {{"budget", "0.3"}});
  EXPECT_EQ(global_kept_total(ratio, 3, 2, 41), 3 * 2 * 12);  // max(1, int(0.3 * 41)) per (layer, head)
  PolicyConfig kvp = make_policy_config("kvzip", {{"budget", "0.3"}, {"semantics", "kvpress"}});
  // kvpress prunes int(N * (1 - 0.3)) of N = 3 * 2 * 41 = 246: int(172.2) = 172 pruned, 74 kept.
  EXPECT_EQ(global_kept_total(kvp, 3, 2, 41), 74);
  PolicyConfig win = make_policy_config("kvzip", {{"budget", "10"}, {"window", "4"}});
  EXPECT_EQ(global_kept_total(win, 3, 2, 40), 3 * 2 * 6);  // the window inside the budget
}

TEST(KvzipSelection, OneTopKOverLayersAndHeads) {
  // Two layers, two heads, four positions; the best five entries anywhere.
  auto l0 = torch::tensor({{9.f, 1.f, 8.f, 0.f}, {0.f, 0.f, 0.f, 0.f}});
  auto l1 = torch::tensor({{7.f, 2.f, 2.f, 2.f}, {6.f, 5.f, 0.f, 0.f}});
  auto sel = global_head_selection({l0, l1}, 6, 0);
  ASSERT_EQ(sel.size(), 2u);
  // 9, 8, 7, 6, 5 and one of the three 2s: the lowest (layer 1, head 0, position 1).
  EXPECT_EQ(sel[0].counts, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(sel[1].counts, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(row(sel[0].positions, 0), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(row(sel[1].positions, 0), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(row(sel[1].positions, 1), (std::vector<int64_t>{0, 1}));
  // With a window every head keeps the trailing positions on top; a shorter head's row is padded
  // with valid positions.
  auto w = global_head_selection({l0, l1}, 3, 2);
  EXPECT_EQ(w[0].counts, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(row(w[0].positions, 0), (std::vector<int64_t>{0, 2, 4, 5}));
  EXPECT_EQ(row(w[0].positions, 1, 2), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(w[0].positions.size(1), 4);
  EXPECT_TRUE(w[0].positions.lt(6).all().item<bool>());
  EXPECT_THROW(global_head_selection({l0, l1}, 17, 0), KvError);
}

TEST(KvzipSelection, AShardTakesItsPartOfTheOneSelection) {
  // 3 layers x 4 KV heads: a shard holding layers [1, 3) and heads [2, 4) keeps exactly those rows
  // of the whole model's selection, counts and positions alike.
  torch::manual_seed(7);
  std::vector<torch::Tensor> scores;
  for (int l = 0; l < 3; ++l) scores.push_back(torch::rand({4, 10}));
  const auto whole = global_head_selection(scores, 37, 2);
  const auto part = global_head_selection(scores, 37, 2, 1, 2, 2, 2);
  ASSERT_EQ(part.size(), 2u);
  for (int64_t l = 0; l < 2; ++l) {
    const auto& w = whole[static_cast<size_t>(l + 1)];
    const auto& p = part[static_cast<size_t>(l)];
    EXPECT_EQ(p.counts, (std::vector<int64_t>{w.counts[2], w.counts[3]})) << "layer " << l + 1;
    EXPECT_TRUE(torch::equal(p.kept, w.kept.narrow(0, 2, 2))) << "layer " << l + 1;
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_TRUE(torch::equal(p.positions[h].narrow(0, 0, p.counts[h]), w.positions[h + 2].narrow(0, 0, p.counts[h])))
          << "layer " << l + 1 << " head " << h;
    }
  }
  EXPECT_THROW(global_head_selection(scores, 37, 2, 2, 2), KvError);      // layers past the model's
  EXPECT_THROW(global_head_selection(scores, 37, 2, 0, 3, 3, 2), KvError);  // heads past the model's
}

TEST(KvzipSelection, ScoresDriveThePerLayerAllocators) {
  // Uniform heads: each head's top budget by the given scores, as stable_top_positions.
  PolicyConfig c = make_policy_config("kvzip", {{"allocator", "uniform"}, {"head_budgets", "uniform"}, {"budget", "3"}});
  PrefillSelector sel(c, 2, 2, 8);
  torch::manual_seed(1);
  auto s0 = torch::rand({2, 8});
  auto kept = sel.on_layer_scores(0, s0);
  EXPECT_TRUE(torch::equal(kept, stable_top_positions(s0, 3)));
  EXPECT_THROW(sel.on_layer_scores(1, torch::rand({2, 7})), KvError);  // not [KV, prompt - window]
  // Adaptive heads: per-head counts differ, the layer's total is KV x budget.
  PolicyConfig a = make_policy_config("kvzip", {{"allocator", "uniform"}, {"budget", "3"}, {"alpha", "0"}});
  PrefillSelector ada(a, 1, 2, 8);
  auto s = torch::tensor({{9.f, 8.f, 7.f, 6.f, 5.f, 4.f, 3.f, 2.f}, {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 1.f}});
  ada.on_layer_scores(0, s);
  EXPECT_EQ(ada.last_head_counts(), (std::vector<int64_t>{6, 0}));
}

}  // namespace
}  // namespace kvserve
