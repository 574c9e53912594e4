// Sliding-window (local) layers on a real paged pool: the layer is a ring of blocks, never more
// than ceil(window / block_size) + 1 per sequence from the end of its prefill on, through a
// 4K-token generation, while its decode attention equals softmax attention over the last `window`
// positions; global layers beside it keep everything, or what a compressing policy keeps of them.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cache_manager/paged_kv_memory.h"
#include "common/check.h"
#include "policies/prefill_selector.h"
#include "policies/pyramid_budget.h"

namespace kvserve {
namespace {

constexpr int64_t kKv = 2, kG = 2, kD = 16, kBs = 16;

// Attention of q [H, D] over the last `window` of keys/values [KV, n, D] (window 0: all), fp64.
torch::Tensor window_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t window) {
  const int64_t n = k.size(1), lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
  auto qg = q.to(torch::kFloat64).view({kKv, kG, kD});
  auto kk = k.narrow(1, lo, n - lo).to(torch::kFloat64), vv = v.narrow(1, lo, n - lo).to(torch::kFloat64);
  auto p = torch::softmax(torch::matmul(qg, kk.transpose(1, 2)) / std::sqrt(static_cast<double>(kD)), -1);
  return torch::matmul(p, vv).reshape({kKv * kG, kD});
}

struct Run {
  std::vector<int64_t> windows;
  int64_t prompt = 0;
  int64_t chunk = 0;  // > 0: the prompt arrives in chunks of this size
  int64_t steps = 0;
  bool prefix_caching = false;
};

void run(const Run& r) {
  const int64_t L = static_cast<int64_t>(r.windows.size());
  KvPoolOptions pool;
  pool.num_kv_heads = kKv;
  pool.head_dim = kD;
  pool.block_size = kBs;
  pool.num_blocks = L * ((r.prompt + r.steps) / kBs + 4);
  PagedKvMemory kv(L, pool, resolve_policies({}));
  kv.set_layer_windows(r.windows);
  if (r.prefix_caching) kv.enable_prefix_cache(7);
  auto bound = [&](int64_t w) { return (w + kBs - 1) / kBs + 1; };
  torch::manual_seed(5);
  // Every position's K/V per layer, as written: the reference attends over their last `window`.
  std::vector<torch::Tensor> keys(static_cast<size_t>(L)), values(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    keys[static_cast<size_t>(l)] = torch::randn({kKv, r.prompt, kD});
    values[static_cast<size_t>(l)] = torch::randn({kKv, r.prompt, kD});
  }
  std::vector<int64_t> tokens(static_cast<size_t>(r.prompt));
  for (int64_t i = 0; i < r.prompt; ++i) tokens[static_cast<size_t>(i)] = i % 97;
  kv.begin_prefill(1, r.prompt, "full");
  const int64_t chunk = r.chunk > 0 ? r.chunk : r.prompt;
  for (int64_t start = 0; start < r.prompt; start += chunk) {
    const int64_t n = std::min(chunk, r.prompt - start);
    kv.prefill_tokens(1, start, std::span<const int64_t>(tokens).subspan(static_cast<size_t>(start), static_cast<size_t>(n)),
                      KvMemory::kNoLookup, false);
    for (int64_t l = 0; l < L; ++l) {
      auto q = torch::randn({kKv * kG, n, kD});
      auto k = keys[static_cast<size_t>(l)].narrow(1, start, n), v = values[static_cast<size_t>(l)].narrow(1, start, n);
      if (r.chunk > 0) {
        if (r.windows[static_cast<size_t>(l)] > 0 && start > 0) {
          // What a later chunk's queries read: the positions right before it, the window's at least.
          const torch::Tensor pk = kv.prefill_context(1, l).k;
          const int64_t held = pk.size(1);
          ASSERT_GE(held, std::min(start, r.windows[static_cast<size_t>(l)] - 1));
          EXPECT_TRUE(torch::equal(pk, keys[static_cast<size_t>(l)].narrow(1, start - held, held)));
        }
        kv.store_prefill_chunk(1, l, start, q, k, v);
        if (!r.prefix_caching && r.windows[static_cast<size_t>(l)] > 0) {
          EXPECT_LE(kv.cache().layer_blocks(1, l).blocks.size(), bound(r.windows[static_cast<size_t>(l)]))
              << "after the chunk at " << start;
        }
      } else {
        kv.store_prefill(1, l, q, k, v);
      }
    }
  }
  kv.end_prefill(1);
  int64_t most = 0;
  double worst = 0;
  for (int64_t t = 0; t < r.steps; ++t) {
    const int64_t pos = r.prompt + t;
    DecodeBatch b{{1}, {pos}};
    kv.begin_decode(b);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t w = r.windows[static_cast<size_t>(l)];
      auto q = torch::randn({1, kKv * kG, kD}), k = torch::randn({1, kKv, kD}), v = torch::randn({1, kKv, kD});
      auto& ks = keys[static_cast<size_t>(l)];
      auto& vs = values[static_cast<size_t>(l)];
      ks = torch::cat({ks, k[0].unsqueeze(1)}, 1);
      vs = torch::cat({vs, v[0].unsqueeze(1)}, 1);
      auto out = kv.decode_attention(l, b, q, k, v);
      if (t % 61 == 0 || t + 1 == r.steps)
        worst = std::max(worst, (out[0].to(torch::kFloat64) - window_reference(q[0], ks, vs, w)).abs().max().item<double>());
      const int64_t held = static_cast<int64_t>(kv.cache().layer_blocks(1, l).blocks.size());
      if (w > 0) {
        most = std::max(most, held);
        ASSERT_LE(held, bound(w)) << "layer " << l << " at position " << pos;
        // Its slots are the latest positions, oldest first.
        auto p = kv.kept_positions(1, l);
        ASSERT_EQ(p[0][p.size(1) - 1].item<int64_t>(), pos);
        ASSERT_GE(p.size(1), std::min(pos + 1, w));
      } else {
        ASSERT_EQ(kv.cached_tokens(1, l), pos + 1);
      }
    }
    if (t % 512 == 0) kv.cache().check_invariants();
  }
  std::cout << "most blocks in a local layer " << most << ", max |decode - reference| " << worst << "\n";
  EXPECT_LE(worst, 1e-5);
  kv.release(1);
  kv.cache().check_invariants();
  if (!r.prefix_caching) { EXPECT_EQ(kv.blocks_used(), 0); }
}

TEST(SlidingWindowMemory, LocalLayersStayWithinTheirBlocksOverA4KGeneration) {
  run({{24, 0, 24, 0}, 100, 0, 4096});
}

TEST(SlidingWindowMemory, WindowsShorterThanLongerThanAndEqualToABlock) {
  run({{12, 16, 17, 1, 0}, 40, 0, 300});
}

TEST(SlidingWindowMemory, ChunkedPrefillTrimsAfterEveryChunk) {
  run({{24, 0, 12}, 333, 50, 200});
}

TEST(SlidingWindowMemory, WithAPrefixCacheThePromptIsPublishedBeforeItsBlocksGo) {
  run({{24, 0, 12}, 333, 64, 200, true});
}

// Attention of q [H, D] over the keys/values [KV, n, D] at per-KV-head positions idx [KV, m], fp64.
torch::Tensor kept_reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& idx) {
  auto g = idx.unsqueeze(-1).expand({kKv, idx.size(1), kD});
  return window_reference(q, k.gather(1, g), v.gather(1, g), 0);
}

// A compressing policy on a memory with local layers: the global layers keep the policy's budget
// (PyramidKV's slope over the global layers only), the local ones keep their window's ring, a
// chunked prefill keeps what a whole one keeps, and decode attends over exactly what is held.
struct CompressedRun {
  std::string policy;
  std::vector<int64_t> global_kept;  // expected per global layer, in order
};

void run_compressed(const CompressedRun& r, int64_t chunk) {
  const std::vector<int64_t> windows{12, 0, 12, 0};
  const int64_t L = 4, T = 100, steps = 40;
  KvPoolOptions pool;
  pool.num_kv_heads = kKv;
  pool.head_dim = kD;
  pool.block_size = kBs;
  pool.num_blocks = L * ((T + steps) / kBs + 4);
  PagedKvMemory kv(L, pool, resolve_policies({{"snap", {{"name", "snapkv"}, {"budget", "16"}, {"window", "4"}, {"kernel", "3"}}},
                                              {"pyr", {{"name", "pyramidkv"}, {"budget", "32"}, {"window", "4"}, {"beta", "4"}}},
                                              {"dyn", {{"name", "dynamickv"}, {"budget", "24"}, {"window", "4"},
                                                       {"update_interval", "1"}}}}));
  kv.set_layer_windows(windows);
  EXPECT_EQ(kv.policy(r.policy).local_layers, (std::vector<int64_t>{0, 2}));
  torch::manual_seed(9);
  std::vector<torch::Tensor> keys, values, queries;
  for (int64_t l = 0; l < L; ++l) {
    keys.push_back(torch::randn({kKv, T, kD}));
    values.push_back(torch::randn({kKv, T, kD}));
    // The last global layer's attention is sharper, so DynamicKV moves budget between the two.
    queries.push_back(torch::randn({kKv * kG, T, kD}) * (l == 3 ? 4.0 : 1.0));
  }
  std::vector<int64_t> tokens(static_cast<size_t>(T));
  for (int64_t i = 0; i < T; ++i) tokens[static_cast<size_t>(i)] = i % 89;
  std::vector<int64_t> global_kept = r.global_kept;
  if (global_kept.empty()) {
    // DynamicKV: what it keeps over a model of the two global layers alone.
    PolicyConfig compact = kv.policy(r.policy);
    compact.local_layers.clear();
    PrefillSelector sel(compact, 2, kKv, T);
    sel.on_layer(0, queries[1], keys[1]);
    sel.on_layer(1, queries[3], keys[3]);
    sel.finish();
    global_kept = sel.budgets();
    EXPECT_NE(global_kept[0], global_kept[1]) << "the budget did not move between the global layers";
  }
  kv.begin_prefill(1, T, r.policy);
  const int64_t c = chunk > 0 ? chunk : T;
  for (int64_t start = 0; start < T; start += c) {
    const int64_t n = std::min(c, T - start);
    kv.prefill_tokens(1, start, std::span<const int64_t>(tokens).subspan(static_cast<size_t>(start), static_cast<size_t>(n)),
                      KvMemory::kNoLookup, false);
    for (int64_t l = 0; l < L; ++l) {
      auto q = queries[l].narrow(1, start, n), k = keys[l].narrow(1, start, n), v = values[l].narrow(1, start, n);
      if (chunk > 0) {
        kv.store_prefill_chunk(1, l, start, q, k, v);
      } else {
        kv.store_prefill(1, l, q, k, v);
      }
    }
  }
  kv.end_prefill(1);
  size_t g = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (windows[static_cast<size_t>(l)] > 0) {
      EXPECT_LE(static_cast<int64_t>(kv.cache().layer_blocks(1, l).blocks.size()), (12 + kBs - 1) / kBs + 1) << "layer " << l;
      continue;
    }
    EXPECT_EQ(kv.cached_tokens(1, l), global_kept[g++]) << r.policy << " layer " << l;
    auto p = kv.kept_positions(1, l);
    for (int64_t h = 0; h < kKv; ++h)  // the window is kept
      EXPECT_EQ(p[h][p.size(1) - 1].item<int64_t>(), T - 1);
  }
  // The positions each global layer keeps, then decode: every layer against its reference.
  std::vector<torch::Tensor> held(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l)
    if (windows[static_cast<size_t>(l)] == 0) held[static_cast<size_t>(l)] = kv.kept_positions(1, l);
  double worst = 0;
  for (int64_t t = 0; t < steps; ++t) {
    DecodeBatch b{{1}, {T + t}};
    kv.begin_decode(b);
    for (int64_t l = 0; l < L; ++l) {
      auto q = torch::randn({1, kKv * kG, kD}), k = torch::randn({1, kKv, kD}), v = torch::randn({1, kKv, kD});
      keys[l] = torch::cat({keys[l], k[0].unsqueeze(1)}, 1);
      values[l] = torch::cat({values[l], v[0].unsqueeze(1)}, 1);
      auto out = kv.decode_attention(l, b, q, k, v)[0].to(torch::kFloat64);
      torch::Tensor want;
      if (windows[static_cast<size_t>(l)] > 0) {
        want = window_reference(q[0], keys[l], values[l], windows[static_cast<size_t>(l)]);
      } else {
        auto& h = held[static_cast<size_t>(l)];
        h = torch::cat({h, torch::full({kKv, 1}, T + t, torch::kInt64)}, 1);
        want = kept_reference(q[0], keys[l], values[l], h);
      }
      worst = std::max(worst, (out - want).abs().max().item<double>());
    }
  }
  EXPECT_LE(worst, 1e-5) << r.policy;
  kv.release(1);
  kv.cache().check_invariants();
  EXPECT_EQ(kv.blocks_used(), 0);
}

TEST(SlidingWindowMemory, CompressingPoliciesCompressTheGlobalLayersOnly) {
  const auto pyr = pyramid_budgets_paper(100, 32, 4, 4, 2);  // a pyramid over the two global layers
  EXPECT_GT(pyr[0], pyr[1]);
  for (int64_t chunk : {int64_t{0}, int64_t{30}}) {
    run_compressed({"snap", {16, 16}}, chunk);
    run_compressed({"pyr", pyr}, chunk);
  }
  run_compressed({"dyn", {}}, 0);  // DynamicKV moves the budget between the global layers alone
}

// kvzip on a memory with local layers: every layer holds its whole prompt until the reconstruction
// scores arrive; then the global top-k runs over the global layers alone (the local layers' scores
// do not count, however high) and the local layers keep their rings. Under the uniform allocator
// each global layer keeps its own top-k.
TEST(SlidingWindowMemory, ReconstructionScoringSelectsOverTheGlobalLayersOnly) {
  const std::vector<int64_t> windows{12, 0, 12, 0};
  const int64_t L = 4, T = 100, B = 16;
  KvPoolOptions pool;
  pool.num_kv_heads = kKv;
  pool.head_dim = kD;
  pool.block_size = kBs;
  pool.num_blocks = 4 * L * kKv * (T / kBs + 4);
  pool.head_blocks = true;  // kvzip's heads keep different lengths
  PagedKvMemory kv(L, pool, resolve_policies({{"zip", {{"name", "kvzip"}, {"budget", std::to_string(B)}}},
                                              {"zip_uniform", {{"name", "kvzip"}, {"budget", std::to_string(B)},
                                                               {"allocator", "uniform"}, {"head_budgets", "uniform"}}}}));
  kv.set_layer_windows(windows);
  for (const std::string name : {"zip", "zip_uniform"}) {
    torch::manual_seed(13);
    std::vector<torch::Tensor> keys, values, scores;
    for (int64_t l = 0; l < L; ++l) {
      keys.push_back(torch::randn({kKv, T, kD}));
      values.push_back(torch::randn({kKv, T, kD}));
      // The local layers score far above the global ones: a top-k that counted them would take them.
      scores.push_back(torch::rand({kKv, T}) + (windows[static_cast<size_t>(l)] > 0 ? 10.0 : 0.0));
    }
    kv.begin_prefill(1, T, name);
    for (int64_t l = 0; l < L; ++l) kv.store_prefill(1, l, torch::randn({kKv * kG, T, kD}), keys[l], values[l]);
    for (int64_t l = 0; l < L; ++l) EXPECT_EQ(kv.cached_tokens(1, l), T) << name << ": layer " << l << " before the pass";
    ASSERT_NE(kv.pending_selection(1), nullptr);
    kv.select_by_scores(1, scores);
    kv.end_prefill(1);
    // Expected: the top scores (the scorer gave its sinks theirs) over both global layers at once
    // ("zip") or per global layer ("zip_uniform").
    std::vector<std::vector<std::vector<int64_t>>> want(L, std::vector<std::vector<int64_t>>(kKv));
    if (name == "zip") {
      auto flat = torch::cat({scores[1].flatten(), scores[3].flatten()});
      auto idx = std::get<1>(flat.topk(2 * kKv * B)).contiguous();
      for (int64_t i = 0; i < idx.numel(); ++i) {
        const int64_t f = idx.data_ptr<int64_t>()[i], layer = f / (kKv * T) == 0 ? 1 : 3;
        want[layer][(f % (kKv * T)) / T].push_back(f % T);
      }
    } else {
      for (int64_t l : {1, 3}) {
        auto idx = std::get<1>(scores[l].topk(B, 1)).contiguous();
        for (int64_t h = 0; h < kKv; ++h)
          for (int64_t j = 0; j < B; ++j) want[l][h].push_back(idx[h][j].item<int64_t>());
      }
    }
    int64_t held = 0;
    for (int64_t l = 0; l < L; ++l) {
      if (windows[static_cast<size_t>(l)] > 0) {
        for (int64_t h = 0; h < kKv; ++h)
          EXPECT_LE(static_cast<int64_t>(kv.cache().layer_blocks(1, l, h).blocks.size()), (12 + kBs - 1) / kBs + 1)
              << name << ": local layer " << l << " head " << h;
        continue;
      }
      const auto lens = kv.cache().head_lengths(1, l);
      const auto p = kv.kept_positions(1, l);
      for (int64_t h = 0; h < kKv; ++h) {
        std::sort(want[l][h].begin(), want[l][h].end());
        std::vector<int64_t> got;
        for (int64_t j = 0; j < lens[static_cast<size_t>(h)]; ++j) got.push_back(p[h][j].item<int64_t>());
        EXPECT_EQ(got, want[l][h]) << name << ": layer " << l << " head " << h;
        held += lens[static_cast<size_t>(h)];
      }
    }
    EXPECT_EQ(held, 2 * kKv * B) << name;
    kv.release(1);
    kv.cache().check_invariants();
    EXPECT_EQ(kv.blocks_used(), 0);
  }
}

}  // namespace
}  // namespace kvserve
