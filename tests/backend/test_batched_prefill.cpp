// DecoderModel::prefill_batch (several prompts in one forward) against prompts prefilled alone: logits
// and stored K/V on the random fixtures (GQA, MHA, one KV head, Qwen2 biases, Qwen3 q/k norms, llama3,
// yarn, dynamic NTK and longrope RoPE), the
// positions every KV policy keeps, and LocalRunner's one-by-one fallback when a batch fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "backend/model/decoder_model.h"
#include "backend/engine/model_runner.h"
#include "cache_manager/paged_kv_memory.h"
#include "tests/support/fixture_models.h"

namespace kvserve {
namespace {

using Specs = std::map<std::string, std::map<std::string, std::string>>;

// Mixed lengths: one token (the small-batch GEMM path when alone), a block and a bit, and two
// prompts that together cross the MLP's 512-row chunks at different offsets than alone.
const std::vector<int64_t> kLens = {1, 17, 300, 700};

using test::fixture;
using test::make_prompt;

std::vector<std::vector<int64_t>> make_prompts(const std::vector<int64_t>& lens, int64_t vocab) {
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < lens.size(); ++i) out.push_back(make_prompt(lens[i], static_cast<int64_t>(i) + 1, vocab));
  return out;
}

std::vector<PrefillInput> inputs(const std::vector<std::vector<int64_t>>& prompts, const std::string& policy = "") {
  std::vector<PrefillInput> in;
  for (size_t i = 0; i < prompts.size(); ++i) in.push_back({static_cast<int64_t>(i), prompts[i], policy});
  return in;
}

std::unique_ptr<PagedKvMemory> make_memory(const DecoderModel& m, int64_t blocks, const Specs& specs = {}) {
  const auto& c = m.config();
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.num_blocks = blocks;
  auto kv = std::make_unique<PagedKvMemory>(c.num_hidden_layers, pool, resolve_policies(specs));
  if (c.has_local_layers()) kv->set_layer_windows(m.kv_layout().layer_windows);
  return kv;
}

// Enough blocks for every prompt at full KV in every layer.
int64_t full_blocks(const DecoderModel& m, const std::vector<int64_t>& lens) {
  int64_t n = 0;
  for (int64_t T : lens) n += (T + 15) / 16 + 1;
  return n * m.config().num_hidden_layers;
}

float max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<float>(); }

// One step that starts and prefills every prompt whole, sampling each, as sequences 10, 11, ...
StepPlan prefill_plan(const std::vector<std::vector<int64_t>>& prompts, const SamplingParams& sampling) {
  StepPlan plan;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t id = static_cast<int64_t>(i) + 10;
    plan.start.push_back({id, sampling, prompts[i], 0, {}});
    plan.prefill.push_back({id, prompts[i], "", true, false});
  }
  return plan;
}

class BatchedPrefill : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchedPrefill, LogitsAndKvMatchPromptsAlone) {
  const std::string dir = fixture(GetParam());
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/" << GetParam();
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto prompts = make_prompts(kLens, model->config().vocab_size);
  const int64_t blocks = full_blocks(*model, kLens);
  auto alone = make_memory(*model, blocks), batched = make_memory(*model, blocks), last_only = make_memory(*model, blocks);

  std::vector<torch::Tensor> want;
  for (size_t i = 0; i < prompts.size(); ++i) want.push_back(model->prefill(static_cast<int64_t>(i), prompts[i], *alone, true));
  const torch::Tensor all = model->prefill_batch(inputs(prompts), *batched, /*all_logits=*/true);
  const torch::Tensor last = model->prefill_batch(inputs(prompts), *last_only);
  ASSERT_EQ(all.size(0), 1 + 17 + 300 + 700);
  ASSERT_EQ(last.size(0), static_cast<int64_t>(prompts.size()));

  float logit_diff = 0, last_diff = 0, kv_diff = 0;
  std::vector<float> per_prompt;
  int64_t row = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t T = kLens[i], id = static_cast<int64_t>(i);
    logit_diff = std::max(logit_diff, max_diff(all.narrow(0, row, T), want[i]));
    last_diff = std::max(last_diff, max_diff(last[id], want[i][T - 1]));
    // The LM head runs on n rows here and on sum T rows there (different GEMM kernels).
    EXPECT_LE(max_diff(last[id], all[row + T - 1]), 1e-5) << "prompt " << i;
    per_prompt.push_back(max_diff(all.narrow(0, row, T), want[i]));
    row += T;
    for (int64_t l = 0; l < model->config().num_hidden_layers; ++l) {
      // A sliding-window layer keeps only its window's blocks, batched as alone.
      ASSERT_EQ(batched->cached_tokens(id, l), model->config().layer_window(l) > 0 ? alone->cached_tokens(id, l) : T);
      auto [ka, va] = alone->cache().gather(id, l);
      auto [kb, vb] = batched->cache().gather(id, l);
      kv_diff = std::max({kv_diff, max_diff(ka, kb), max_diff(va, vb)});
    }
  }
  std::cout << "[ " << GetParam() << " ] max |batched - alone|: logits " << logit_diff << ", last-position logits "
            << last_diff << ", K/V " << kv_diff << "; logits per prompt";
  for (float d : per_prompt) std::cout << " " << d;
  std::cout << "\n";
  EXPECT_LE(logit_diff, 1e-4);
  EXPECT_LE(last_diff, 1e-4);
  EXPECT_LE(kv_diff, 1e-4);
  EXPECT_EQ(batched->blocks_used(), alone->blocks_used());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, BatchedPrefill,
                         test::fixture_models(), test::fixture_param_name);
// 1 and 17 tokens stay within their original context of 64, 300 and 700 pass it: in one batch each
// prompt's rows still take the frequencies of its own length.
INSTANTIATE_TEST_SUITE_P(LengthDependentRope, BatchedPrefill,
                         test::length_dependent_rope_models(), test::fixture_param_name);

// Budgets small enough that the 300- and 700-token prompts compress and the short ones do not.
const Specs& policy_specs() {
  static const Specs s = {
      {"snap", {{"name", "snapkv"}, {"budget", "64"}, {"window", "8"}, {"kernel", "5"}}},
      {"pyr", {{"name", "pyramidkv"}, {"budget", "64"}, {"window", "8"}, {"beta", "4"}}},
      {"pyr_kvp", {{"name", "pyramidkv"}, {"budget", "0.3"}, {"window", "8"}, {"semantics", "kvpress"}}},
      {"dyn", {{"name", "dynamickv"}, {"budget", "48"}, {"window", "8"}, {"r_max", "3"}, {"m", "2"}}},
      {"stream", {{"name", "streamingllm"}, {"budget", "64"}, {"sink", "4"}}},
      {"h2o", {{"name", "h2o"}, {"budget", "64"}, {"window", "8"}}},
      {"knorm", {{"name", "knorm"}, {"budget", "0.5"}}},  // skips layers 0 and 1: compresses llama-kvfew's layer 2
      {"knorm_kvp", {{"name", "knorm"}, {"budget", "0.5"}, {"semantics", "kvpress"}}},
      {"rand", {{"name", "random"}, {"budget", "40"}}},
      {"knorm_dec", {{"name", "knorm"}, {"budget", "0.5"}, {"decode_budget", "80"}, {"decode_evict_chunk", "8"}}},
  };
  return s;
}

class BatchedPrefillPolicy : public ::testing::TestWithParam<std::string> {};

TEST_P(BatchedPrefillPolicy, KeepsThePositionsOfPromptsAlone) {
  const std::string& policy = GetParam();
  int64_t compressed = 0;  // (prompt, layer) pairs the policy compressed, over both fixtures
  for (const std::string name : {"llama-gqa", "llama-kvfew"}) {
    const std::string dir = fixture(name);
    if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/" << name;
    auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
    const auto prompts = make_prompts(kLens, model->config().vocab_size);
    const int64_t blocks = 2 * full_blocks(*model, kLens);
    auto alone = make_memory(*model, blocks, policy_specs()), batched = make_memory(*model, blocks, policy_specs());
    std::vector<torch::Tensor> want;
    for (size_t i = 0; i < prompts.size(); ++i) want.push_back(model->prefill(static_cast<int64_t>(i), prompts[i], *alone, false, policy));
    const torch::Tensor got = model->prefill_batch(inputs(prompts, policy), *batched);
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int64_t id = static_cast<int64_t>(i);
      EXPECT_LE(max_diff(got[id], want[i][0]), 1e-4) << name << " prompt " << i;
      EXPECT_EQ(batched->prefill_budgets(id), alone->prefill_budgets(id)) << name << " prompt " << i;
      EXPECT_EQ(batched->kept_tokens(id), alone->kept_tokens(id)) << name << " prompt " << i;
      for (int64_t l = 0; l < model->config().num_hidden_layers; ++l) {
        EXPECT_TRUE(torch::equal(batched->kept_positions(id, l), alone->kept_positions(id, l)))
            << name << " prompt " << i << " layer " << l;
        compressed += alone->cached_tokens(id, l) < kLens[i];
      }
    }
    EXPECT_EQ(batched->blocks_used(), alone->blocks_used()) << name;
  }
  if (policy != "full") {
    EXPECT_GT(compressed, 0) << "the policy compressed nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, BatchedPrefillPolicy,
                         ::testing::Values("full", "snap", "pyr", "pyr_kvp", "dyn", "stream", "h2o", "knorm", "knorm_kvp",
                                           "rand", "knorm_dec"));

TEST(BatchedPrefillFailure, FailedBatchLeavesNoKv) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto prompts = make_prompts({17, 300, 40}, model->config().vocab_size);
  // 2 layers: 17 tokens take 4 blocks, 40 take 6, 300 take 38; 20 blocks hold all but the 300.
  auto kv = make_memory(*model, 20);
  try {
    model->prefill_batch(inputs(prompts), *kv);
    FAIL() << "the batch fit a pool too small for it";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos) << e.what();
  }
  EXPECT_EQ(kv->blocks_used(), 0);
  for (int64_t id = 0; id < 3; ++id) EXPECT_EQ(kv->blocks_held(id), 0);
  // A failed prefill of one prompt leaves nothing either, and the sequence can start over.
  EXPECT_THROW(model->prefill(1, prompts[1], *kv), std::exception);
  EXPECT_EQ(kv->blocks_used(), 0);
  model->prefill(1, prompts[0], *kv);
  EXPECT_EQ(kv->blocks_used(), 4);
}

TEST(BatchedPrefillFailure, RunnerFallsBackToOneByOne) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const std::vector<int64_t> lens = {17, 300, 40};
  const auto prompts = make_prompts(lens, model->config().vocab_size);
  LocalRunner runner(model, make_memory(*model, 20));

  SamplingParams greedy;
  greedy.temperature = 0;
  greedy.logprobs = 5;
  const StepPlan plan = prefill_plan(prompts, greedy);
  const StepResult r = runner.execute(plan);
  ASSERT_EQ(r.prefilled.size(), 3u);
  EXPECT_NE(r.prefilled[1].error.find("KV pool exhausted"), std::string::npos) << r.prefilled[1].error;
  ASSERT_EQ(r.shards.size(), 1u);
  EXPECT_EQ(r.shards[0].blocks_used, 4 + 6);
  EXPECT_EQ(r.shards[0].held, (std::vector<int64_t>{4, 0, 6}));
  for (size_t i : {0u, 2u}) {
    const PrefillOutcome& o = r.prefilled[i];
    ASSERT_TRUE(o.error.empty()) << "prompt " << i << ": " << o.error;
    ASSERT_TRUE(o.first.has_value());
    EXPECT_EQ(o.kept_tokens, lens[i] * model->config().num_hidden_layers);
    // The first token and its logprobs are those of the prompt prefilled alone.
    auto kv = make_memory(*model, 20);
    const torch::Tensor logprobs = torch::log_softmax(model->prefill(0, prompts[i], *kv)[0], -1);
    EXPECT_EQ(o.first->token, logprobs.argmax().item<int64_t>()) << "prompt " << i;
    EXPECT_NEAR(o.first->chosen.logprob, logprobs.max().item<float>(), 1e-5) << "prompt " << i;
  }

  // The next plan releases everything (the engine finishes the failed one too): nothing leaks.
  StepPlan done;
  for (const auto& p : plan.prefill) {
    done.release.push_back(p.seq_id);
    done.remove.push_back(p.seq_id);
  }
  EXPECT_EQ(runner.execute(done).shards.at(0).blocks_used, 0);
}

TEST(BatchedPrefillFailure, RunnerBatchesWhatFits) {
  const std::string dir = fixture("qwen2-bias");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/qwen2-bias";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto prompts = make_prompts(kLens, model->config().vocab_size);
  LocalRunner runner(model, make_memory(*model, full_blocks(*model, kLens)));
  StepPlan plan;
  SamplingParams greedy;
  greedy.temperature = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    plan.start.push_back({static_cast<int64_t>(i), greedy, prompts[i], 0, {}});
    plan.prefill.push_back({static_cast<int64_t>(i), prompts[i], "", i != 2, false});
  }
  const StepResult r = runner.execute(plan);
  ASSERT_EQ(r.prefilled.size(), prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const PrefillOutcome& o = r.prefilled[i];
    ASSERT_TRUE(o.error.empty()) << o.error;
    EXPECT_EQ(o.first.has_value(), i != 2);
    EXPECT_EQ(o.kept_tokens, kLens[i] * model->config().num_hidden_layers);
    if (!o.first) continue;
    auto kv = make_memory(*model, full_blocks(*model, kLens));
    EXPECT_EQ(o.first->token, model->prefill(0, prompts[i], *kv)[0].argmax().item<int64_t>()) << "prompt " << i;
  }
}

TEST(BatchedPrefillFailure, BadTokenFailsOnlyItsPrompt) {
  const std::string dir = fixture("llama-mha");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-mha";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  auto prompts = make_prompts({5, 9, 30}, model->config().vocab_size);
  prompts[1][3] = model->config().vocab_size;  // out of range: the batch's embedding throws
  LocalRunner runner(model, make_memory(*model, 64));
  StepPlan plan;
  for (size_t i = 0; i < prompts.size(); ++i) {
    plan.start.push_back({static_cast<int64_t>(i), SamplingParams{}, prompts[i], 1, {}});
    plan.prefill.push_back({static_cast<int64_t>(i), prompts[i], "", true, false});
  }
  const StepResult r = runner.execute(plan);
  EXPECT_TRUE(r.prefilled.at(0).error.empty()) << r.prefilled[0].error;
  EXPECT_NE(r.prefilled.at(1).error.find("token id out of range"), std::string::npos) << r.prefilled[1].error;
  EXPECT_TRUE(r.prefilled.at(2).error.empty()) << r.prefilled[2].error;
  EXPECT_EQ(r.shards.at(0).held, (std::vector<int64_t>{2, 0, 4}));
}

// A client that leaves mid-prompt: the runner's cancel check stops its prefill between layers, the
// batch's other prompts run one by one and get the first token they get uncancelled, and the
// cancelled one holds no KV. The check sees the prefill's sequences before every layer.
TEST(BatchedPrefillFailure, CancelledPromptStopsBetweenLayers) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const std::vector<int64_t> lens = {17, 300, 40};
  const auto prompts = make_prompts(lens, model->config().vocab_size);
  LocalRunner runner(model, make_memory(*model, full_blocks(*model, lens)));
  int64_t asked = 0, asked_for_cancelled = 0;
  runner.set_cancel_check([&](std::span<const int64_t> ids) {
    ++asked;
    const bool hit = std::find(ids.begin(), ids.end(), 11) != ids.end();
    asked_for_cancelled += hit;
    return hit && asked_for_cancelled > 1;  // sequence 11 is cancelled once its first layer ran
  });
  SamplingParams greedy;
  greedy.temperature = 0;
  const StepResult r = runner.execute(prefill_plan(prompts, greedy));
  ASSERT_EQ(r.prefilled.size(), 3u);
  EXPECT_NE(r.prefilled[1].error.find("cancelled"), std::string::npos) << r.prefilled[1].error;
  EXPECT_EQ(r.shards.at(0).held, (std::vector<int64_t>{4, 0, 6}));
  // Two layers: the batch stopped at its second, then each prompt ran alone (the cancelled one
  // stopped before its first).
  EXPECT_EQ(asked, 2 + 2 + 1 + 2);
  for (size_t i : {0u, 2u}) {
    ASSERT_TRUE(r.prefilled[i].error.empty()) << r.prefilled[i].error;
    auto kv = make_memory(*model, full_blocks(*model, lens));
    EXPECT_EQ(r.prefilled[i].first->token, model->prefill(0, prompts[i], *kv)[0].argmax().item<int64_t>()) << i;
  }
  // Without a check nothing stops.
  runner.set_cancel_check(nullptr);
  StepPlan again;
  again.start.push_back({20, greedy, prompts[1], 0, {}});
  again.prefill.push_back({20, prompts[1], "", true, false});
  EXPECT_TRUE(runner.execute(again).prefilled.at(0).error.empty());
}

}  // namespace
}  // namespace kvserve
