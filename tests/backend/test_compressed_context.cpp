// Compressed contexts (KvMemory::begin_context, `compress: context`) on the fixtures: a prompt whose
// policy compresses its context alone keeps, in the context, exactly what the context prefilled as a
// prompt of its own keeps, and appends the rest whole; a later prompt with the same context takes the
// compressed KV from the cache and gives the logits, kept positions and greedy decode of a run
// without the cache; entries are shared, copied where partly filled, released and reclaimed.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "backend/model/decoder_model.h"
#include "cache_manager/paged_kv_memory.h"
#include "tests/support/fixture_models.h"
#include "tests/support/kvzap_fixture.h"

#include <unistd.h>

namespace kvserve {
namespace {

using Specs = std::map<std::string, std::map<std::string, std::string>>;
using test::fixture;
using test::make_prompt;

// Where the kvzap spec's predictor lives (written by the test that uses it; one per process).
std::string zap_dir() {
  return (std::filesystem::temp_directory_path() / ("kvserve-gtest-kvzap-" + std::to_string(getpid()))).string();
}

// Head-wise pools: kvzip and kvzap (one top-k over layers and heads) and head-adaptive key norms;
// layer-wise pools: key norms and StreamingLLM, each compressing the context only.
const Specs& head_specs() {
  static const Specs s = {
      {"zip", {{"name", "kvzip"}, {"budget", "0.25"}, {"chunk_size", "200"}}},
      {"zap", {{"name", "kvzap"}, {"budget", "0.25"}, {"predictor", zap_dir()}}},
      {"knorm_ada",
       {{"name", "knorm"}, {"budget", "0.5"}, {"head_budgets", "adaptive"}, {"compress", "context"}, {"skip_layers", "none"}}},
  };
  return s;
}
const Specs& layer_specs() {
  static const Specs s = {
      {"knorm_ctx", {{"name", "knorm"}, {"budget", "0.5"}, {"compress", "context"}, {"skip_layers", "none"}}},
      {"stream_ctx", {{"name", "streamingllm"}, {"budget", "96"}, {"compress", "context"}}},
      // Keeps a 600-token context whole: its blocks are the prefix cache's, not an entry's.
      {"stream_whole", {{"name", "streamingllm"}, {"budget", "4096"}, {"compress", "context"}}},
  };
  return s;
}

constexpr int64_t kDoc = 600, kQuestion = 37, kSteps = 6;

std::unique_ptr<PagedKvMemory> memory(const DecoderModel& m, bool head, bool context_cache, int64_t blocks_per_lane = 0,
                                      int64_t host_tier_bytes = 0) {
  const auto& c = m.config();
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.head_blocks = head;
  const int64_t lanes = head ? c.num_key_value_heads : 1;
  pool.num_blocks = (blocks_per_lane > 0 ? blocks_per_lane : 4 * c.num_hidden_layers * (kDoc / 16 + 8)) * lanes;
  auto kv = std::make_unique<PagedKvMemory>(c.num_hidden_layers, pool, resolve_policies(head ? head_specs() : layer_specs()));
  kv->enable_prefix_cache(m.kv_layout().kv_salt, nullptr, host_tier_bytes);
  if (context_cache) kv->enable_context_cache(m.kv_layout().kv_salt);
  return kv;
}

std::vector<int64_t> doc_and_question(int64_t vocab, int64_t salt) {
  auto p = make_prompt(kDoc, 11, vocab);
  const auto q = make_prompt(kQuestion, salt, vocab);
  p.insert(p.end(), q.begin(), q.end());
  return p;
}

// What one request leaves: the first logits, its greedy continuation's logits, kept positions.
struct Run {
  torch::Tensor first;
  std::vector<torch::Tensor> steps;
  std::vector<torch::Tensor> kept;  // per layer [KV, n], -1 padded
  int64_t hit = 0;
};

// keep_copy: the scheduler lets a compressing prompt copy its full-precision blocks into the prefix
// cache only where the pool has room for them.
Run run(DecoderModel& model, PagedKvMemory& kv, int64_t seq, const std::vector<int64_t>& prompt, const std::string& policy,
        int64_t context, bool keep_copy = true) {
  PrefillInput in{seq, prompt, policy};
  in.context_len = context;
  in.keep_copy = keep_copy;
  Run r;
  r.first = model.prefill_batch({in}, kv);
  r.hit = kv.prefix_hit(seq);
  for (int64_t l = 0; l < model.config().num_hidden_layers; ++l) r.kept.push_back(kv.kept_positions(seq, l));
  int64_t tok = r.first.argmax(-1).item<int64_t>();
  for (int64_t s = 0; s < kSteps; ++s) {
    auto logits = model.decode(DecodeBatch{{seq}, {static_cast<int64_t>(prompt.size()) + s}}, {tok}, kv);
    r.steps.push_back(logits);
    tok = logits.argmax(-1).item<int64_t>();
  }
  return r;
}

float max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<float>(); }

void expect_same(const Run& a, const Run& b, const std::string& what) {
  EXPECT_LE(max_diff(a.first, b.first), 1e-5) << what;
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t s = 0; s < a.steps.size(); ++s) {
    EXPECT_EQ(a.steps[s].argmax(-1).item<int64_t>(), b.steps[s].argmax(-1).item<int64_t>()) << what << " step " << s;
    EXPECT_LE(max_diff(a.steps[s], b.steps[s]), 1e-5) << what << " step " << s;
  }
  for (size_t l = 0; l < a.kept.size(); ++l) EXPECT_TRUE(torch::equal(a.kept[l], b.kept[l])) << what << " layer " << l;
}

void check_policy(const std::string& policy, bool head) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  const auto q1 = doc_and_question(c.vocab_size, 21), q2 = doc_and_question(c.vocab_size, 22);

  // The context keeps what it keeps as a prompt of its own; the question is appended whole.
  auto alone = memory(*model, head, false);
  model->prefill_batch({PrefillInput{1, std::span<const int64_t>(q1).first(kDoc), policy}}, *alone);
  auto plain = memory(*model, head, false);
  const Run a1 = run(*model, *plain, 1, q1, policy, kDoc);
  EXPECT_EQ(a1.hit, 0);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const auto want = alone->kept_positions(1, l);
    const auto got = a1.kept[static_cast<size_t>(l)];
    // Each head: its kept context positions, then kQuestion question positions in order.
    for (int64_t h = 0; h < c.num_key_value_heads; ++h) {
      std::vector<int64_t> w, g;
      for (int64_t j = 0; j < want.size(1); ++j)
        if (want[h][j].item<int64_t>() >= 0) w.push_back(want[h][j].item<int64_t>());
      for (int64_t i = 0; i < kQuestion; ++i) w.push_back(kDoc + i);
      for (int64_t j = 0; j < got.size(1); ++j)
        if (got[h][j].item<int64_t>() >= 0) g.push_back(got[h][j].item<int64_t>());
      EXPECT_EQ(g, w) << policy << " layer " << l << " head " << h;
    }
  }
  EXPECT_LT(plain->kept_tokens(1), c.num_hidden_layers * (kDoc + kQuestion));
  plain->release(1);
  const Run a2 = run(*model, *plain, 2, q2, policy, kDoc);
  plain->release(2);
  EXPECT_EQ(plain->blocks_used(), 0);

  // With the cache: the first request compresses and caches the context, the second takes it.
  auto cached = memory(*model, head, true);
  const Run b1 = run(*model, *cached, 1, q1, policy, kDoc);
  expect_same(b1, a1, policy + " first request");
  const CompressedContextCache* cc = cached->cache().context_cache();
  ASSERT_NE(cc, nullptr);
  EXPECT_EQ(cc->num_entries(), 1);
  EXPECT_LT(cc->cached_blocks(), cc->full_blocks());
  // Concurrent with the first: shares its entry (the first is still decoding).
  const Run b2 = run(*model, *cached, 2, q2, policy, kDoc);
  EXPECT_EQ(b2.hit, kDoc);
  EXPECT_EQ(cached->prefix_queried(2), static_cast<int64_t>(q2.size()));
  expect_same(b2, a2, policy + " second request (hit)");
  cached->cache().check_invariants();
  cached->release(1);
  cached->release(2);
  // Idle entries count as free and go when the pool needs their blocks.
  EXPECT_EQ(cached->blocks_used(), 0);
  EXPECT_GT(cc->reclaimable_blocks(), 0);
  const Run b3 = run(*model, *cached, 3, q1, policy, kDoc);
  EXPECT_EQ(b3.hit, kDoc);
  expect_same(b3, a1, policy + " third request (hit, after release)");
  cached->release(3);
  cached->cache().check_invariants();
  EXPECT_TRUE(cached->cache().reclaim(cached->cache().total_blocks()));
  EXPECT_EQ(cc->num_entries(), 0);
  cached->cache().check_invariants();
}

TEST(CompressedContext, KvzipHeadwise) { check_policy("zip", true); }
TEST(CompressedContext, KvzapHeadwise) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  test::write_kvzap_predictor(zap_dir(), load_model_config(dir), 16, 3);
  check_policy("zap", true);
  std::filesystem::remove_all(zap_dir());
}
TEST(CompressedContext, KnormHeadAdaptive) { check_policy("knorm_ada", true); }
TEST(CompressedContext, KnormLayerwise) { check_policy("knorm_ctx", false); }
TEST(CompressedContext, StreamingLayerwise) { check_policy("stream_ctx", false); }

TEST(CompressedContext, OtherContextOrPolicyMisses) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  auto kv = memory(*model, false, true);
  const auto q1 = doc_and_question(c.vocab_size, 21);
  run(*model, *kv, 1, q1, "knorm_ctx", kDoc);
  kv->release(1);
  // Another policy, or the same document cut elsewhere, is another context (the full-precision
  // prefix cache may still serve part of its prefill).
  EXPECT_NE(run(*model, *kv, 2, q1, "stream_ctx", kDoc).hit, kDoc);
  kv->release(2);
  EXPECT_NE(run(*model, *kv, 3, q1, "knorm_ctx", kDoc - 1).hit, kDoc - 1);
  kv->release(3);
  auto other = q1;
  other[5] = (other[5] + 1) % c.vocab_size;
  EXPECT_EQ(run(*model, *kv, 4, other, "knorm_ctx", kDoc).hit, 0);
  kv->release(4);
  EXPECT_EQ(run(*model, *kv, 5, q1, "knorm_ctx", kDoc).hit, kDoc);
  kv->release(5);
  EXPECT_EQ(kv->cache().context_cache()->num_entries(), 4);
  kv->cache().check_invariants();
}

TEST(CompressedContext, AContextKeptWholeIsOnlyInThePrefixCache) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  auto kv = memory(*model, false, true);
  const auto q1 = doc_and_question(model->config().vocab_size, 21);
  run(*model, *kv, 1, q1, "stream_whole", kDoc);
  kv->release(1);
  EXPECT_EQ(kv->cache().context_cache()->num_entries(), 0);
  EXPECT_GT(kv->cache().cached_blocks(), 0);
  EXPECT_EQ(kv->blocks_used(), 0);
  kv->cache().check_invariants();
}

TEST(CompressedContext, SmallPoolReclaimsEntriesBeforeFailing) {
  // A pool that holds one request at a time: every new context reclaims the previous entry.
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  const PagedKvMemory::Geometry g = memory(*model, false, true)->geometry();
  const int64_t need = PagedKvMemory::context_prompt_blocks(make_policy_config("knorm", {{"budget", "0.5"}, {"skip_layers", "none"}}), g, kDoc,
                                                            kDoc + kQuestion + kSteps);
  auto kv = memory(*model, false, true, need);
  for (int64_t i = 0; i < 4; ++i) {
    auto p = make_prompt(kDoc + kQuestion, 100 + i, c.vocab_size);
    ASSERT_NO_THROW(run(*model, *kv, 10 + i, p, "knorm_ctx", kDoc, /*keep_copy=*/false)) << "request " << i;
    kv->release(10 + i);
    kv->cache().check_invariants();
  }
  EXPECT_GE(kv->cache().context_cache()->num_entries(), 1);
  EXPECT_EQ(kv->blocks_used(), 0);
}

TEST(CompressedContext, HostTierKeepsTheContextsThePoolCannot) {
  // A pool that holds one request at a time, with a host tier (cache.prefix_cache_bytes): a second
  // document's context pushes the first one's entry to the tier instead of dropping it, and the
  // first document's next question takes it back with the logits, kept positions and greedy tokens
  // of a run without the cache.
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  const PagedKvMemory::Geometry g = memory(*model, false, true)->geometry();
  const int64_t need = PagedKvMemory::context_prompt_blocks(make_policy_config("knorm", {{"budget", "0.5"}, {"skip_layers", "none"}}), g, kDoc,
                                                            kDoc + kQuestion + kSteps);
  const auto q1 = doc_and_question(c.vocab_size, 21), q2 = doc_and_question(c.vocab_size, 22);
  auto other = make_prompt(kDoc + kQuestion, 300, c.vocab_size);
  auto plain = memory(*model, false, false);
  const auto want1 = run(*model, *plain, 1, q1, "knorm_ctx", kDoc, false);
  const auto want2 = run(*model, *plain, 2, q2, "knorm_ctx", kDoc, false);
  auto kv = memory(*model, false, true, need, int64_t{8} << 20);
  const CompressedContextCache& cc = *kv->cache().context_cache();
  expect_same(run(*model, *kv, 1, q1, "knorm_ctx", kDoc, false), want1, "first document");
  kv->release(1);
  run(*model, *kv, 2, other, "knorm_ctx", kDoc, false);
  kv->release(2);
  EXPECT_EQ(cc.num_entries(), 2);
  EXPECT_EQ(cc.host_entries(), 1) << "the first document's entry went to the tier";
  kv->cache().check_invariants();
  const int64_t loads = kv->cache().host_tier()->loads();
  const auto back = run(*model, *kv, 3, q2, "knorm_ctx", kDoc, false);
  EXPECT_EQ(back.hit, kDoc);
  EXPECT_GT(kv->cache().host_tier()->loads(), loads);
  expect_same(back, want2, "first document, second question, from the tier");
  kv->release(3);
  kv->cache().check_invariants();
  EXPECT_EQ(kv->blocks_used(), 0);
}

}  // namespace
}  // namespace kvserve
