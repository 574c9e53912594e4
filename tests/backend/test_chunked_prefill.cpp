// Chunked prefill against whole-prompt prefill on the random fixtures: logits, stored K/V and the
// decode after it; the positions every KV policy keeps (per layer and KV head); H2O refusing chunks;
// a failed chunk leaving no KV; LocalRunner sampling only at the last chunk.
#include <gtest/gtest.h>

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

using test::fixture;
using test::make_prompt;

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

float max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<float>(); }

// Prefills `prompt` as chunks of the given sizes (the last one takes the rest); returns the last
// chunk's logits [1, V].
torch::Tensor prefill_chunks(DecoderModel& m, int64_t id, const std::vector<int64_t>& prompt, const std::vector<int64_t>& sizes,
                             KvMemory& kv, const std::string& policy = "") {
  const int64_t T = static_cast<int64_t>(prompt.size());
  torch::Tensor logits;
  int64_t start = 0;
  for (size_t i = 0; start < T; ++i) {
    const int64_t n = i < sizes.size() ? std::min(sizes[i], T - start) : T - start;
    const std::span<const int64_t> chunk(prompt.data() + start, static_cast<size_t>(n));
    logits = m.prefill_batch({PrefillInput{id, chunk, policy, start, T}}, kv);
    start += n;
  }
  return logits;
}

// Chunk boundaries inside blocks, on block edges, and a one-token last chunk.
// {150}: its 550-token second chunk takes chunk_attention's split path.
const std::vector<std::vector<int64_t>> kSplits = {{100, 250}, {128, 128, 128, 128, 128}, {699}, {150}};
constexpr int64_t kLen = 700;

class ChunkedPrefill : public ::testing::TestWithParam<std::string> {};

TEST_P(ChunkedPrefill, LogitsKvAndDecodeMatchWholePrompt) {
  const std::string dir = fixture(GetParam());
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/" << GetParam();
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto prompt = make_prompt(kLen, 3, model->config().vocab_size);
  const int64_t L = model->config().num_hidden_layers, blocks = ((kLen + 8) / 16 + 2) * L;
  auto whole = make_memory(*model, blocks);
  const torch::Tensor want = model->prefill(1, prompt, *whole);
  float logit_diff = 0, kv_diff = 0, decode_diff = 0;
  for (const auto& split : kSplits) {
    auto kv = make_memory(*model, blocks);
    const torch::Tensor got = prefill_chunks(*model, 1, prompt, split, *kv);
    logit_diff = std::max(logit_diff, max_diff(got, want));
    EXPECT_EQ(got.argmax(-1).item<int64_t>(), want.argmax(-1).item<int64_t>());
    for (int64_t l = 0; l < L; ++l) {
      // A sliding-window layer keeps only its window's blocks, chunked as whole.
      ASSERT_EQ(kv->cached_tokens(1, l), model->config().layer_window(l) > 0 ? whole->cached_tokens(1, l) : kLen);
      if (model->config().layer_window(l) > 0) {
        ASSERT_LT(kv->cached_tokens(1, l) - model->config().layer_window(l), 16);
      }
      EXPECT_TRUE(torch::equal(kv->kept_positions(1, l), whole->kept_positions(1, l)));
      auto [ka, va] = whole->cache().gather(1, l);
      auto [kb, vb] = kv->cache().gather(1, l);
      kv_diff = std::max({kv_diff, max_diff(ka, kb), max_diff(va, vb)});
    }
    EXPECT_EQ(kv->blocks_used(), whole->blocks_used());
    // Decoding on top of the chunked KV gives the whole prompt's next logits.
    auto ref = make_memory(*model, blocks);
    model->prefill(1, prompt, *ref);
    for (int64_t step = 0; step < 3; ++step) {
      DecodeBatch b{{1}, {kLen + step}};
      const std::vector<int64_t> tok{prompt[static_cast<size_t>(step)]};
      decode_diff = std::max(decode_diff, max_diff(model->decode(b, tok, *kv), model->decode(b, tok, *ref)));
    }
  }
  std::cout << "[ " << GetParam() << " ] max |chunked - whole|: last logits " << logit_diff << ", K/V " << kv_diff
            << ", decode logits " << decode_diff << "\n";
  EXPECT_LE(logit_diff, 1e-4);
  EXPECT_LE(kv_diff, 1e-4);
  EXPECT_LE(decode_diff, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ChunkedPrefill,
                         test::fixture_models(), test::fixture_param_name);

// Budgets small enough that the 700-token prompt compresses in every policy.
const Specs& policy_specs() {
  static const Specs s = {
      {"snap", {{"name", "snapkv"}, {"budget", "64"}, {"window", "8"}, {"kernel", "5"}}},
      {"snap_w", {{"name", "snapkv"}, {"budget", "200"}, {"window", "150"}, {"kernel", "5"}}},  // window > a chunk
      {"pyr", {{"name", "pyramidkv"}, {"budget", "64"}, {"window", "8"}, {"beta", "4"}}},
      {"pyr_kvp", {{"name", "pyramidkv"}, {"budget", "0.3"}, {"window", "8"}, {"semantics", "kvpress"}}},
      {"dyn", {{"name", "dynamickv"}, {"budget", "48"}, {"window", "8"}, {"r_max", "3"}, {"m", "2"}}},
      {"stream", {{"name", "streamingllm"}, {"budget", "64"}, {"sink", "4"}}},
      {"h2o", {{"name", "h2o"}, {"budget", "64"}, {"window", "8"}}},
      {"knorm", {{"name", "knorm"}, {"budget", "0.5"}}},
      {"knorm_kvp", {{"name", "knorm"}, {"budget", "0.5"}, {"semantics", "kvpress"}}},
      {"rand", {{"name", "random"}, {"budget", "40"}}},
      {"knorm_dec", {{"name", "knorm"}, {"budget", "0.5"}, {"decode_budget", "80"}, {"decode_evict_chunk", "8"}}},
  };
  return s;
}

class ChunkedPrefillPolicy : public ::testing::TestWithParam<std::string> {};

TEST_P(ChunkedPrefillPolicy, KeepsThePositionsOfTheWholePrompt) {
  const std::string& policy = GetParam();
  int64_t compressed = 0;
  float logit_diff = 0;
  for (const std::string name : {"llama-gqa", "llama-kvfew", "llama-mha"}) {
    const std::string dir = fixture(name);
    if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/" << name;
    auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
    const auto prompt = make_prompt(kLen, 5, model->config().vocab_size);
    const int64_t L = model->config().num_hidden_layers, blocks = 2 * ((kLen + 8) / 16 + 2) * L;
    auto whole = make_memory(*model, blocks, policy_specs());
    const torch::Tensor want = model->prefill(1, prompt, *whole, false, policy);
    for (const auto& split : kSplits) {
      auto kv = make_memory(*model, blocks, policy_specs());
      const torch::Tensor got = prefill_chunks(*model, 1, prompt, split, *kv, policy);
      logit_diff = std::max(logit_diff, max_diff(got, want));
      EXPECT_EQ(kv->prefill_budgets(1), whole->prefill_budgets(1)) << name;
      EXPECT_EQ(kv->kept_tokens(1), whole->kept_tokens(1)) << name;
      for (int64_t l = 0; l < L; ++l) {
        EXPECT_TRUE(torch::equal(kv->kept_positions(1, l), whole->kept_positions(1, l))) << name << " layer " << l;
        auto [ka, va] = whole->cache().gather(1, l);
        auto [kb, vb] = kv->cache().gather(1, l);
        EXPECT_LE(max_diff(ka, kb), 1e-4) << name << " layer " << l;
        compressed += whole->cached_tokens(1, l) < kLen;
      }
      EXPECT_EQ(kv->blocks_used(), whole->blocks_used()) << name;
      kv->cache().check_invariants();
    }
  }
  std::cout << "[ " << policy << " ] max |chunked - whole| last logits " << logit_diff << "\n";
  EXPECT_LE(logit_diff, 1e-4);
  if (policy != "full") {
    EXPECT_GT(compressed, 0) << "the policy compressed nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, ChunkedPrefillPolicy,
                         ::testing::Values("full", "snap", "snap_w", "pyr", "pyr_kvp", "dyn", "stream", "knorm", "knorm_kvp",
                                           "rand", "knorm_dec"));

// H2O scores each key by the attention of every later query: its selection cannot run chunk-wise,
// so the memory refuses the chunks (the scheduler prefills H2O prompts whole) and keeps nothing.
TEST(ChunkedPrefillFailure, H2oRefusesChunksAndLeavesNoKv) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto prompt = make_prompt(kLen, 5, model->config().vocab_size);
  auto kv = make_memory(*model, 400, policy_specs());
  EXPECT_FALSE(PagedKvMemory::chunkable(kv->policy("h2o")));
  EXPECT_TRUE(PagedKvMemory::chunkable(kv->policy("snap")));
  try {
    prefill_chunks(*model, 1, prompt, {300}, *kv, "h2o");
    FAIL() << "H2O took chunks";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot prefill in chunks"), std::string::npos) << e.what();
  }
  EXPECT_EQ(kv->blocks_used(), 0);
}

TEST(ChunkedPrefillFailure, AFailedChunkFreesTheEarlierChunks) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto prompt = make_prompt(300, 2, model->config().vocab_size);
  // 2 layers: the first 100 tokens take 14 blocks, all 300 take 38; 30 blocks fail the second chunk.
  auto kv = make_memory(*model, 30);
  const std::span<const int64_t> all(prompt);
  model->prefill_batch({PrefillInput{1, all.subspan(0, 100), "", 0, 300}}, *kv);
  EXPECT_EQ(kv->blocks_used(), 14);
  try {
    model->prefill_batch({PrefillInput{1, all.subspan(100), "", 100, 300}}, *kv);
    FAIL() << "the chunk fit a pool too small for it";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos) << e.what();
  }
  EXPECT_EQ(kv->blocks_used(), 0);
  EXPECT_EQ(kv->blocks_held(1), 0);
  kv->cache().check_invariants();
}

TEST(ChunkedPrefillRunner, OnlyTheLastChunkSamplesAndAFailedChunkFailsOnlyItsRequest) {
  const std::string dir = fixture("qwen2-bias");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/qwen2-bias";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t L = model->config().num_hidden_layers;
  const auto prompt = make_prompt(300, 4, model->config().vocab_size);
  const auto other = make_prompt(40, 6, model->config().vocab_size);
  LocalRunner runner(model, make_memory(*model, 400));
  SamplingParams greedy;
  greedy.temperature = 0;
  auto chunk = [&](int64_t id, const std::vector<int64_t>& p, int64_t start, int64_t n) {
    PrefillWork w;
    w.seq_id = id;
    w.tokens.assign(p.begin() + start, p.begin() + start + n);
    w.start = start;
    w.prompt_len = static_cast<int64_t>(p.size());
    w.sample = w.last_chunk();
    return w;
  };
  // Step 1: the first chunk of sequence 1 and the whole of sequence 2; step 2: the rest of 1.
  StepPlan s1;
  s1.start = {{1, greedy, prompt, 0, {}}, {2, greedy, other, 0, {}}};
  s1.prefill = {chunk(1, prompt, 0, 200), chunk(2, other, 0, 40)};
  const StepResult r1 = runner.execute(s1);
  ASSERT_EQ(r1.prefilled.size(), 2u);
  EXPECT_TRUE(r1.prefilled[0].error.empty()) << r1.prefilled[0].error;
  EXPECT_FALSE(r1.prefilled[0].first.has_value());
  ASSERT_TRUE(r1.prefilled[1].first.has_value());
  StepPlan s2;
  s2.prefill = {chunk(1, prompt, 200, 100)};
  const StepResult r2 = runner.execute(s2);
  ASSERT_TRUE(r2.prefilled.at(0).first.has_value()) << r2.prefilled[0].error;
  EXPECT_EQ(r2.prefilled[0].kept_tokens, 300 * L);
  auto ref = make_memory(*model, 400);
  EXPECT_EQ(r2.prefilled[0].first->token, model->prefill(0, prompt, *ref)[0].argmax().item<int64_t>());

  // A chunk with a bad token fails its request alone and frees its earlier chunk.
  auto bad = prompt;
  bad[250] = model->config().vocab_size;
  StepPlan s3;
  s3.start = {{3, greedy, bad, 0, {}}};
  s3.prefill = {chunk(3, bad, 0, 200)};
  runner.execute(s3);
  StepPlan s4;
  s4.prefill = {chunk(3, bad, 200, 100), chunk(4, other, 0, 40)};
  s4.start = {{4, greedy, other, 0, {}}};
  const StepResult r4 = runner.execute(s4);
  EXPECT_NE(r4.prefilled.at(0).error.find("token id out of range"), std::string::npos) << r4.prefilled[0].error;
  EXPECT_TRUE(r4.prefilled.at(1).first.has_value()) << r4.prefilled[1].error;
  EXPECT_EQ(r4.shards.at(0).held.at(0), 0);
}

}  // namespace
}  // namespace kvserve
