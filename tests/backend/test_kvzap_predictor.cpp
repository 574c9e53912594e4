// KVzap's predictor (backend/scoring/kvzap_predictor.h) and `method: kvzap` on the fixtures: the scores equal
// a double-precision evaluation of kvpress's KVzapModel layers (linear; Linear, exact GELU, Linear),
// a bad predictor directory fails naming what is wrong, and a kvzap prefill keeps kvzip's global total
// with the sinks, the same alone as batched with other prompts. That the kept entries are the top of
// the predicted scores is checked against kvpress's KVzapPress in
// tests/reference/test_policies_end_to_end.py.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>

#include "backend/scoring/kvzap_predictor.h"
#include "backend/model/decoder_model.h"
#include "cache_manager/paged_kv_memory.h"
#include "policies/kvzip_scores.h"
#include "tests/support/fixture_models.h"
#include "tests/support/kvzap_fixture.h"

namespace kvserve {
namespace {

namespace fs = std::filesystem;
using test::fixture;
using test::make_prompt;

std::string tmp_dir(const std::string& what) {
  return (fs::temp_directory_path() / ("kvserve-kvzap-" + what + "-" + std::to_string(getpid()))).string();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(KvzapPredictor, ScoresMatchADoubleEvaluation) {
  const std::string model = fixture("llama-gqa");
  if (model.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  const ModelConfig c = load_model_config(model);
  const KvzapShape shape{c.hidden_size, c.num_key_value_heads, c.num_hidden_layers};
  for (int64_t width : {0, 24}) {
    const std::string dir = tmp_dir("exact" + std::to_string(width));
    const auto w = test::write_kvzap_predictor(dir, c, width, 11);
    const KvzapPredictor p(dir, shape, torch::kFloat32, torch::kCPU);
    EXPECT_EQ(p.is_mlp(), width > 0);
    const auto h = torch::randn({37, c.hidden_size});
    const auto hd = h.to(torch::kFloat64);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      const std::string pre = "layers." + std::to_string(l);
      auto d = [&](const std::string& name) { return w.at(pre + name).to(torch::kFloat64); };
      torch::Tensor want;
      if (width == 0) {
        want = hd.matmul(d(".weight").t()) + d(".bias");
      } else {
        auto a = hd.matmul(d(".0.weight").t()) + d(".0.bias");
        a = 0.5 * a * (1.0 + torch::erf(a / std::sqrt(2.0)));
        want = a.matmul(d(".2.weight").t()) + d(".2.bias");
      }
      const auto got = p.scores(l, h);
      ASSERT_EQ(got.sizes(), want.sizes());
      EXPECT_EQ(got.scalar_type(), torch::kFloat32);
      EXPECT_LE((got.to(torch::kFloat64) - want).abs().max().item<double>(), 1e-4) << "layer " << l << " width " << width;
    }
    fs::remove_all(dir);
  }
}

TEST(KvzapPredictor, ABadDirectoryFailsNamingTheProblem) {
  const std::string model = fixture("llama-gqa");
  if (model.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  const ModelConfig c = load_model_config(model);
  const KvzapShape shape{c.hidden_size, c.num_key_value_heads, c.num_hidden_layers};
  auto load = [&](const std::string& dir) { return error_of([&] { KvzapPredictor(dir, shape, torch::kFloat32, torch::kCPU); }); };

  const std::string missing = tmp_dir("missing");
  EXPECT_NE(load(missing).find(missing + "/config.json"), std::string::npos) << load(missing);
  EXPECT_NE(load(missing).find("make train-kvzap"), std::string::npos);

  // A predictor of another model: its width and head count are named next to the model's.
  ModelConfig other = c;
  other.hidden_size += 8;
  const std::string wrong = tmp_dir("wrong");
  test::write_kvzap_predictor(wrong, other, 0, 1);
  const std::string e = load(wrong);
  EXPECT_NE(e.find("does not fit this model"), std::string::npos) << e;
  EXPECT_NE(e.find("width " + std::to_string(other.hidden_size)), std::string::npos) << e;

  // A config that promises an MLP over linear weights: the missing tensor is named.
  const std::string mixed = tmp_dir("mixed");
  test::write_kvzap_predictor(mixed, c, 0, 1);
  std::ofstream(mixed + "/config.json") << "{\"input_dim\": " << c.hidden_size << ", \"output_dim\": " << c.num_key_value_heads
                                        << ", \"n_modules\": " << c.num_hidden_layers << ", \"hidden_dim\": 16}";
  EXPECT_NE(load(mixed).find("layers.0.0.weight"), std::string::npos) << load(mixed);

  std::ofstream(mixed + "/config.json") << "{\"input_dim\": ";
  EXPECT_NE(load(mixed).find("not valid JSON"), std::string::npos) << load(mixed);
  std::ofstream(mixed + "/config.json") << "{\"input_dim\": -3, \"output_dim\": 2, \"n_modules\": 2}";
  EXPECT_NE(load(mixed).find("'input_dim' must be a positive integer"), std::string::npos) << load(mixed);
  for (const auto& d : {wrong, mixed}) fs::remove_all(d);

  // A policy without a predictor fails its first prefill with the same message, and leaves the
  // memory as it found it.
  auto m = DecoderModel::load(model, LoadOptions{"cpu", "", false});
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.head_blocks = true;
  pool.num_blocks = 64 * c.num_hidden_layers * c.num_key_value_heads;
  PagedKvMemory kv(c.num_hidden_layers, pool,
                   resolve_policies({{"zap", {{"name", "kvzap"}, {"budget", "0.25"}, {"predictor", missing}}}}));
  const auto prompt = make_prompt(100, 3, c.vocab_size);
  const std::string err = error_of([&] { m->prefill_batch({PrefillInput{1, prompt, "zap"}}, kv); });
  EXPECT_NE(err.find(missing + "/config.json"), std::string::npos) << err;
  EXPECT_EQ(kv.blocks_used(), 0);
}

// kvzap on a fixture: kvzip's global total over (layer, KV head)s of different lengths, the sinks in
// each; alone or batched with other prompts and policies.
TEST(KvzapPredictor, PrefillKeepsTheGlobalTotalWithItsSinks) {
  const std::string model = fixture("llama-gqa");
  if (model.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  const ModelConfig c = load_model_config(model);
  const std::string dir = tmp_dir("prefill");
  test::write_kvzap_predictor(dir, c, 0, 5);
  auto m = DecoderModel::load(model, LoadOptions{"cpu", "", false});
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.head_blocks = true;
  pool.num_blocks = 64 * c.num_hidden_layers * c.num_key_value_heads;
  auto policies = resolve_policies({{"zap", {{"name", "kvzap"}, {"budget", "0.25"}, {"predictor", dir}}},
                                    {"snap", {{"name", "snapkv"}, {"budget", "32"}}}});
  const int64_t T = 211;
  const auto prompt = make_prompt(T, 9, c.vocab_size), other = make_prompt(150, 4, c.vocab_size);
  const PolicyConfig& cfg = policies.at("zap");

  auto kept = [&](PagedKvMemory& kv, int64_t seq) {
    std::vector<torch::Tensor> out;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) out.push_back(kv.kept_positions(seq, l));
    return out;
  };
  PagedKvMemory alone(c.num_hidden_layers, pool, policies);
  const auto first = m->prefill_batch({PrefillInput{1, prompt, "zap"}}, alone);
  const auto got = kept(alone, 1);

  // The kept total is kvzip's global total; every head keeps the sinks; heads differ in length.
  int64_t total = 0;
  std::set<int64_t> lengths;
  for (const auto& k : got) {
    for (int64_t h = 0; h < k.size(0); ++h) {
      const auto row = k[h];
      const int64_t n = (row >= 0).sum().item<int64_t>();
      total += n;
      lengths.insert(n);
      for (int64_t s = 0; s < cfg.sink; ++s) EXPECT_EQ(row[s].item<int64_t>(), s);
    }
  }
  EXPECT_EQ(total, global_kept_total(cfg, c.num_hidden_layers, c.num_key_value_heads, T));
  EXPECT_GT(lengths.size(), 1u);

  // Batched with a SnapKV prompt and a second kvzap prompt: the same kept sets and logits.
  PagedKvMemory batched(c.num_hidden_layers, pool, policies);
  const auto logits = m->prefill_batch(
      {PrefillInput{7, other, "snap"}, PrefillInput{8, prompt, "zap"}, PrefillInput{9, other, "zap"}}, batched);
  const auto again = kept(batched, 8);
  for (size_t l = 0; l < got.size(); ++l) EXPECT_TRUE(torch::equal(got[l], again[l])) << "layer " << l;
  EXPECT_LE((logits[1] - first[0]).abs().max().item<float>(), 1e-4);
  for (int64_t s : {7, 8, 9}) batched.release(s);
  alone.release(1);
  EXPECT_EQ(batched.blocks_used(), 0);
  EXPECT_EQ(alone.blocks_used(), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvserve
