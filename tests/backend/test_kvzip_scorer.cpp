// kvzip's reconstruction passes (backend/scoring/kvzip_scorer.h) on the fixtures: the passes' ids, the repeat
// prompts derived from a tokenizer and chat template, and a prefill's kept set depending only on the
// context it reconstructs (positions before the trailing window).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "backend/scoring/kvzip_scorer.h"
#include "backend/model/decoder_model.h"
#include "cache_manager/paged_kv_memory.h"
#include "policies/kvzip_scores.h"
#include "tests/support/fixture_models.h"

namespace kvserve {
namespace {

using test::fixture;
using test::make_prompt;

TEST(KvzipPasses, FirstAndLaterChunks) {
  KvzipPrompts p;
  p.first = {100, 101};
  p.later = {200};
  p.suffix = {300, 301};
  p.tail = 3;
  std::vector<int64_t> tokens;
  for (int64_t i = 0; i < 12; ++i) tokens.push_back(i);
  const auto passes = kvzip_passes(p, tokens, 2, 11, 4);  // chunks [2, 6), [6, 10), [10, 11)
  ASSERT_EQ(passes.size(), 3u);
  EXPECT_EQ(passes[0].ids, (std::vector<int64_t>{100, 101, 300, 301, 2, 3, 4, 5}));
  EXPECT_EQ(passes[1].ids, (std::vector<int64_t>{200, 3, 4, 5, 300, 301, 6, 7, 8, 9}));
  EXPECT_EQ(passes[2].ids, (std::vector<int64_t>{200, 7, 8, 9, 300, 301, 10}));
  EXPECT_EQ(passes[2].start, 10);
  EXPECT_EQ(passes[2].stop, 11);
  // A tail longer than a chunk repeats the whole previous chunk (kvpress's slice).
  p.tail = 8;
  EXPECT_EQ(kvzip_passes(p, tokens, 0, 4, 2)[1].ids, (std::vector<int64_t>{200, 0, 1, 300, 301, 2, 3}));
  EXPECT_THROW(kvzip_passes(p, tokens, 0, 13, 2), KvError);
}

TEST(KvzipPrompts, FromTheFixtureChatTemplate) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  const KvzipPrompts& k = kvzip_prompts(dir, Semantics::kKvpress);
  // What kvpress 0.5.5 derives from the same files (transformers' tokenizer and chat template).
  EXPECT_EQ(k.prefix_len, 8);
  EXPECT_EQ(k.suffix, (std::vector<int64_t>{4, 2, 768, 88, 371, 89, 820, 89, 3, 204, 204}));
  EXPECT_EQ(k.first, (std::vector<int64_t>{204, 204, 576, 713, 89, 332, 287, 262, 1238, 264, 88, 265, 294,
                                            1237, 93, 89, 226, 74, 93, 70, 72, 89, 81, 94, 19}));
  const KvzipPrompts& paper = kvzip_prompts(dir, Semantics::kPaper);
  EXPECT_NE(paper.later, k.later);  // the authors' instruction ends with a space
  EXPECT_EQ(paper.first, k.first);
}

std::unique_ptr<PagedKvMemory> head_memory(const DecoderModel& m, int64_t prompt,
                                           const std::map<std::string, std::map<std::string, std::string>>& specs) {
  const auto& c = m.config();
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.head_blocks = true;
  pool.num_blocks = (c.num_hidden_layers + 1) * (prompt / pool.block_size + 2) * c.num_key_value_heads;
  return std::make_unique<PagedKvMemory>(c.num_hidden_layers, pool, resolve_policies(specs));
}

std::vector<int64_t> head_row(const torch::Tensor& pos, int64_t h) {
  auto r = pos[h].to(torch::kCPU).contiguous();
  std::vector<int64_t> out(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
  out.erase(std::remove(out.begin(), out.end(), int64_t{-1}), out.end());
  return out;
}

TEST(KvzipPrefill, KeptSetIsAFunctionOfTheContextTokens) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  constexpr int64_t T = 300, W = 20;
  const std::map<std::string, std::map<std::string, std::string>> specs = {
      {"kvzip", {{"budget", "0.25"}, {"window", std::to_string(W)}, {"chunk_size", "64"}}}};
  auto a = make_prompt(T, 5, c.vocab_size);
  auto b = a;
  for (int64_t i = T - W; i < T; ++i) b[static_cast<size_t>(i)] = (b[static_cast<size_t>(i)] + 17) % c.vocab_size;
  auto kva = head_memory(*model, T, specs), kvb = head_memory(*model, T, specs);
  model->prefill(1, a, *kva, false, "kvzip");
  model->prefill(1, b, *kvb, false, "kvzip");
  const PolicyConfig& cfg = kva->policy("kvzip");
  int64_t scored = 0;
  std::set<int64_t> counts;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    auto pa = kva->kept_positions(1, l), pb = kvb->kept_positions(1, l);
    for (int64_t h = 0; h < c.num_key_value_heads; ++h) {
      const auto ra = head_row(pa, h), rb = head_row(pb, h);
      EXPECT_EQ(ra, rb) << "layer " << l << " head " << h;
      ASSERT_GE(ra.size(), static_cast<size_t>(cfg.sink + W));
      for (int64_t s = 0; s < cfg.sink; ++s) EXPECT_EQ(ra[static_cast<size_t>(s)], s);  // sinks
      for (int64_t i = 0; i < W; ++i) EXPECT_EQ(ra[ra.size() - W + i], T - W + i);      // the window, whole
      scored += static_cast<int64_t>(ra.size()) - W;
      counts.insert(static_cast<int64_t>(ra.size()));
    }
  }
  EXPECT_EQ(scored, global_kept_total(cfg, c.num_hidden_layers, c.num_key_value_heads, T));
  EXPECT_GT(counts.size(), 1u) << "one top-k over layers and heads keeps different counts";
  // The scores themselves: the passes see positions [0, T - W) only.
  auto full = head_memory(*model, T, {});
  model->prefill(2, a, *full);
  auto sa = kvzip_scores(*model, *full, 2, a, cfg);
  full->release(2);
  model->prefill(3, b, *full);
  auto sb = kvzip_scores(*model, *full, 3, b, cfg);
  ASSERT_EQ(sa.size(), static_cast<size_t>(c.num_hidden_layers));
  for (size_t l = 0; l < sa.size(); ++l) {
    EXPECT_EQ(sa[l].sizes(), (std::vector<int64_t>{c.num_key_value_heads, T - W}));
    EXPECT_TRUE(torch::equal(sa[l], sb[l])) << "layer " << l;
  }
}

TEST(KvzipPrefill, FitsThePoolAdmissionReserves) {
  // Admission reserves the whole prompt in every layer (the passes need it all): a pool of exactly
  // prompt_blocks holds the prefill, and afterwards only the kept entries' blocks stay in use.
  const std::string dir = fixture("llama3-rope");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama3-rope";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  constexpr int64_t T = 257;
  const std::map<std::string, std::map<std::string, std::string>> specs = {{"kvzip", {{"chunk_size", "100"}}}};
  const PagedKvMemory::Geometry g = head_memory(*model, T, specs)->geometry();
  const PolicyConfig cfg = make_policy_config("kvzip", {{"chunk_size", "100"}});
  const int64_t need = PagedKvMemory::prompt_blocks(cfg, g, T);
  EXPECT_GE(need, c.num_hidden_layers * c.num_key_value_heads * ((T + 1 + 15) / 16));
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.head_blocks = true;
  pool.num_blocks = need;
  PagedKvMemory kv(c.num_hidden_layers, pool, resolve_policies(specs));
  const auto prompt = make_prompt(T, 9, c.vocab_size);
  ASSERT_NO_THROW(model->prefill(1, prompt, kv, false, "kvzip"));
  EXPECT_LT(kv.blocks_used(), need / 2);
  EXPECT_EQ(kv.kept_tokens(1) * c.num_key_value_heads,
            global_kept_total(cfg, c.num_hidden_layers, c.num_key_value_heads, T));
  kv.release(1);
  EXPECT_EQ(kv.blocks_used(), 0);
}

}  // namespace
}  // namespace kvserve
