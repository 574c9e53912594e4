// Speculative decoding's parts without a model: prompt-lookup drafts, the config's JSON, a verify
// step in the paged cache (a sequence in several rows attends causally, as one row per step would,
// and its rejected rows' KV goes back to the pool), and a self-draft step's view of the cache.
#include <gtest/gtest.h>

#include <vector>

#include "backend/spec_decode/ngram_proposer.h"
#include "backend/spec_decode/speculation_governor.h"
#include "backend/spec_decode/speculative_config.h"
#include "cache_manager/draft_view.h"
#include "cache_manager/paged_kv_cache.h"
#include "common/check.h"

namespace kvserve {
namespace {

using V = std::vector<int64_t>;

// What parse_speculative_config_json throws for `json` as --speculative-config ("": it parses).
std::string message(const std::string& json) {
  try {
    parse_speculative_config_json(json, "--speculative-config");
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
  return std::string();
}

TEST(NgramProposer, LatestOccurrenceOfTheLongestSuffix) {
  // Suffix "7 8" occurs at 1 and 5; the latest (5) is followed by 30 31 7 8.
  const V prompt{1, 7, 8, 20, 21, 7, 8, 30, 31};
  const V output{7, 8};
  EXPECT_EQ(propose_ngram(prompt, output, 3, 2, 4), (V{30, 31, 7}));
  // The draft stops where the sequence does.
  EXPECT_EQ(propose_ngram(prompt, output, 10, 2, 4), (V{30, 31, 7, 8}));
  // A longer n is tried first: "21 7 8" only at 4..6, followed by 30.
  EXPECT_EQ(propose_ngram(V{5, 21, 7, 8, 9, 6, 7, 8, 40, 21}, V{7, 8}, 2, 2, 3), (V{9, 6}));
}

TEST(NgramProposer, NoMatchNoDraft) {
  EXPECT_TRUE(propose_ngram(V{1, 2, 3, 4}, V{5, 6}, 4, 2, 4).empty());
  EXPECT_TRUE(propose_ngram(V{1, 2, 3}, V{}, 0, 1, 2).empty());  // k = 0
  EXPECT_TRUE(propose_ngram(V{}, V{3}, 4, 1, 2).empty());
  // min_n 1: a single repeated token matches.
  EXPECT_EQ(propose_ngram(V{4, 9, 5}, V{4}, 2, 1, 2), (V{9, 5}));
}

TEST(SpeculativeConfig, ParsesVllmJson) {
  const SpeculativeConfig c = parse_speculative_config_json(
      R"({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2})", "--x");
  EXPECT_TRUE(c.enabled());
  EXPECT_EQ(c.num_speculative_tokens, 5);
  EXPECT_EQ(c.prompt_lookup_min, 2);
  EXPECT_EQ(c.prompt_lookup_max, 4);
  // One bound alone sets both where the default would contradict it.
  EXPECT_EQ(parse_speculative_config_json(R"({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1})", "x")
                .prompt_lookup_min,
            1);
  EXPECT_FALSE(parse_speculative_config_json(R"({"method": "none"})", "x").enabled());
}

TEST(SpeculativeConfig, ErrorsNameTheFlagAndKey) {
  EXPECT_NE(message("{nope").find("--speculative-config: not JSON"), std::string::npos);
  EXPECT_NE(message(R"({"method": "eagle", "num_speculative_tokens": 3})").find("method 'eagle' is not served"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "ngram"})").find("num_speculative_tokens must be in [1, 64]"), std::string::npos);
  EXPECT_NE(message(R"({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3})")
                .find("prompt_lookup_max (3) is below prompt_lookup_min (5)"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "ngram", "num_speculative_tokens": "4"})").find("num_speculative_tokens must be an integer"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "ngram", "num_speculative_tokens": 4, "draft_model": "x"})").find("unknown key 'draft_model'"),
            std::string::npos);
  EXPECT_NE(message("[1]").find("expected a JSON object"), std::string::npos);
  EXPECT_NE(message(R"({"method": "self", "num_speculative_tokens": 3, "draft_window_tokens": 0})")
                .find("draft_window_tokens must be >= 1"),
            std::string::npos);
}

TEST(SpeculativeConfig, SelfDraftKeys) {
  const SpeculativeConfig c = parse_speculative_config_json(
      R"({"method": "self", "num_speculative_tokens": 4, "draft_sink_tokens": 4, "draft_window_tokens": 64})", "--x");
  EXPECT_TRUE(c.enabled());
  EXPECT_TRUE(c.self_draft());
  EXPECT_EQ(c.draft_sink_tokens, 4);
  EXPECT_EQ(c.draft_window_tokens, 64);
  EXPECT_EQ(speculative_config_json(c),
            R"({"auto_disable":true,"disable_by_batch_size":0,"draft_min_context_tokens":4096,"draft_sampling":"greedy",)"
            R"("draft_sink_tokens":4,"draft_window_tokens":64,"method":"self","num_speculative_tokens":4})");
  EXPECT_FALSE(parse_speculative_config_json(R"({"method": "ngram", "num_speculative_tokens": 4})", "x").self_draft());
  EXPECT_EQ(parse_speculative_config_json(R"({"method": "self", "num_speculative_tokens": 4, "draft_sampling": "sample"})", "x")
                .draft_sampling,
            "sample");
}

TEST(SpeculativeConfig, SelfDraftWithAQuantizedCopy) {
  // A copy's draft steps are cheap at any length: unset, draft_min_context_tokens means 0 then.
  const SpeculativeConfig c = parse_speculative_config_json(
      R"({"method": "self", "num_speculative_tokens": 4, "quantization": "int8"})", "--x");
  EXPECT_TRUE(c.self_draft() && c.loads_draft_model() && c.runner_drafts());
  EXPECT_FALSE(c.model_draft());
  EXPECT_EQ(c.min_context_tokens(), 0);
  EXPECT_EQ(speculative_config_json(c),
            R"({"auto_disable":true,"disable_by_batch_size":0,"draft_min_context_tokens":0,"draft_sampling":"greedy",)"
            R"("draft_sink_tokens":16,"draft_window_tokens":496,"method":"self","model":"","num_speculative_tokens":4,)"
            R"("quantization":"int8"})");
  EXPECT_EQ(parse_speculative_config_json(
                R"({"method": "self", "num_speculative_tokens": 4, "model": "d.gguf", "draft_min_context_tokens": 1024})", "x")
                .min_context_tokens(),
            1024);
  // Without one the model's own weights draft, and only from 4096 tokens unless told otherwise.
  const SpeculativeConfig own = parse_speculative_config_json(
      R"({"method": "self", "num_speculative_tokens": 4, "quantization": "none"})", "x");
  EXPECT_FALSE(own.loads_draft_model());
  EXPECT_EQ(own.min_context_tokens(), 4096);
  EXPECT_NE(message(R"({"method": "self", "num_speculative_tokens": 4, "draft_min_context_tokens": -2})")
                .find("draft_min_context_tokens must be >= 0"),
            std::string::npos);
}

TEST(SpeculativeConfig, DraftSamplingIsGreedyOrSampleAndOnlyForSelf) {
  EXPECT_NE(message(R"({"method": "self", "num_speculative_tokens": 4, "draft_sampling": "top"})")
                .find("--speculative-config: draft_sampling must be greedy or sample, got 'top'"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "ngram", "num_speculative_tokens": 4, "draft_sampling": "sample"})")
                .find("draft_sampling 'sample' needs method 'self'"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "ngram", "num_speculative_tokens": 4, "auto_disable": 1})")
                .find("auto_disable must be true or false, got 1"),
            std::string::npos);
  EXPECT_FALSE(parse_speculative_config_json(R"({"method": "ngram", "num_speculative_tokens": 4, "auto_disable": false})", "x")
                   .auto_disable);
  EXPECT_NE(message(R"({"method": "self", "num_speculative_tokens": 4, "draft_sampling": 1})")
                .find("draft_sampling must be greedy or sample, got 1"),
            std::string::npos);
}

TEST(SpeculativeConfig, DraftModelKeys) {
  const SpeculativeConfig c = parse_speculative_config_json(
      R"({"method": "draft_model", "num_speculative_tokens": 5, "model": "d.gguf", "draft_sampling": "sample"})", "--x");
  EXPECT_TRUE(c.enabled() && c.model_draft() && c.runner_drafts());
  EXPECT_FALSE(c.self_draft());
  EXPECT_EQ(speculative_config_json(c),
            R"({"auto_disable":true,"disable_by_batch_size":0,"draft_sampling":"sample","method":"draft_model",)"
            R"("model":"d.gguf","num_speculative_tokens":5,"quantization":""})");
  EXPECT_EQ(parse_speculative_config_json(R"({"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int4"})", "x")
                .quantization,
            "int4");
  // The served model's own weights would draft exactly what they verify: a quantization is needed.
  EXPECT_NE(message(R"({"method": "draft_model", "num_speculative_tokens": 4})").find("needs a model"), std::string::npos);
  EXPECT_NE(message(R"({"method": "draft_model", "num_speculative_tokens": 4, "quantization": null})").find("needs a model"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "ngram", "num_speculative_tokens": 4, "model": "d"})")
                .find("--speculative-config: model and quantization name a draft model: they need method 'draft_model' or 'self'"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "draft_model", "num_speculative_tokens": 4, "model": "d", "draft_policy": "snapkv"})")
                .find("draft_policy 'snapkv' needs method 'self'"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "draft_model", "num_speculative_tokens": 0, "model": "d"})")
                .find("num_speculative_tokens must be in [1, 64], got 0"),
            std::string::npos);
  EXPECT_NE(message(R"({"method": "draft_model", "num_speculative_tokens": 4, "quantization": ["int8"]})")
                .find("quantization must be int8, int4 or a ggml type, got [\"int8\"]"),
            std::string::npos);
}

TEST(DraftView, KeepsTheFirstAndLastBlocksOfLongRows) {
  // Block size 4; row 0 holds 21 slots (6 blocks, the last with 1), row 1 holds 7 (2 blocks).
  const torch::Tensor table = torch::tensor({10, 11, 12, 13, 14, 15, 20, 21, 0, 0, 0, 0}, torch::kInt32).view({2, 6});
  const torch::Tensor lengths = torch::tensor({21, 7}, torch::kInt32);
  auto [t, l] = draft_view_tables(table, lengths, 4, DraftView{1, 2});
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(torch::equal(t[0], torch::tensor({10, 14, 15}, torch::kInt32)));
  EXPECT_EQ(l[0].item<int>(), 4 + 4 + 1);  // the sink block, one full window block, the open one
  EXPECT_TRUE(torch::equal(t[1].narrow(0, 0, 2), torch::tensor({20, 21}, torch::kInt32)));
  EXPECT_EQ(l[1].item<int>(), 7);  // fits in the view: whole
  // No sinks: the window alone.
  auto [t0, l0] = draft_view_tables(table, lengths, 4, DraftView{0, 2});
  EXPECT_TRUE(torch::equal(t0[0].narrow(0, 0, 2), torch::tensor({14, 15}, torch::kInt32)));
  EXPECT_EQ(l0[0].item<int>(), 5);
  EXPECT_THROW(draft_view_tables(table, lengths, 4, DraftView{1, 0}), std::exception);
  EXPECT_THROW(draft_view_tables(table, torch::tensor({25, 7}, torch::kInt32), 4, DraftView{1, 2}), std::exception);
}

TEST(DraftView, AddsTheChosenBlocksBetweenSinksAndWindow) {
  const torch::Tensor table = torch::tensor({10, 11, 12, 13, 14, 15, 20, 21, 0, 0, 0, 0}, torch::kInt32).view({2, 6});
  const torch::Tensor lengths = torch::tensor({21, 7}, torch::kInt32);
  // Block 0 is a sink already, 4 and 5 are the window's: only 2 joins; row 1 fits whole.
  const std::vector<int32_t> chosen{0, 2, 4, 5};
  const std::vector<const std::vector<int32_t>*> rows{&chosen, &chosen};
  auto [t, l] = draft_view_tables(table, lengths, 4, DraftView{1, 2}, rows);
  ASSERT_EQ(t.sizes(), (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(torch::equal(t[0], torch::tensor({10, 12, 14, 15}, torch::kInt32)));
  EXPECT_EQ(l[0].item<int>(), 3 * 4 + 1);
  EXPECT_TRUE(torch::equal(t[1].narrow(0, 0, 2), torch::tensor({20, 21}, torch::kInt32)));
  EXPECT_EQ(l[1].item<int>(), 7);
  // No choice for a row: sinks and window.
  const std::vector<const std::vector<int32_t>*> none{nullptr, nullptr};
  EXPECT_TRUE(torch::equal(draft_view_tables(table, lengths, 4, DraftView{1, 2}, none).first[0].narrow(0, 0, 3),
                           torch::tensor({10, 14, 15}, torch::kInt32)));
  const std::vector<int32_t> unsorted{3, 2};
  const std::vector<const std::vector<int32_t>*> bad{&unsorted, nullptr};
  EXPECT_THROW(draft_view_tables(table, lengths, 4, DraftView{1, 2}, bad), std::exception);
  EXPECT_THROW(draft_view_tables(table, lengths, 4, DraftView{1, 2}, std::span(bad).first(1)), std::exception);
}

TEST(DraftView, BlocksOfKeptRankByKeptPositions) {
  // Block size 4. Per block (both heads): 0 -> 3 (skipped: a sink), 2 -> 4, 3 -> 2, 5 -> 3.
  const torch::Tensor kept = torch::tensor({0, 1, 9, 10, 11, 20, 2, 9, 12, 13, 21, 22}, torch::kInt64).view({2, 6});
  EXPECT_EQ(blocks_of_kept(kept, {}, 4, 1), (std::vector<int32_t>{2, 5}));  // the best ceil(6 / 4) = 2
  EXPECT_EQ(blocks_of_kept(kept, {}, 4, 0), (std::vector<int32_t>{2, 5}));  // block 0 ties with 5: the later wins
  EXPECT_EQ(blocks_of_kept(kept.narrow(1, 0, 3), {}, 4, 0), (std::vector<int32_t>{0}));  // 0 -> 3, 2 -> 2, 3 -> 1
  // Counts per head (head 0 keeps 3): blocks 0, 2, 3 and 5 hold two each; ties go to later blocks.
  const std::vector<int64_t> counts{3, 6};
  EXPECT_EQ(blocks_of_kept(kept, counts, 4, 1), (std::vector<int32_t>{3, 5}));
  EXPECT_THROW(blocks_of_kept(kept, std::vector<int64_t>{3}, 4, 1), std::exception);
}

constexpr int64_t kKV = 2, kD = 8, kBS = 4, kH = 4, kLayers = 2;

KvPoolOptions pool_options(bool head_blocks, torch::Device device = torch::kCPU) {
  KvPoolOptions o;
  o.num_kv_heads = kKV;
  o.head_dim = kD;
  o.block_size = kBS;
  o.num_blocks = 64;
  o.head_blocks = head_blocks;
  o.device = device;
  return o;
}

PagedKvCache fresh_cache(bool head_blocks, torch::Device device = torch::kCPU) {
  return PagedKvCache(kLayers, pool_options(head_blocks, device));
}
// Makes the cache hold sequence 7's prompt (k, v [KV, n, D]) in every layer.
void hold_prompt(PagedKvCache& c, const torch::Tensor& k, const torch::Tensor& v) {
  c.add_sequence(7);
  const int64_t n = k.size(1);
  const auto pos = torch::arange(n, torch::kLong).view({1, n}).expand({kKV, n}).contiguous();
  for (int64_t l = 0; l < kLayers; ++l) c.write(7, l, k, v, pos);
}

class VerifyStep : public ::testing::TestWithParam<bool> {};

TEST_P(VerifyStep, RowsOfOneSequenceAttendCausallyAndRejectedRowsGoBack) {
  torch::manual_seed(3);
  const torch::Tensor pk = torch::randn({kKV, 6, kD}), pv = torch::randn({kKV, 6, kD});
  const int64_t T = 5;  // the last token and four drafts: rows cross a block boundary (6 + 5 > 8)
  const torch::Tensor q = torch::randn({T, kH, kD}), k = torch::randn({T, kKV, kD}), v = torch::randn({T, kKV, kD});

  // One token per step.
  PagedKvCache plain = fresh_cache(GetParam());
  hold_prompt(plain, pk, pv);
  std::vector<torch::Tensor> one(static_cast<size_t>(kLayers * T));
  int64_t used_after_two = 0;
  for (int64_t t = 0; t < T; ++t) {
    plain.begin_decode({7}, {6 + t});
    for (int64_t l = 0; l < kLayers; ++l)
      one[static_cast<size_t>(l * T + t)] = plain.decode_layer(l, q.narrow(0, t, 1), k.narrow(0, t, 1), v.narrow(0, t, 1));
    if (t == 1) used_after_two = plain.used_blocks();
  }

  // All five in one step.
  PagedKvCache spec = fresh_cache(GetParam());
  hold_prompt(spec, pk, pv);
  spec.begin_decode({7, 7, 7, 7, 7}, {6, 7, 8, 9, 10});
  for (int64_t l = 0; l < kLayers; ++l) {
    const torch::Tensor out = spec.decode_layer(l, q, k, v);
    for (int64_t t = 0; t < T; ++t)
      EXPECT_TRUE(torch::allclose(out[t], one[static_cast<size_t>(l * T + t)].squeeze(0), 1e-6, 1e-6))
          << "layer " << l << " row " << t;
  }
  EXPECT_EQ(spec.used_blocks(), plain.used_blocks());
  spec.check_invariants();

  // Three rejected: the sequence is as after two plain steps, and its emptied block is free again.
  spec.truncate_last(7, 3);
  spec.check_invariants();
  EXPECT_EQ(spec.length(7, 0), 8);
  EXPECT_EQ(spec.used_blocks(), used_after_two);
  EXPECT_EQ(spec.positions(7, 1)[0][7].item<int64_t>(), 7);
  // The next step continues at position 8, as plain decoding's third token did.
  spec.begin_decode({7}, {8});
  for (int64_t l = 0; l < kLayers; ++l)
    EXPECT_TRUE(torch::allclose(spec.decode_layer(l, q.narrow(0, 2, 1), k.narrow(0, 2, 1), v.narrow(0, 2, 1)).squeeze(0),
                                one[static_cast<size_t>(l * T + 2)].squeeze(0), 1e-6, 1e-6));
  EXPECT_THROW(spec.truncate_last(7, 100), std::exception);
  spec.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Layouts, VerifyStep, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("head_blocks") : std::string("per_layer"); });

class DraftStep : public ::testing::TestWithParam<bool> {};
// The same steps on a CUDA pool: the device kernels read the view's tables (skipped without a GPU).
class DraftStepCuda : public ::testing::TestWithParam<bool> {};

// A draft step through the view {1 sink block, 2 window blocks} of a 22-token sequence attends to
// slots 0..3 and 16..22 (its own new token included), exactly as softmax attention over those rows;
// truncating it leaves the cache as before.
void attends_to_the_sinks_and_the_window_only(bool head_blocks, torch::Device dev) {
  torch::manual_seed(5);
  constexpr int64_t n = 22;
  const torch::Tensor pk = torch::randn({kKV, n, kD}), pv = torch::randn({kKV, n, kD});
  PagedKvCache c = fresh_cache(head_blocks, dev);
  hold_prompt(c, pk, pv);
  const int64_t used = c.used_blocks();
  const torch::Tensor q = torch::randn({1, kH, kD}), k = torch::randn({1, kKV, kD}), v = torch::randn({1, kKV, kD});
  c.begin_decode({7}, {n}, 0, DraftView{1, 2});
  std::vector<int64_t> seen;
  for (int64_t i = 0; i < 4; ++i) seen.push_back(i);
  for (int64_t i = 16; i <= n; ++i) seen.push_back(i);
  const torch::Tensor idx = torch::tensor(seen);
  const torch::Tensor K = torch::cat({pk, k.transpose(0, 1)}, 1).index_select(1, idx).to(torch::kFloat64);
  const torch::Tensor V = torch::cat({pv, v.transpose(0, 1)}, 1).index_select(1, idx).to(torch::kFloat64);
  const int64_t G = kH / kKV;
  for (int64_t l = 0; l < kLayers; ++l) {
    const torch::Tensor out = c.decode_layer(l, q.to(dev), k.to(dev), v.to(dev)).cpu();
    for (int64_t h = 0; h < kH; ++h) {
      const torch::Tensor qh = q[0][h].to(torch::kFloat64);
      const torch::Tensor p = torch::softmax(K[h / G].matmul(qh) / std::sqrt(double(kD)), 0);
      const torch::Tensor want = p.matmul(V[h / G]);
      EXPECT_TRUE(torch::allclose(out[0][h].to(torch::kFloat64), want, 1e-5, 1e-5)) << "layer " << l << " head " << h;
    }
  }
  EXPECT_EQ(c.length(7, 1), n + 1);
  c.truncate_last(7, 1);
  c.check_invariants();
  EXPECT_EQ(c.length(7, 0), n);
  EXPECT_EQ(c.used_blocks(), used);
  // A step without the view reads everything again.
  c.begin_decode({7}, {n});
  EXPECT_FALSE(c.decode_planned({7}, 0, DraftView{1, 2}));
  EXPECT_TRUE(c.decode_planned({7}, 0));
}

// The same step with layer 0's draft blocks {2} (slots 8..11): layer 0 attends to them too, layer 1
// (none set) to sinks and window; a step without the view still reads everything.
void attends_to_the_chosen_blocks_too(bool head_blocks, torch::Device dev) {
  torch::manual_seed(6);
  constexpr int64_t n = 22;
  const torch::Tensor pk = torch::randn({kKV, n, kD}), pv = torch::randn({kKV, n, kD});
  PagedKvCache c = fresh_cache(head_blocks, dev);
  hold_prompt(c, pk, pv);
  for (int64_t lane = 0; lane < c.lanes(); ++lane) c.set_draft_blocks(7, 0, lane, {2});
  EXPECT_EQ(c.draft_blocks(7, 1, 0), nullptr);
  const torch::Tensor q = torch::randn({1, kH, kD}), k = torch::randn({1, kKV, kD}), v = torch::randn({1, kKV, kD});
  c.begin_decode({7}, {n}, 0, DraftView{1, 2});
  const int64_t G = kH / kKV;
  for (int64_t l = 0; l < kLayers; ++l) {
    std::vector<int64_t> seen;
    for (int64_t i = 0; i < 4; ++i) seen.push_back(i);
    if (l == 0)
      for (int64_t i = 8; i < 12; ++i) seen.push_back(i);
    for (int64_t i = 16; i <= n; ++i) seen.push_back(i);
    const torch::Tensor idx = torch::tensor(seen);
    const torch::Tensor K = torch::cat({pk, k.transpose(0, 1)}, 1).index_select(1, idx).to(torch::kFloat64);
    const torch::Tensor V = torch::cat({pv, v.transpose(0, 1)}, 1).index_select(1, idx).to(torch::kFloat64);
    const torch::Tensor out = c.decode_layer(l, q.to(dev), k.to(dev), v.to(dev)).cpu();
    for (int64_t h = 0; h < kH; ++h) {
      const torch::Tensor p = torch::softmax(K[h / G].matmul(q[0][h].to(torch::kFloat64)) / std::sqrt(double(kD)), 0);
      EXPECT_TRUE(torch::allclose(out[0][h].to(torch::kFloat64), p.matmul(V[h / G]), 1e-5, 1e-5)) << "layer " << l << " head " << h;
    }
  }
  c.truncate_last(7, 1);
  c.release(7);
  EXPECT_EQ(c.draft_blocks(7, 0, 0), nullptr);
}

TEST_P(DraftStep, AttendsToTheSinksAndTheWindowOnly) { attends_to_the_sinks_and_the_window_only(GetParam(), torch::kCPU); }
TEST_P(DraftStep, AttendsToTheChosenBlocksToo) { attends_to_the_chosen_blocks_too(GetParam(), torch::kCPU); }
TEST_P(DraftStepCuda, AttendsToTheSinksAndTheWindowOnly) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  attends_to_the_sinks_and_the_window_only(GetParam(), torch::kCUDA);
}
TEST_P(DraftStepCuda, AttendsToTheChosenBlocksToo) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  attends_to_the_chosen_blocks_too(GetParam(), torch::kCUDA);
}

INSTANTIATE_TEST_SUITE_P(Layouts, DraftStep, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("head_blocks") : std::string("per_layer"); });
INSTANTIATE_TEST_SUITE_P(Layouts, DraftStepCuda, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? std::string("head_blocks") : std::string("per_layer"); });

TEST(VerifyStepBatch, RowsMustBeConsecutive) {
  torch::manual_seed(1);
  PagedKvCache c = fresh_cache(false);
  hold_prompt(c, torch::randn({kKV, 6, kD}), torch::randn({kKV, 6, kD}));
  c.add_sequence(8);
  EXPECT_THROW(c.begin_decode({7, 8, 7}, {6, 0, 7}), std::exception);  // 7 comes back after 8
  EXPECT_THROW(c.begin_decode({7, 7}, {6, 8}), std::exception);        // positions skip one
  EXPECT_THROW(c.begin_decode({7, 7}, {6, 7}, 4), std::exception);     // a verify step is never padded
  c.check_invariants();
  EXPECT_EQ(c.length(7, 0), 6);
}

}  // namespace
}  // namespace kvserve

namespace kvserve {
namespace {

// Steps of `batch` sequences: plain ones emit `batch` tokens in `plain_s`, speculative ones
// `spec_tokens` in `spec_s`; returns how many of `steps` the governor let speculate.
int64_t run_governor(SpeculationGovernor& g, int64_t steps, int64_t batch, double plain_s, int64_t spec_tokens,
                     double spec_s) {
  int64_t speculated = 0;
  for (int64_t i = 0; i < steps; ++i) {
    const bool spec = g.allow(batch);
    speculated += spec;
    g.record(batch, spec ? spec_tokens : batch, spec ? spec_s : plain_s, spec);
  }
  return speculated;
}

TEST(SpeculationGovernor, KeepsSpeculatingWhileItPays) {
  SpeculationGovernor g;
  // Three plain steps first (as a sequence's first steps before it drafts), then drafts that give
  // 3 tokens in 1.5 plain steps' time: 2x.
  for (int i = 0; i < 3; ++i) g.record(1, 1, 0.01, false);
  const int64_t spec = run_governor(g, 320, 1, 0.01, 3, 0.015);
  EXPECT_EQ(g.pauses(), 0);
  // One plain probe every 32 steps keeps the plain rate current; everything else speculates.
  EXPECT_EQ(spec, 320 - 9);
  EXPECT_NEAR(g.speculative_rate(1) / g.plain_rate(1), 2.0, 1e-9);
}

TEST(SpeculationGovernor, PausesWhileItLosesAndBacksOff) {
  SpeculationGovernor g;
  for (int i = 0; i < 3; ++i) g.record(1, 1, 0.01, false);
  // 1.2 tokens per step at twice a plain step's time: 0.6x.
  EXPECT_EQ(run_governor(g, 3, 1, 0.01, 12, 0.2), 3);  // three samples, then the verdict
  EXPECT_TRUE(g.paused());
  EXPECT_EQ(g.pauses(), 1);
  EXPECT_EQ(run_governor(g, 64, 1, 0.01, 12, 0.2), 0);  // the first pause: 64 plain steps
  EXPECT_EQ(run_governor(g, 3, 1, 0.01, 12, 0.2), 3);   // a probe of three steps
  EXPECT_EQ(g.pauses(), 2);
  EXPECT_EQ(run_governor(g, 128, 1, 0.01, 12, 0.2), 0);  // twice as long
  EXPECT_EQ(run_governor(g, 3, 1, 0.01, 12, 0.2), 3);
  EXPECT_EQ(run_governor(g, 256, 1, 0.01, 12, 0.2), 0);
  // Over a long run it speculates in a few probes only.
  EXPECT_LT(run_governor(g, 4000, 1, 0.01, 12, 0.2), 20);
  EXPECT_LT(run_governor(g, 1024, 1, 0.01, 12, 0.2), 4);  // the pause stops doubling at 1024
}

TEST(SpeculationGovernor, ALossBeyondDoubtEndsAProbeAtItsFirstStep) {
  SpeculationGovernor g;
  for (int i = 0; i < 3; ++i) g.record(1, 1, 0.01, false);
  // One token in four plain steps' time (a self-draft whose first token is rejected): 0.25x.
  EXPECT_EQ(run_governor(g, 1, 1, 0.01, 1, 0.04), 1);
  EXPECT_TRUE(g.paused());
  EXPECT_EQ(g.pauses(), 1);
  EXPECT_EQ(run_governor(g, 64, 1, 0.01, 1, 0.04), 0);
  EXPECT_EQ(run_governor(g, 1, 1, 0.01, 1, 0.04), 1);  // the next probe: one step again
  EXPECT_EQ(g.pauses(), 2);
  EXPECT_EQ(run_governor(g, 128, 1, 0.01, 1, 0.04), 0);
}

TEST(SpeculationGovernor, OneSlowStepDoesNotPauseSpeculationThatPays) {
  SpeculationGovernor g;
  for (int i = 0; i < 3; ++i) g.record(1, 1, 0.01, false);
  EXPECT_EQ(run_governor(g, 10, 1, 0.01, 3, 0.015), 10);  // 2x
  // A disturbed step at 0.1x after the probe: the weighted rate still pays.
  ASSERT_TRUE(g.allow(1));
  g.record(1, 1, 0.1, true);
  EXPECT_EQ(g.pauses(), 0);
  EXPECT_EQ(run_governor(g, 10, 1, 0.01, 3, 0.015), 10);
  EXPECT_EQ(g.pauses(), 0);
}

TEST(SpeculationGovernor, JudgesEachBatchSizeOnItsOwnSteps) {
  SpeculationGovernor g;
  // Plain steps of 8 sequences emit 8 tokens in 0.02 s (400 tokens/s); a speculative step of one
  // sequence 3 tokens in 0.015 s (200/s) is not slower than a plain step of one (100/s).
  for (int i = 0; i < 3; ++i) g.record(8, 8, 0.02, false);
  for (int i = 0; i < 3; ++i) g.record(1, 1, 0.01, false);
  EXPECT_EQ(run_governor(g, 16, 1, 0.01, 3, 0.015), 16);
  EXPECT_EQ(g.pauses(), 0);
  // A batch size's first steps are plain: the rate to beat.
  EXPECT_EQ(run_governor(g, 3, 2, 0.01, 6, 0.015), 0);
  EXPECT_EQ(run_governor(g, 3, 2, 0.01, 6, 0.015), 3);
  // Untimed steps change nothing.
  for (int i = 0; i < 10; ++i) g.record(8, 1, 0.0, true);
  EXPECT_EQ(g.pauses(), 0);
}

TEST(SpeculationGovernor, AnUntimedRuntimeSpeculatesAlways) {
  // A runtime that reports no decode time: after its first step (plain, as any fresh governor's)
  // nothing is ever judged, nothing is held plain.
  SpeculationGovernor g;
  int64_t allowed = 0;
  for (int i = 0; i < 200; ++i) {
    const bool spec = g.allow(4);
    allowed += spec;
    g.record(4, spec ? 8 : 4, 0.0, spec);
  }
  EXPECT_EQ(allowed, 199);
  EXPECT_EQ(g.pauses(), 0);
}

}  // namespace
}  // namespace kvserve
