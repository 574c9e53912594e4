// Prefix caching on the random fixtures: a prompt that starts with a cached document gives, under
// every KV policy, the logits, kept positions and decode of a run without the cache; the cached
// blocks are shared and reclaimed before anything fails; a failed or cancelled prefill releases
// its references; a key collision is a miss; the runner reports what it found.
#include <gtest/gtest.h>

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

const Specs& policy_specs() {
  static const Specs s = {
      {"snap", {{"name", "snapkv"}, {"budget", "64"}, {"window", "8"}, {"kernel", "5"}}},
      {"snap_w", {{"name", "snapkv"}, {"budget", "200"}, {"window", "150"}, {"kernel", "5"}}},
      {"pyr", {{"name", "pyramidkv"}, {"budget", "64"}, {"window", "8"}, {"beta", "4"}}},
      {"dyn", {{"name", "dynamickv"}, {"budget", "48"}, {"window", "8"}, {"r_max", "3"}, {"m", "2"}}},
      {"stream", {{"name", "streamingllm"}, {"budget", "64"}, {"sink", "4"}}},
      {"h2o", {{"name", "h2o"}, {"budget", "64"}, {"window", "8"}}},
      {"knorm", {{"name", "knorm"}, {"budget", "0.5"}}},
      {"rand", {{"name", "random"}, {"budget", "40"}}},
      {"knorm_dec", {{"name", "knorm"}, {"budget", "0.5"}, {"decode_budget", "80"}, {"decode_evict_chunk", "8"}}},
      // Keeps the whole prompt, then evicts while decoding: its shared prompt blocks are compacted away.
      {"stream_dec", {{"name", "streamingllm"}, {"budget", "4096"}, {"decode_budget", "704"}, {"decode_evict_chunk", "8"}}},
  };
  return s;
}

// Head-adaptive variants (AdaKV), which need a pool of head-wise blocks.
const Specs& head_policy_specs() {
  static const Specs s = [] {
    Specs out = policy_specs();
    out["snap_ada"] = {{"name", "snapkv"}, {"budget", "64"}, {"window", "8"}, {"kernel", "5"}, {"head_budgets", "adaptive"}};
    out["pyr_ada"] = {{"name", "pyramidkv"}, {"budget", "64"}, {"window", "8"}, {"beta", "4"}, {"head_budgets", "adaptive"}};
    out["knorm_ada"] = {{"name", "knorm"}, {"budget", "0.5"}, {"head_budgets", "adaptive"}, {"alpha", "0.5"}};
    out["dyn_ada"] = {{"name", "dynamickv"}, {"budget", "48"}, {"window", "8"}, {"r_max", "3"}, {"m", "2"},
                      {"head_budgets", "adaptive"}};
    return out;
  }();
  return s;
}

std::unique_ptr<PagedKvMemory> make_memory(const DecoderModel& m, int64_t blocks, bool caching,
                                           PrefixCache::KeyFn key_fn = nullptr, int64_t host_tier_bytes = 0,
                                           bool head_blocks = false) {
  const auto& c = m.config();
  KvPoolOptions pool;
  pool.num_kv_heads = c.num_key_value_heads;
  pool.head_dim = c.head_dim;
  pool.num_blocks = blocks * (head_blocks ? c.num_key_value_heads : 1);
  pool.head_blocks = head_blocks;
  auto kv = std::make_unique<PagedKvMemory>(c.num_hidden_layers, pool,
                                            resolve_policies(head_blocks ? head_policy_specs() : policy_specs()));
  if (c.has_local_layers()) kv->set_layer_windows(m.kv_layout().layer_windows);
  if (caching) kv->enable_prefix_cache(m.kv_layout().kv_salt, std::move(key_fn), host_tier_bytes);
  return kv;
}

float max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<float>(); }

// A 640-token document (40 blocks) and a question after it.
constexpr int64_t kDoc = 640, kQuestion = 60;
std::vector<int64_t> doc_and_question(int64_t vocab, int64_t question_salt) {
  auto p = make_prompt(kDoc, 11, vocab);
  const auto q = make_prompt(kQuestion, question_salt, vocab);
  p.insert(p.end(), q.begin(), q.end());
  return p;
}

class PrefixCachingPolicy : public ::testing::TestWithParam<std::string> {};

TEST_P(PrefixCachingPolicy, AHitKeepsAndComputesWhatAMissDoes) {
  const std::string& policy = GetParam();
  float logit_diff = 0, decode_diff = 0;
  for (const std::string name : {"llama-gqa", "llama-kvfew"}) {
    const std::string dir = fixture(name);
    if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/" << name;
    auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
    const int64_t V = model->config().vocab_size, L = model->config().num_hidden_layers;
    const auto first = doc_and_question(V, 1), second = doc_and_question(V, 2);
    const int64_t T = static_cast<int64_t>(second.size()), blocks = 4 * (T / 16 + 3) * L;
    auto cached = make_memory(*model, blocks, true);
    auto plain = make_memory(*model, blocks, false);
    // The first request fills the cache and finishes.
    model->prefill(1, first, *cached, false, policy);
    EXPECT_EQ(cached->prefix_hit(1), 0);
    cached->release(1);
    EXPECT_EQ(cached->blocks_used(), 0) << "cached blocks count as free";
    EXPECT_GT(cached->cache().cached_blocks(), 0);
    // The second starts with the same document. The lookup alone (what a sharded job's rank 0 puts
    // in its plan) finds what the prefill then takes, and a cap below it takes just that much.
    const int64_t looked = cached->prefix_lookup(second, policy);
    cached->begin_prefill(3, T, policy);
    EXPECT_EQ(cached->prefill_tokens(3, 0, second, 32, false), std::min<int64_t>(looked, 32));
    EXPECT_THROW(cached->prefill_tokens(4, 0, second, 32, false), KvError) << "a sequence without KV state";
    cached->release(3);
    const torch::Tensor got = model->prefill(2, second, *cached, false, policy);
    const torch::Tensor want = model->prefill(2, second, *plain, false, policy);
    const int64_t hit = cached->prefix_hit(2);
    EXPECT_EQ(looked, hit) << name;
    if (policy == "h2o") {
      EXPECT_EQ(hit, 0) << "H2O scores with every query: nothing may come from the cache";
    } else if (policy == "snap_w") {
      EXPECT_EQ(hit, (T - 150) / 16 * 16) << "the window's queries are computed";
    } else {
      EXPECT_EQ(hit, kDoc) << name;
    }
    EXPECT_EQ(cached->prefix_queried(2), T);
    logit_diff = std::max(logit_diff, max_diff(got, want));
    EXPECT_EQ(got.argmax(-1).item<int64_t>(), want.argmax(-1).item<int64_t>());
    EXPECT_EQ(cached->prefill_budgets(2), plain->prefill_budgets(2)) << name;
    for (int64_t l = 0; l < L; ++l) {
      EXPECT_TRUE(torch::equal(cached->kept_positions(2, l), plain->kept_positions(2, l))) << name << " layer " << l;
      auto [ka, va] = cached->cache().gather(2, l);
      auto [kb, vb] = plain->cache().gather(2, l);
      EXPECT_LE(std::max(max_diff(ka, kb), max_diff(va, vb)), 1e-4) << name << " layer " << l;
    }
    // A compressing policy decodes from its own compressed blocks: it holds what a miss holds
    // (key norm skips layers 0 and 1, so on a two-layer fixture it keeps everything).
    if (plain->kept_tokens(2) < T * L) {
      EXPECT_EQ(cached->private_blocks(2), plain->blocks_held(2)) << name;
    }
    for (int64_t step = 0; step < 20; ++step) {
      DecodeBatch b{{2}, {T + step}};
      const std::vector<int64_t> tok{second[static_cast<size_t>(step)]};
      decode_diff = std::max(decode_diff, max_diff(model->decode(b, tok, *cached), model->decode(b, tok, *plain)));
    }
    for (int64_t l = 0; l < L; ++l)
      EXPECT_TRUE(torch::equal(cached->kept_positions(2, l), plain->kept_positions(2, l))) << name << " layer " << l;
    cached->cache().check_invariants();
    cached->release(2);
    EXPECT_EQ(cached->blocks_used(), 0);
    cached->cache().check_invariants();
  }
  std::cout << "[ " << policy << " ] max |cached - plain|: last logits " << logit_diff << ", decode logits " << decode_diff
            << "\n";
  EXPECT_LE(logit_diff, 1e-4);
  EXPECT_LE(decode_diff, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(Policies, PrefixCachingPolicy,
                         ::testing::Values("full", "snap", "snap_w", "pyr", "dyn", "stream", "h2o", "knorm", "rand",
                                           "knorm_dec", "stream_dec"));

// Gemma 3's sliding-window layers: the document's blocks of every layer go into the cache before a
// local layer drops the ones its window left, so a later prompt finds the whole document in every
// layer and computes what a miss computes; both then hold only their windows' blocks there. Under
// a compressing policy the global layers keep (and decode over) on a hit what they keep on a miss.
class SlidingWindowPrefix : public ::testing::TestWithParam<std::string> {};

TEST_P(SlidingWindowPrefix, LayersShareTheDocumentAndThenKeepTheirWindow) {
  const std::string& policy = GetParam();
  const std::string dir = fixture("gemma3");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/gemma3";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  const int64_t V = c.vocab_size, L = c.num_hidden_layers;
  const auto first = doc_and_question(V, 1), second = doc_and_question(V, 2);
  const int64_t T = static_cast<int64_t>(second.size()), blocks = 4 * (T / 16 + 3) * L;
  auto cached = make_memory(*model, blocks, true);
  auto plain = make_memory(*model, blocks, false);
  model->prefill(1, first, *cached, false, policy);
  cached->release(1);
  const torch::Tensor got = model->prefill(2, second, *cached, false, policy);
  const torch::Tensor want = model->prefill(2, second, *plain, false, policy);
  EXPECT_EQ(cached->prefix_hit(2), kDoc);
  int64_t compressed = 0;
  for (int64_t l = 0; l < L; ++l)
    if (c.layer_window(l) == 0 && plain->cached_tokens(2, l) < T) ++compressed;
  if (policy == "full") {
    EXPECT_EQ(compressed, 0);
  } else {
    EXPECT_GT(compressed, 0) << "nothing compressed: the test has no power";
  }
  float decode_diff = 0;
  const float logit_diff = max_diff(got, want);
  for (int64_t step = 0; step < 20; ++step) {
    DecodeBatch b{{2}, {T + step}};
    const std::vector<int64_t> tok{second[static_cast<size_t>(step)]};
    decode_diff = std::max(decode_diff, max_diff(model->decode(b, tok, *cached), model->decode(b, tok, *plain)));
    for (int64_t l = 0; l < L; ++l) {
      const int64_t w = c.layer_window(l);
      const auto held = static_cast<int64_t>(cached->cache().layer_blocks(2, l).blocks.size());
      if (w > 0) { EXPECT_LE(held, (w + 15) / 16 + 1) << "layer " << l; }
      if (w == 0 && policy == "full") { EXPECT_EQ(cached->cached_tokens(2, l), T + step + 1); }
      EXPECT_TRUE(torch::equal(cached->kept_positions(2, l), plain->kept_positions(2, l))) << "layer " << l;
    }
  }
  std::cout << "[ " << policy << " ] max |cached - plain|: last logits " << logit_diff << ", decode logits " << decode_diff
            << ", compressed global layers " << compressed << "\n";
  EXPECT_LE(logit_diff, 1e-4);
  EXPECT_LE(decode_diff, 1e-4);
  cached->cache().check_invariants();
  cached->release(2);
  EXPECT_EQ(cached->blocks_used(), 0);
  cached->cache().check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Policies, SlidingWindowPrefix, ::testing::Values("full", "snap", "pyr", "stream", "knorm"));

// The head-wise layout (one KV head per block, a table per (layer, head)): per-layer policies
// compute what they compute in the per-layer layout, and every policy, head-adaptive ones
// included, keeps and computes on a prefix hit what it does on a miss.
class HeadWiseLayout : public ::testing::TestWithParam<std::string> {};

TEST_P(HeadWiseLayout, AHitKeepsAndComputesWhatAMissDoes) {
  const std::string& policy = GetParam();
  const bool adaptive = policy.find("_ada") != std::string::npos;
  for (const std::string name : {"llama-gqa", "llama-kvfew"}) {
    const std::string dir = fixture(name);
    if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/" << name;
    auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
    const int64_t V = model->config().vocab_size, L = model->config().num_hidden_layers;
    const auto first = doc_and_question(V, 1), second = doc_and_question(V, 2);
    const int64_t T = static_cast<int64_t>(second.size()), blocks = 4 * (T / 16 + 3) * L;
    auto cached = make_memory(*model, blocks, true, nullptr, 0, true);
    auto plain = make_memory(*model, blocks, false, nullptr, 0, true);
    auto per_layer = adaptive ? nullptr : make_memory(*model, blocks, false);
    model->prefill(1, first, *cached, false, policy);
    cached->release(1);
    EXPECT_EQ(cached->blocks_used(), 0);
    const torch::Tensor got = model->prefill(2, second, *cached, false, policy);
    const torch::Tensor want = model->prefill(2, second, *plain, false, policy);
    EXPECT_EQ(cached->prefix_hit(2), kDoc) << name;
    EXPECT_LE(max_diff(got, want), 1e-4) << name;
    if (per_layer) { EXPECT_LE(max_diff(model->prefill(2, second, *per_layer, false, policy), want), 1e-5) << name; }
    bool ragged = false;
    for (int64_t l = 0; l < L; ++l) {
      EXPECT_TRUE(torch::equal(cached->kept_positions(2, l), plain->kept_positions(2, l))) << name << " layer " << l;
      if (per_layer) { EXPECT_TRUE(torch::equal(per_layer->kept_positions(2, l), plain->kept_positions(2, l))); }
      ragged = ragged || !plain->cache().uniform(2, l);
    }
    const bool compressed = plain->kept_tokens(2) < T * L;
    // One KV head (llama-kvfew) has nothing to spread a budget over.
    EXPECT_EQ(ragged, adaptive && compressed && model->config().num_key_value_heads > 1) << name;
    // A compressing policy decodes from blocks of its own: it holds what a miss holds.
    if (compressed) { EXPECT_EQ(cached->private_blocks(2), plain->blocks_held(2)) << name; }
    if (per_layer) { EXPECT_EQ(per_layer->cache().bytes_of(2), plain->cache().bytes_of(2)); }
    float decode_diff = 0;
    for (int64_t step = 0; step < 20; ++step) {
      DecodeBatch b{{2}, {T + step}};
      const std::vector<int64_t> tok{second[static_cast<size_t>(step)]};
      const auto want_step = model->decode(b, tok, *plain);
      decode_diff = std::max(decode_diff, max_diff(model->decode(b, tok, *cached), want_step));
      if (per_layer) decode_diff = std::max(decode_diff, max_diff(model->decode(b, tok, *per_layer), want_step));
    }
    EXPECT_LE(decode_diff, 1e-4) << name;
    cached->cache().check_invariants();
    plain->cache().check_invariants();
    cached->release(2);
    plain->release(2);
    EXPECT_EQ(cached->blocks_used(), 0);
    EXPECT_EQ(plain->blocks_used(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, HeadWiseLayout,
                         ::testing::Values("full", "snap", "pyr", "knorm", "snap_ada", "pyr_ada", "knorm_ada", "dyn_ada"));

TEST(PrefixCaching, RequestsShareTheCachedBlocksWhileTheyDecode) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size, L = model->config().num_hidden_layers;
  auto kv = make_memory(*model, 600, true);
  const auto a = doc_and_question(V, 1), b = doc_and_question(V, 2);
  model->prefill(1, a, *kv);
  const int64_t one = kv->blocks_used();
  model->prefill(2, b, *kv);
  EXPECT_EQ(kv->prefix_hit(2), kDoc);
  // The second request added only its question's blocks.
  EXPECT_EQ(kv->blocks_used() - one, (static_cast<int64_t>(b.size()) / 16 + 1 - kDoc / 16) * L);
  // Its full blocks are all cached now (the document's, and its own question's): only the partial
  // last block is its alone.
  EXPECT_EQ(kv->private_blocks(2), L);
  const int64_t T = static_cast<int64_t>(a.size());
  for (int64_t step = 0; step < 40; ++step) {  // across a block boundary: decode never writes a shared block
    model->decode(DecodeBatch{{1, 2}, {T + step, T + step}}, {a[static_cast<size_t>(step)], b[static_cast<size_t>(step)]}, *kv);
  }
  kv->cache().check_invariants();
  kv->release(1);
  EXPECT_EQ(kv->prefix_hit(1), 0);
  kv->cache().check_invariants();
  kv->release(2);
  EXPECT_EQ(kv->blocks_used(), 0);
  // The first prompt's full blocks, and the second's after the shared document.
  EXPECT_EQ(kv->cache().cached_blocks(), (T / 16 + T / 16 - kDoc / 16) * L);
  kv->cache().check_invariants();
}

TEST(PrefixCaching, AdmissionCountsOnlyTheBlocksAFullPromptAdds) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size, L = model->config().num_hidden_layers;
  auto kv = make_memory(*model, 600, true);
  const auto a = doc_and_question(V, 1), b = doc_and_question(V, 2), c = doc_and_question(V, 3);
  const std::vector<int64_t> none, first{1};
  model->prefill(1, a, *kv);
  const int64_t shared = kv->shared_prefix_blocks(b, "full", none);
  EXPECT_EQ(shared, kDoc / 16 * L);
  EXPECT_EQ(kv->shared_prefix_blocks(b, "full", first), 0);  // its only user is released first
  EXPECT_EQ(kv->shared_prefix_blocks(b, "snap", none), 0);   // a compressing prompt holds its own blocks
  const int64_t before = kv->blocks_used();
  model->prefill(2, b, *kv);
  // What the second prompt took: its whole prompt's blocks less the shared ones.
  EXPECT_EQ(kv->blocks_used() - before, (static_cast<int64_t>(b.size()) / 16 + 1) * L - shared);
  kv->release(1);
  EXPECT_EQ(kv->shared_prefix_blocks(c, "full", none), kDoc / 16 * L);  // the second still uses the document
  kv->release(2);
  // Idle now: a prompt that pins these blocks takes them from the reclaimable ones, so they count.
  EXPECT_EQ(kv->shared_prefix_blocks(c, "full", none), 0);
  kv->cache().check_invariants();
}

TEST(PrefixCaching, CachedBlocksAreReclaimedBeforeAnAllocationFails) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size, L = model->config().num_hidden_layers;
  const int64_t pool = (kDoc / 16 + kQuestion / 16 + 2) * L;
  auto kv = make_memory(*model, pool, true);
  model->prefill(1, doc_and_question(V, 1), *kv);
  kv->release(1);
  const int64_t cached = kv->cache().cached_blocks();
  EXPECT_GT(cached, 0);
  // An unrelated prompt that needs most of the pool evicts the cached document.
  const auto other = make_prompt(kDoc, 99, V);
  model->prefill(2, other, *kv);
  EXPECT_EQ(kv->prefix_hit(2), 0);
  EXPECT_LT(kv->cache().cached_blocks() - (kDoc / 16) * L, cached);
  kv->cache().check_invariants();
  kv->release(2);
  kv->cache().check_invariants();
}

TEST(PrefixCaching, AFailedPrefillReleasesItsReferences) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size, L = model->config().num_hidden_layers;
  // Room for the document and a short question, not for a long one.
  auto kv = make_memory(*model, (kDoc / 16 + kQuestion / 16 + 2) * L, true);
  model->prefill(1, doc_and_question(V, 1), *kv);
  kv->release(1);
  auto longer = make_prompt(kDoc, 11, V);
  const auto q = make_prompt(400, 3, V);
  longer.insert(longer.end(), q.begin(), q.end());
  EXPECT_THROW(model->prefill(2, longer, *kv), std::exception);
  kv->cache().check_invariants();
  EXPECT_EQ(kv->blocks_used(), 0) << "the hit's entries are reclaimable again";
  // A chunked prefill cancelled after its first chunk (the engine releases it) lets go as well.
  const auto again = doc_and_question(V, 5);
  const std::span<const int64_t> all(again);
  model->prefill_batch({PrefillInput{3, all.subspan(0, kDoc + 20), "", 0, static_cast<int64_t>(again.size())}}, *kv);
  EXPECT_EQ(kv->prefix_hit(3), kDoc);
  kv->release(3);
  EXPECT_EQ(kv->blocks_used(), 0);
  kv->cache().check_invariants();
}

TEST(PrefixCaching, AKeyCollisionRecomputesInsteadOfAliasing) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size;
  // Every block's key depends on its position in the prompt only: two documents collide everywhere.
  auto kv = make_memory(*model, 2000, true, [](uint64_t parent, std::span<const int64_t>) { return parent * 31 + 7; });
  auto plain = make_memory(*model, 2000, false);
  model->prefill(1, make_prompt(kDoc, 1, V), *kv);
  kv->release(1);
  const auto other = make_prompt(kDoc, 2, V);
  const torch::Tensor got = model->prefill(2, other, *kv);
  EXPECT_EQ(kv->prefix_hit(2), 0);
  EXPECT_LE(max_diff(got, model->prefill(2, other, *plain)), 1e-4);
  kv->cache().check_invariants();
}

TEST(PrefixCaching, EveryPositionsLogitsMeanNoReuse) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size;
  auto kv = make_memory(*model, 1000, true);
  const auto p = doc_and_question(V, 1);
  model->prefill(1, p, *kv);
  kv->release(1);
  const torch::Tensor all = model->prefill(2, p, *kv, /*all_logits=*/true);
  EXPECT_EQ(all.size(0), static_cast<int64_t>(p.size()));
  EXPECT_EQ(kv->prefix_hit(2), 0);
}

TEST(PrefixCaching, TheRunnerReportsLookupsAndACompressingPolicyCopiesOnlyWhenAllowed) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size;
  LocalRunner runner(model, make_memory(*model, 2000, true));
  SamplingParams greedy;
  greedy.temperature = 0;
  auto work = [&](int64_t id, const std::vector<int64_t>& p, bool keep_copy) {
    PrefillWork w;
    w.seq_id = id;
    w.tokens = p;
    w.policy = "snap";
    w.keep_copy = keep_copy;
    return w;
  };
  const auto a = doc_and_question(V, 1), b = doc_and_question(V, 2), c = doc_and_question(V, 3);
  StepPlan s1;
  s1.start = {{1, greedy, a, 0, {}}};
  s1.prefill = {work(1, a, false)};
  const StepResult r1 = runner.execute(s1);
  EXPECT_EQ(r1.prefilled.at(0).queried_tokens, static_cast<int64_t>(a.size()));
  EXPECT_EQ(r1.prefilled.at(0).cached_tokens, 0);
  EXPECT_EQ(r1.shards.at(0).blocks_cached, 0) << "no room reserved for a copy: nothing cached";
  StepPlan s2;
  s2.release = {1};
  s2.start = {{2, greedy, b, 0, {}}};
  s2.prefill = {work(2, b, true)};
  const StepResult r2 = runner.execute(s2);
  EXPECT_EQ(r2.prefilled.at(0).cached_tokens, 0);
  EXPECT_GT(r2.shards.at(0).blocks_cached, 0);
  EXPECT_GT(r2.shards.at(0).cached_bytes, 0);
  StepPlan s3;
  s3.start = {{3, greedy, c, 0, {}}};
  s3.prefill = {work(3, c, true)};
  const StepResult r3 = runner.execute(s3);
  EXPECT_EQ(r3.prefilled.at(0).cached_tokens, kDoc);
  ASSERT_TRUE(r3.prefilled.at(0).first.has_value());
  auto plain = make_memory(*model, 2000, false);
  EXPECT_EQ(r3.prefilled[0].first->token, model->prefill(3, c, *plain, false, "snap")[0].argmax().item<int64_t>());
}

// The host-RAM tier (cache.prefix_cache_bytes): a pool with room for about one request. The
// document's cached blocks are moved to the tier when an unrelated prompt needs the pool, and the
// next question on the document is served from the tier with the logits, kept positions, K/V and
// decode of a run without any cache.
class HostTier : public ::testing::TestWithParam<std::string> {};

TEST_P(HostTier, ADocumentMovedToTheHostComesBackExact) {
  // "head:<policy>" and the head-adaptive policies run on a pool of head-wise blocks.
  std::string policy = GetParam();
  const bool head = policy.rfind("head:", 0) == 0 || policy.find("_ada") != std::string::npos;
  if (policy.rfind("head:", 0) == 0) policy = policy.substr(5);
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const auto& c = model->config();
  const int64_t V = c.vocab_size, L = c.num_hidden_layers;
  const auto first = doc_and_question(V, 1), second = doc_and_question(V, 2);
  const auto other = make_prompt(kDoc + kQuestion, 77, V);
  const int64_t T = static_cast<int64_t>(second.size());
  // One request's prompt with its cache copies and a cached hit's peak, not two cached prompts.
  const int64_t pool = (T / 16 + 12) * L;
  const int64_t entry = KvBlockPool::bytes_per_block(c.num_key_value_heads, 16, c.head_dim, torch::kFloat32) * L;
  auto kv = make_memory(*model, pool, true, nullptr, 3 * (T / 16) * entry, head);
  auto plain = make_memory(*model, pool, false, nullptr, 0, head);
  const HostKvTier* tier = kv->cache().host_tier();
  ASSERT_NE(tier, nullptr);
  model->prefill(1, first, *kv, false, policy);
  kv->release(1);
  const PrefixCache* pc = kv->cache().prefix_cache();
  ASSERT_GT(pc->num_entries(), 0);
  EXPECT_EQ(pc->host_entries(), 0);
  model->prefill(2, other, *kv, false, policy);
  EXPECT_EQ(kv->prefix_hit(2), 0);
  kv->release(2);
  EXPECT_GT(pc->host_entries(), 0) << "the document went to the tier, not away";
  EXPECT_GT(tier->stores(), 0);
  EXPECT_EQ(kv->cache().cached_blocks(), (pc->num_entries() - pc->host_entries()) * L * kv->cache().lanes());
  kv->cache().check_invariants();
  const int64_t loads = tier->loads();
  const torch::Tensor got = model->prefill(3, second, *kv, false, policy);
  const torch::Tensor want = model->prefill(3, second, *plain, false, policy);
  EXPECT_EQ(kv->prefix_hit(3), kDoc);
  EXPECT_GT(tier->loads(), loads) << "the hit came from the tier";
  EXPECT_LE(max_diff(got, want), 1e-4);
  EXPECT_EQ(kv->prefill_budgets(3), plain->prefill_budgets(3));
  for (int64_t l = 0; l < L; ++l) {
    EXPECT_TRUE(torch::equal(kv->kept_positions(3, l), plain->kept_positions(3, l))) << "layer " << l;
    if (!plain->cache().uniform(3, l)) continue;  // ragged heads: their K/V are checked by the decode below
    auto [ka, va] = kv->cache().gather(3, l);
    auto [kb, vb] = plain->cache().gather(3, l);
    EXPECT_LE(std::max(max_diff(ka, kb), max_diff(va, vb)), 1e-4) << "layer " << l;
  }
  float decode_diff = 0;
  for (int64_t step = 0; step < 20; ++step) {
    DecodeBatch b{{3}, {T + step}};
    const std::vector<int64_t> tok{second[static_cast<size_t>(step)]};
    decode_diff = std::max(decode_diff, max_diff(model->decode(b, tok, *kv), model->decode(b, tok, *plain)));
  }
  EXPECT_LE(decode_diff, 1e-4);
  kv->cache().check_invariants();
  kv->release(3);
  EXPECT_EQ(kv->blocks_used(), 0);
  kv->cache().check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Policies, HostTier, ::testing::Values("full", "snap", "pyr", "dyn", "stream", "knorm", "head:full",
                                                                "head:snap", "snap_ada", "knorm_ada"));

TEST(HostTier, ATierTooSmallForOneCachedBlockIsRefused) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  try {
    make_memory(*model, 100, true, nullptr, 100);
    FAIL() << "no error";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("cache.prefix_cache_bytes"), std::string::npos) << e.what();
  }
}

// prefix_reuse: compressed. A finished request's KV stays parked; the next turn's prompt, which
// extends it, takes it over and prefills only its new tokens, attending to what the first turn
// kept. The reference feeds those tokens one by one through decode steps onto the first request's
// KV: the paged decode kernel instead of the chunk's attention, the same kept positions.
class ConversationReuse : public ::testing::TestWithParam<std::string> {};

TEST_P(ConversationReuse, TheNextTurnContinuesFromWhatTheFirstKept) {
  const std::string& policy = GetParam();
  const std::string dir = fixture("llama-kvfew");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-kvfew";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size, L = model->config().num_hidden_layers;
  const auto first = doc_and_question(V, 1);
  const auto answer = make_prompt(6, 21, V), turn = make_prompt(40, 22, V);
  const int64_t T = static_cast<int64_t>(first.size());
  auto kv = make_memory(*model, 4000, true);
  auto ref = make_memory(*model, 4000, false);
  // Turn 1 in both: the prompt, then five of the answer's six tokens fed (the last is never fed).
  for (auto* m : {kv.get(), ref.get()}) {
    model->prefill(1, first, *m, false, policy);
    for (int64_t i = 0; i < 5; ++i) model->decode(DecodeBatch{{1}, {T + i}}, {answer[static_cast<size_t>(i)]}, *m);
  }
  const int64_t compressed = kv->kept_tokens(1);
  ASSERT_LT(compressed, (T + 5) * L) << "turn 1 compressed";
  kv->park(1);
  EXPECT_TRUE(kv->parked(1));
  kv->cache().check_invariants();
  // Turn 2's prompt: turn 1's, the whole answer, the new turn.
  std::vector<int64_t> second = first;
  second.insert(second.end(), answer.begin(), answer.end());
  second.insert(second.end(), turn.begin(), turn.end());
  const int64_t covered = T + 5, N = static_cast<int64_t>(second.size());
  PrefillInput in{2, second, policy};
  in.resume = {1, covered};
  const torch::Tensor got = model->prefill_batch({in}, *kv);
  EXPECT_EQ(kv->prefix_hit(2), covered);
  EXPECT_FALSE(kv->cache().has_sequence(1)) << "the parked KV became sequence 2's";
  EXPECT_EQ(kv->kept_tokens(2), compressed + (N - covered) * L) << "the new positions are added whole";
  torch::Tensor want;
  for (int64_t p = covered; p < N; ++p)
    want = model->decode(DecodeBatch{{1}, {p}}, {second[static_cast<size_t>(p)]}, *ref);
  EXPECT_LE(max_diff(got, want), 1e-4) << policy;
  for (int64_t l = 0; l < L; ++l)
    EXPECT_TRUE(torch::equal(kv->kept_positions(2, l), ref->kept_positions(1, l))) << policy << " layer " << l;
  // Both decode on alike, and turn 2 may be parked in its turn.
  float decode_diff = 0;
  for (int64_t i = 0; i < 10; ++i) {
    const std::vector<int64_t> tok{turn[static_cast<size_t>(i)]};
    decode_diff = std::max(decode_diff, max_diff(model->decode(DecodeBatch{{2}, {N + i}}, tok, *kv),
                                                 model->decode(DecodeBatch{{1}, {N + i}}, tok, *ref)));
  }
  EXPECT_LE(decode_diff, 1e-4) << policy;
  kv->park(2);
  kv->cache().check_invariants();
  kv->release(2);
  EXPECT_EQ(kv->blocks_used(), 0);
  kv->cache().check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Policies, ConversationReuse, ::testing::Values("snap", "pyr", "dyn", "knorm"));

TEST(ConversationReuse, OnlyAFinishedPrefillParksAndOnlyAParkedSequenceResumes) {
  const std::string dir = fixture("llama-gqa");
  if (dir.empty()) GTEST_SKIP() << "no $KVSERVE_FIXTURES/llama-gqa";
  auto model = DecoderModel::load(dir, LoadOptions{"cpu", "", false});
  const int64_t V = model->config().vocab_size;
  auto kv = make_memory(*model, 2000, true);
  const auto p = doc_and_question(V, 1);
  const std::span<const int64_t> all(p);
  // Mid-way through a chunked prefill there is nothing whole to park.
  model->prefill_batch({PrefillInput{1, all.subspan(0, 100), "snap", 0, static_cast<int64_t>(p.size())}}, *kv);
  EXPECT_THROW(kv->park(1), KvError);
  kv->release(1);
  model->prefill(2, p, *kv, false, "snap");
  std::vector<int64_t> longer = p;
  longer.push_back(5);
  // Resuming a sequence that was never parked, or under another policy, is refused.
  PrefillInput in{3, longer, "snap"};
  in.resume = {2, static_cast<int64_t>(p.size())};
  EXPECT_THROW(model->prefill_batch({in}, *kv), KvError);
  kv->park(2);
  PrefillInput other{4, longer, "pyr"};
  other.resume = {2, static_cast<int64_t>(p.size())};
  EXPECT_THROW(model->prefill_batch({other}, *kv), KvError);
  EXPECT_TRUE(kv->parked(2)) << "a refused resume leaves the parked KV alone";
  kv->cache().check_invariants();
  kv->release(2);
  EXPECT_EQ(kv->blocks_used(), 0);
}

}  // namespace
}  // namespace kvserve
