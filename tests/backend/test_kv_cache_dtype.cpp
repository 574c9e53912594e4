// The KV cache dtype (LoadOptions::kv_cache_dtype): 16-bit storage under fp32 compute on the real
// model: decode logits stay close to an fp32 cache, greedy tokens agree, the policies keep the
// same positions, and the same memory holds twice the blocks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "backend/model/checkpoint.h"
#include "backend/model/decoder_model.h"
#include "cache_manager/kv_memory_factory.h"
#include "common/check.h"
#include "text/tokenizer.h"

using namespace kvserve;

namespace {

std::string fixture(const std::string& name) {
  const char* env = std::getenv("KVSERVE_FIXTURES");
  return env ? std::string(env) + "/" + name : "";
}

const std::string kDefaultModel = std::string(KVSERVE_SOURCE_DIR) + "/models/smollm2-135m-instruct";

std::shared_ptr<DecoderModel> load(const std::string& dir, const std::string& kv_dtype) {
  LoadOptions o{"cpu", "", false};
  o.kv_cache_dtype = kv_dtype;
  return DecoderModel::load(dir, o);
}

std::unique_ptr<PagedKvMemory> memory(const DecoderModel& m, int64_t bytes, const std::string& policy = "full",
                                      const std::map<std::string, std::string>& params = {}) {
  std::map<std::string, std::map<std::string, std::string>> specs;
  if (policy != "full") {
    specs[policy] = params;
    specs[policy]["name"] = policy;
  }
  return make_kv_memory(m.kv_layout(), {16, 0, bytes}, resolve_policies(specs), policy);
}

}  // namespace

TEST(KvCacheDtype, LayoutBytesAndBlocks) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto fp32 = load(dir, "auto");
  EXPECT_EQ(fp32->kv_layout().dtype, torch::kFloat32);
  EXPECT_EQ(load(dir, "")->kv_layout().dtype, torch::kFloat32);
  const int64_t bytes = int64_t{4} << 20;
  const int64_t blocks32 = memory(*fp32, bytes)->blocks_total();
  for (const char* name : {"float16", "bfloat16"}) {
    auto m = load(dir, name);
    EXPECT_EQ(m->dtype(), torch::kFloat32) << "compute stays fp32";
    EXPECT_EQ(dtype_name(m->kv_dtype()), name);
    EXPECT_EQ(m->kv_layout().dtype, m->kv_dtype());
    EXPECT_EQ(2 * m->kv_bytes_per_token(), fp32->kv_bytes_per_token());
    EXPECT_EQ(memory(*m, bytes)->blocks_total(), 2 * blocks32) << name;
  }
  try {
    load(dir, "fp8_e5m2");
    FAIL() << "accepted kv_cache_dtype fp8_e5m2";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("KV cache dtype 'fp8_e5m2' is not available"), std::string::npos) << e.what();
  }
  try {
    load(dir, "int8");
    FAIL() << "accepted an int8 cache for head_dim 16";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim is 16"), std::string::npos) << e.what();
  }
}

// Quantized caches (head_dim 32: one group a row): rows of 32 + 2 (int8), 16 + 2 (int4), 16 + 4
// (q4_1) bytes against float16's 64, and the blocks the same bytes hold.
TEST(KvCacheDtype, QuantizedLayoutBytesAndBlocks) {
  const std::string dir = fixture("qwen3");
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << "no $KVSERVE_FIXTURES/qwen3";
  auto f16 = load(dir, "float16");
  const int64_t bytes = int64_t{4} << 20;
  const int64_t blocks16 = memory(*f16, bytes)->blocks_total();
  for (const auto& [name, row] : std::vector<std::pair<std::string, int64_t>>{{"int8", 34}, {"int4", 18}, {"q4_1", 20}}) {
    auto m = load(dir, name);
    EXPECT_EQ(m->kv_dtype(), torch::kFloat32) << "rows decode to the compute dtype";
    EXPECT_TRUE(m->kv_layout().rounds);
    EXPECT_EQ(kv_cache_dtype_label(m->kv_dtype(), m->kv_quant()), name);
    EXPECT_EQ(m->kv_bytes_per_token() * 64, f16->kv_bytes_per_token() * row) << name;
    EXPECT_GE(memory(*m, bytes)->blocks_total() * row, blocks16 * 64 - 64 * row) << name;
  }
}

// Greedy decode of two prompts on the default model: the fp32-cache run's tokens are fed to the
// 16-bit runs too (teacher forcing), so every step's logits compare like with like.
TEST(KvCacheDtype, DefaultModelGreedyDecode) {
  if (!std::filesystem::exists(kDefaultModel + "/config.json")) GTEST_SKIP() << "no " << kDefaultModel << " (make model)";
  torch::NoGradGuard ng;
  const Tokenizer tok = Tokenizer::from_dir(kDefaultModel);
  const std::vector<std::vector<int64_t>> prompts = {
      tok.encode("The history of the printing press begins in the fifteenth century, when"),
      tok.encode("Question: A train leaves the station at 9 am and travels at 60 miles per hour. A second train "
                 "leaves the same station at 10 am and travels at 80 miles per hour in the same direction. At what "
                 "time does the second train catch up with the first? Answer: Let's think step by step.")};
  constexpr int kSteps = 32;
  struct Run {
    std::vector<torch::Tensor> logits;  // per step [B, V]
    std::vector<std::vector<int64_t>> tokens;  // per step [B], the run's own argmax
  };
  std::vector<std::vector<int64_t>> forced;  // fp32's tokens, per step
  auto run = [&](const std::string& kv_dtype) {
    auto m = load(kDefaultModel, kv_dtype);
    auto mem = memory(*m, int64_t{64} << 20);
    Run r;
    DecodeBatch batch;
    std::vector<int64_t> next;
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto l = m->prefill(static_cast<int64_t>(i), prompts[i], *mem);
      batch.seq_ids.push_back(static_cast<int64_t>(i));
      batch.positions.push_back(static_cast<int64_t>(prompts[i].size()));
      next.push_back(l[0].argmax().item<int64_t>());
    }
    if (forced.empty()) forced.push_back(next);
    for (int s = 0; s < kSteps; ++s) {
      auto l = m->decode(batch, forced[static_cast<size_t>(s)], *mem);
      r.logits.push_back(l);
      std::vector<int64_t> own;
      for (size_t i = 0; i < prompts.size(); ++i) own.push_back(l[static_cast<int64_t>(i)].argmax().item<int64_t>());
      r.tokens.push_back(own);
      if (static_cast<int>(forced.size()) == s + 1) forced.push_back(own);
      for (auto& p : batch.positions) ++p;
    }
    return r;
  };
  const Run ref = run("float32");
  // Measured on this model (2026-11-23, 2 threads): max |logit difference| over the 32 steps 0.016
  // for float16 (greedy tokens equal for all 32 steps), 0.092 for bfloat16 (equal for the first 18).
  // The bounds leave 3-4x room; greedy agreement is asked for the first 8 steps.
  // Quantized, rotated rows (2026-11-28): int8 0.32 (18 equal steps), int4 3.75 (12), q4_1 4.02 (17);
  // unrotated they were 0.41 (18), 4.84 (0), 6.95 (9): docs/architecture.md, "Quantized KV".
  // On an Intel CPU (2026-11-30), whose fp32 GEMMs round differently, the 4-bit formats' largest
  // step moved more than their typical one: int4 3.45 (mean of the steps' max 2.46), q4_1 5.23
  // (2.40); unrotated 6.46 (3.66) and 6.57 (2.95). A 4-bit row near a rounding edge flips a level
  // on such differences, so for those formats one step's max is bounded loosely and the mean tightly.
  const std::map<std::string, double> tol = {{"float16", 0.05}, {"bfloat16", 0.4}, {"int8", 0.8}, {"int4", 8.0}, {"q4_1", 8.0}};
  const std::map<std::string, double> mean_tol = {{"int4", 3.5}, {"q4_1", 3.5}};
  for (const auto& [name, max_diff] : tol) {
    const Run r = run(name);
    double worst = 0, mean = 0;  // the largest, and the mean over steps, of a step's max |difference|
    for (int s = 0; s < kSteps; ++s) {
      const double d = (r.logits[static_cast<size_t>(s)] - ref.logits[static_cast<size_t>(s)]).abs().max().item<double>();
      worst = std::max(worst, d);
      mean += d / kSteps;
    }
    int agree = 0;  // leading steps whose own greedy token equals fp32's, both sequences
    while (agree < kSteps && r.tokens[static_cast<size_t>(agree)] == ref.tokens[static_cast<size_t>(agree)]) ++agree;
    std::cout << "[ kv " << name << " ] max |logit - fp32 cache logit| over " << kSteps << " steps = " << worst
              << " (mean of the steps' max " << mean << "); greedy tokens equal for the first " << agree << " steps" << std::endl;
    RecordProperty("max_logit_diff_" + name, std::to_string(worst));
    EXPECT_LE(worst, max_diff) << name;
    if (mean_tol.count(name)) { EXPECT_LE(mean, mean_tol.at(name)) << name; }
    EXPECT_GE(agree, 8) << name;
  }
}

// Policies select from the fp32 activations; only storage changes, so they keep the same positions.
TEST(KvCacheDtype, KeptPositionsUnchanged) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty() || !std::filesystem::exists(dir + "/config.json")) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  torch::NoGradGuard ng;
  auto m32 = load(dir, "auto");
  const int64_t vocab = m32->config().vocab_size, L = m32->config().num_hidden_layers;
  std::vector<int64_t> prompt;
  for (int64_t t = 0; t < 300; ++t) prompt.push_back((t * 131 + 17) % vocab);
  const std::vector<std::pair<std::string, std::map<std::string, std::string>>> policies = {
      {"snapkv", {{"budget", "40"}, {"window", "8"}}},
      {"pyramidkv", {{"budget", "32"}, {"window", "8"}}},
      {"dynamickv", {{"budget", "32"}, {"window", "8"}}}};
  for (const auto& [policy, params] : policies) {
    std::vector<std::vector<torch::Tensor>> kept;  // per dtype, per layer
    for (const char* name : {"float32", "float16", "bfloat16"}) {
      auto m = load(dir, name);
      auto mem = memory(*m, int64_t{16} << 20, policy, params);
      m->prefill(1, prompt, *mem);
      std::vector<torch::Tensor> per_layer;
      for (int64_t l = 0; l < L; ++l) per_layer.push_back(mem->kept_positions(1, l));
      kept.push_back(per_layer);
    }
    for (size_t d = 1; d < kept.size(); ++d) {
      for (int64_t l = 0; l < L; ++l) {
        EXPECT_TRUE(torch::equal(kept[d][static_cast<size_t>(l)], kept[0][static_cast<size_t>(l)]))
            << policy << " layer " << l << " dtype #" << d;
      }
    }
    int64_t total = 0;
    for (const auto& k : kept[0]) total += k.numel();
    EXPECT_LT(total, L * m32->config().num_key_value_heads * static_cast<int64_t>(prompt.size())) << policy << " compressed";
  }
}
