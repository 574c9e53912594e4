// PagedKvMemory (cache_manager/paged_kv_memory.h) driven directly with random q/k/v, every policy:
// pool accounting at every step, the prefill high-water bound, per-layer budgets, kept K/V equal to
// the prompt's rows at the kept positions (DynamicKV compaction leaves subsets), decode at true
// positions, decode-time eviction, and a pool too small for a request (clear error, others intact).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cache_manager/draft_view.h"
#include "cache_manager/paged_kv_memory.h"
#include "common/check.h"

namespace kvserve {
namespace {

constexpr int64_t kL = 5, kH = 4, kKV = 2, kD = 8, kBS = 4;

using Specs = std::map<std::string, std::map<std::string, std::string>>;

// Every named policy with small budgets (window 4) so that prompts of ~100 tokens compress.
const Specs& all_specs() {
  static const Specs s = {
      {"snap", {{"name", "snapkv"}, {"budget", "24"}, {"window", "4"}, {"kernel", "3"}}},
      {"pyr", {{"name", "pyramidkv"}, {"budget", "24"}, {"window", "4"}, {"beta", "4"}}},
      {"pyr_kvp", {{"name", "pyramidkv"}, {"budget", "0.3"}, {"window", "4"}, {"semantics", "kvpress"}}},
      {"dyn", {{"name", "dynamickv"}, {"budget", "16"}, {"window", "4"}, {"r_max", "3"}, {"m", "2"}}},
      // m = L: one re-budgeting, after the last layer, while every layer holds its candidates.
      {"dyn_one", {{"name", "dynamickv"}, {"budget", "40"}, {"window", "4"}, {"r_max", "2"}, {"m", "5"}}},
      {"stream", {{"name", "streamingllm"}, {"budget", "20"}, {"sink", "2"}}},
      {"h2o", {{"name", "h2o"}, {"budget", "24"}, {"window", "4"}}},
      {"knorm", {{"name", "knorm"}, {"budget", "0.5"}}},
      {"rand", {{"name", "random"}, {"budget", "20"}}},
      {"knorm_dec", {{"name", "knorm"}, {"budget", "0.5"}, {"decode_budget", "40"}, {"decode_evict_chunk", "8"}}},
      {"stream_dec", {{"name", "streamingllm"}, {"budget", "20"}, {"sink", "2"}, {"decode_budget", "24"},
                      {"decode_evict_chunk", "4"}}},
  };
  return s;
}

std::vector<std::string> policy_keys() {
  std::vector<std::string> out = {"full"};
  for (const auto& [k, _] : all_specs()) out.push_back(k);
  return out;
}

KvPoolOptions pool_opts(int64_t blocks) {
  KvPoolOptions o;
  o.num_kv_heads = kKV;
  o.head_dim = kD;
  o.block_size = kBS;
  o.num_blocks = blocks;
  return o;
}

PagedKvMemory make_memory(int64_t blocks) { return PagedKvMemory(kL, pool_opts(blocks), resolve_policies(all_specs())); }

int64_t blocks_for(int64_t tokens) { return (tokens + kBS - 1) / kBS; }

// The scheduler's admission arithmetic (backend/engine/scheduler.cpp) on one memory: the blocks a prompt
// takes at its peak, and whether the pool holds it now or ever.
int64_t prompt_need(const PagedKvMemory& m, int64_t T, const std::string& key) {
  return PagedKvMemory::prompt_blocks(m.policy(key), m.geometry(), T);
}
bool admits_now(const PagedKvMemory& m, int64_t T, const std::string& key) { return prompt_need(m, T, key) <= m.free_blocks(); }
bool fits_when_empty(const PagedKvMemory& m, int64_t T, const std::string& key) {
  return prompt_need(m, T, key) <= m.blocks_total();
}
// ... and whether every listed sequence may decode one more token: the sum of their demands fits.
bool decode_fits(const PagedKvMemory& m, const std::vector<int64_t>& ids) {
  int64_t demand = 0;
  for (int64_t id : ids) demand += m.decode_demand({id});
  return demand <= m.free_blocks();
}

void expect_accounting(const PagedKvMemory& m) {
  ASSERT_EQ(m.blocks_used() + m.cache().free_blocks(), m.blocks_total());
  m.cache().check_invariants();
}

// A prompt's per-layer q/k/v (random, with a few heavy keys so attention is peaky).
struct Prompt {
  std::vector<torch::Tensor> q, k, v;
  int64_t T = 0;
};

Prompt make_prompt(int64_t T, uint64_t seed) {
  torch::manual_seed(seed);
  Prompt p;
  p.T = T;
  for (int64_t l = 0; l < kL; ++l) {
    p.q.push_back(torch::randn({kH, T, kD}));
    auto k = torch::randn({kKV, T, kD});
    auto heavy = torch::randint(0, T, {std::max<int64_t>(1, T / 16)}, torch::kLong);
    k.index_put_({torch::indexing::Slice(), heavy}, k.index({torch::indexing::Slice(), heavy}) * 3.0);
    p.k.push_back(k);
    p.v.push_back(torch::randn({kKV, T, kD}));
  }
  return p;
}

std::set<int64_t> row_set(const torch::Tensor& pos, int64_t h) {
  auto r = pos[h].contiguous();
  return {r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel()};
}

// Prefills `p` layer by layer, checking after every call: accounting; every layer's positions sorted,
// unique, in range, a subset of what it held before (DynamicKV compaction); its K/V rows the prompt's
// rows at those positions.
void prefill_checked(PagedKvMemory& m, int64_t seq, const Prompt& p, const std::string& policy) {
  m.begin_prefill(seq, p.T, policy);
  std::vector<torch::Tensor> held(kL);
  auto check_layers = [&](int64_t upto) {
    for (int64_t l = 0; l <= upto; ++l) {
      auto pos = m.cache().positions(seq, l);
      ASSERT_EQ(pos.size(0), kKV);
      for (int64_t h = 0; h < kKV; ++h) {
        auto row = pos[h];
        if (row.numel() > 1) {
          ASSERT_TRUE((row.slice(0, 1) > row.slice(0, 0, -1)).all().item<bool>())
              << policy << ": layer " << l << " head " << h << " positions not strictly ascending";
        }
        if (row.numel() > 0) {
          ASSERT_GE(row.min().item<int64_t>(), 0);
          ASSERT_LT(row.max().item<int64_t>(), p.T);
        }
        if (held[l].defined()) {
          auto before = row_set(held[l], h);
          for (int64_t x : row_set(pos, h)) {
            ASSERT_TRUE(before.count(x)) << policy << ": layer " << l << " head " << h << " gained position " << x;
          }
        }
      }
      auto [k, v] = m.cache().gather(seq, l);
      auto idx = pos.unsqueeze(-1).expand({kKV, pos.size(1), kD});
      ASSERT_TRUE(torch::equal(k, p.k[l].gather(1, idx))) << policy << ": layer " << l << " keys not the prompt's rows";
      ASSERT_TRUE(torch::equal(v, p.v[l].gather(1, idx))) << policy << ": layer " << l << " values not the prompt's rows";
      held[l] = pos;
    }
  };
  for (int64_t l = 0; l < kL; ++l) {
    m.store_prefill(seq, l, p.q[l], p.k[l], p.v[l]);
    expect_accounting(m);
    check_layers(l);
  }
  m.end_prefill(seq);
  expect_accounting(m);
  check_layers(kL - 1);
}

// One decode step for `seqs` at `positions`: checks the attention output against a dense softmax
// over what each (sequence, layer) holds after the step, and the appended position.
void decode_checked(PagedKvMemory& m, const std::vector<int64_t>& seqs, const std::vector<int64_t>& positions) {
  const int64_t B = static_cast<int64_t>(seqs.size());
  DecodeBatch batch{seqs, positions};
  for (int64_t l = 0; l < kL; ++l) {
    auto q = torch::randn({B, kH, kD}), k = torch::randn({B, kKV, kD}), v = torch::randn({B, kKV, kD});
    auto out = m.decode_attention(l, batch, q, k, v);
    expect_accounting(m);
    ASSERT_EQ(out.sizes(), (std::vector<int64_t>{B, kH, kD}));
    for (int64_t b = 0; b < B; ++b) {
      auto pos = m.cache().positions(seqs[b], l);
      for (int64_t h = 0; h < kKV; ++h) ASSERT_EQ(pos[h][-1].item<int64_t>(), positions[b]);
      auto [kc, vc] = m.cache().gather(seqs[b], l);  // [KV, n, D]
      ASSERT_TRUE(torch::equal(kc.select(1, kc.size(1) - 1), k[b]));
      auto kr = kc.repeat_interleave(kH / kKV, 0), vr = vc.repeat_interleave(kH / kKV, 0);
      auto att = torch::softmax(torch::bmm(q[b].unsqueeze(1), kr.transpose(1, 2)) / std::sqrt(double(kD)), -1);
      auto want = torch::bmm(att, vr).squeeze(1);
      ASSERT_TRUE(torch::allclose(out[b], want, 1e-5, 1e-5)) << "decode attention differs (layer " << l << ")";
    }
  }
}

// PyramidKV's paper budgets (docs/architecture.md, "The methods' arithmetic"), written out again here.
std::vector<int64_t> pyramid_paper(int64_t T, int64_t B, int64_t w, int64_t beta, int64_t L) {
  if (T <= B) return std::vector<int64_t>(L, T);
  const int64_t a = B - w;
  if (T < 2 * a || L == 1) return std::vector<int64_t>(L, a + w);
  int64_t lo = a / beta, hi = 2 * a - lo;
  if (hi >= T - w) {
    hi = T - w;
    lo = 2 * a - hi;
  }
  const int64_t steps = (hi - lo) / (L - 1);
  std::vector<int64_t> out;
  for (int64_t l = 0; l < L; ++l) out.push_back(hi - l * steps + w);
  return out;
}

std::vector<int64_t> lengths(const PagedKvMemory& m, int64_t seq) {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < kL; ++l) out.push_back(m.cached_tokens(seq, l));
  return out;
}

// --------------------------------------------------------------------------------------------------

TEST(PagedKvMemory, AccountingAtEveryStepAndAllFreeAfterRelease) {
  auto m = make_memory(4096);
  const auto keys = policy_keys();
  // Three sequences at a time, different policies and lengths, prefilled then decoded together.
  for (size_t i = 0; i < keys.size(); i += 3) {
    std::vector<int64_t> seqs, pos;
    for (size_t j = i; j < std::min(keys.size(), i + 3); ++j) {
      const int64_t T = 60 + 23 * static_cast<int64_t>(j);
      const int64_t id = static_cast<int64_t>(100 + j);
      prefill_checked(m, id, make_prompt(T, 7 + j), keys[j]);
      if (HasFatalFailure()) return;
      seqs.push_back(id);
      pos.push_back(T);
    }
    for (int step = 0; step < 20; ++step) {
      decode_checked(m, seqs, pos);
      if (HasFatalFailure()) return;
      for (auto& p : pos) ++p;
    }
    for (int64_t id : seqs) {
      m.release(id);
      expect_accounting(m);
    }
    EXPECT_EQ(m.blocks_used(), 0) << "blocks leaked after policies " << keys[i] << "...";
  }
  EXPECT_EQ(m.cache().free_blocks(), m.blocks_total());
}

TEST(PagedKvMemory, BudgetsPerLayer) {
  for (int64_t T : {3, 16, 24, 25, 40, 97, 160}) {
    for (const auto& key : policy_keys()) {
      auto m = make_memory(4096);
      prefill_checked(m, 1, make_prompt(T, 1000 + T), key);
      if (HasFatalFailure()) return;
      const auto got = lengths(m, 1);
      EXPECT_EQ(got, m.prefill_budgets(1)) << key << " T=" << T;
      const std::string ctx = key + " T=" + std::to_string(T);
      for (int64_t n : got) ASSERT_LE(n, T) << ctx;
      const std::vector<int64_t> whole(kL, T);
      if (key == "full") {
        EXPECT_EQ(got, whole) << ctx;
      } else if (key == "snap" || key == "h2o" || key == "rand" || key == "stream" || key == "stream_dec") {
        const int64_t B = key == "snap" || key == "h2o" ? 24 : 20;
        EXPECT_EQ(got, std::vector<int64_t>(kL, std::min(T, B))) << ctx;
      } else if (key == "pyr") {
        EXPECT_EQ(got, pyramid_paper(T, 24, 4, 4, kL)) << ctx;
        if (T > 24) {
          // The authors' floored steps may overshoot the total by at most L(L-1)/2 + L tokens.
          int64_t sum = 0;
          for (int64_t n : got) sum += n;
          EXPECT_LE(std::abs(sum - 24 * kL), kL * (kL - 1) / 2 + kL) << ctx;
        }
      } else if (key == "pyr_kvp" && T > 4) {
        int64_t sum = 0;
        for (int64_t n : got) sum += n;
        // kvpress's pyramid: the mean is the ratio of the prompt, up to round() per layer.
        EXPECT_LE(std::abs(double(sum) - 0.3 * T * kL), kL * 0.5 + 1) << ctx;
      } else if (key == "knorm" || key == "knorm_dec") {
        for (int64_t l = 0; l < kL; ++l) {
          EXPECT_EQ(got[l], l < 2 ? T : std::max<int64_t>(1, static_cast<int64_t>(T * 0.5))) << ctx << " layer " << l;
        }
      } else if (key == "dyn" || key == "dyn_one") {
        const PolicyConfig& cfg = m.policy(key);
        if (T <= cfg.budget) {
          EXPECT_EQ(got, whole) << ctx;
        } else {
          const int64_t w = cfg.window, base = cfg.budget - w, bs = std::min<int64_t>(cfg.r_max * base, T - w);
          int64_t scored = 0;
          for (int64_t n : got) {
            EXPECT_GE(n, w) << ctx;
            EXPECT_LE(n - w, bs) << ctx;
            scored += n - w;
          }
          EXPECT_LE(scored, base * kL) << ctx << ": DynamicKV exceeds its total budget";
          EXPECT_GE(scored, base * kL - kL) << ctx << ": DynamicKV lost budget beyond rounding";
        }
      }
      m.release(1);
      EXPECT_EQ(m.blocks_used(), 0) << ctx;
    }
  }
}

TEST(PagedKvMemory, PrefillHighWaterBound) {
  const int64_t T = 150;
  const auto p = make_prompt(T, 42);
  for (const auto& key : policy_keys()) {
    auto m = make_memory(4096);
    // Another sequence already resident: its blocks count in the high-water mark too.
    prefill_checked(m, 5, make_prompt(40, 3), "full");
    const int64_t base = m.blocks_used();
    m.cache().reset_high_water();
    prefill_checked(m, 1, p, key);
    if (HasFatalFailure()) return;
    const auto kept = lengths(m, 1);
    int64_t kept_blocks = 0;
    for (int64_t n : kept) kept_blocks += blocks_for(n);
    int64_t candidate_blocks = 0;
    const PolicyConfig& cfg = m.policy(key);
    if (cfg.allocator == AllocatorKind::kDynamic) {
      const auto s = dynamic_sizes(cfg, T);
      candidate_blocks = kL * blocks_for(s.bs + cfg.window);
    }
    const int64_t bound = base + blocks_for(T) + kept_blocks + candidate_blocks;
    EXPECT_LE(m.blocks_high_water(), bound) << key << ": prefill high water above one layer's full KV + kept KV"
                                            << (candidate_blocks ? " + DynamicKV candidates" : "");
    if (cfg.allocator != AllocatorKind::kDynamic) {
      // Only the kept tokens ever enter the pool.
      EXPECT_EQ(m.blocks_high_water(), base + kept_blocks) << key;
    }
    m.release(1);
    m.release(5);
    EXPECT_EQ(m.blocks_used(), 0);
  }
}

// The admission check must admit only prefills that can finish: with a pool exactly as large as
// prompt_blocks asks for, every policy's prefill must succeed (DynamicKV compacts into fresh blocks).
TEST(PagedKvMemory, PrefillFitsInThePoolPromptBlocksAsksFor) {
  for (int64_t T : {40, 150}) {
    for (const auto& key : policy_keys()) {
      int64_t n = 1;
      while (!admits_now(make_memory(n), T, key)) ++n;
      auto m = make_memory(n);
      EXPECT_TRUE(fits_when_empty(m, T, key));
      EXPECT_FALSE(fits_when_empty(make_memory(n - 1), T, key));
      ASSERT_NO_THROW(prefill_checked(m, 1, make_prompt(T, 9), key)) << key << " T=" << T << " pool " << n;
      // ... and the first decoded token fits too (prompt_blocks holds room for it and for one
      // layer's decode-time eviction copy), by the scheduler's arithmetic as well: otherwise it
      // would preempt this lone sequence and admit it again forever. Later steps whenever
      // decode_demand says so.
      EXPECT_TRUE(decode_fits(m, {1})) << key << " T=" << T << ": demand " << m.decode_demand({1}) << " > free "
                                       << m.free_blocks() << " after the prefill";
      ASSERT_NO_THROW(decode_checked(m, {1}, {T})) << key << " T=" << T << " first decode step";
      for (int64_t t = 1; t < 40 && decode_fits(m, {1}); ++t) {
        ASSERT_NO_THROW(decode_checked(m, {1}, {T + t})) << key << " T=" << T << " decode step " << t;
      }
      m.release(1);
      EXPECT_EQ(m.blocks_used(), 0);
    }
  }
}

// The scheduler admits and preempts from prompt_blocks and decode_demand alone (it cannot see a
// sharded job's pools): a pool of prompt_blocks holds the prefill, and a decode step never takes
// more blocks than decode_demand said, for every policy (decode-time eviction included).
TEST(PagedKvMemory, SchedulerArithmeticCoversWhatStepsTake) {
  for (int64_t T : {40, 150}) {
    for (const auto& key : policy_keys()) {
      auto probe = make_memory(1);
      const int64_t need = PagedKvMemory::prompt_blocks(probe.policy(key), probe.geometry(), T);
      auto m = make_memory(need + PagedKvMemory::prompt_blocks(probe.policy("full"), probe.geometry(), T / 4));
      ASSERT_NO_THROW(prefill_checked(m, 1, make_prompt(T, 9), key)) << key << " T=" << T << " pool " << need;
      ASSERT_NO_THROW(prefill_checked(m, 2, make_prompt(T / 4, 3), "full")) << key;
      for (int64_t t = 0; t < 60; ++t) {
        const int64_t demand = m.decode_demand({1, 2});
        if (demand > m.free_blocks()) break;
        const int64_t used = m.blocks_used(), held = m.blocks_held(1) + m.blocks_held(2);
        EXPECT_EQ(held, used) << key;
        ASSERT_NO_THROW(decode_checked(m, {1, 2}, {T + t, T / 4 + t})) << key << " T=" << T << " step " << t;
        EXPECT_LE(m.blocks_used() - used, demand) << key << " T=" << T << " step " << t;
        EXPECT_LE(m.blocks_high_water(), m.blocks_total());
      }
      m.release(1);
      m.release(2);
      EXPECT_EQ(m.blocks_used(), 0);
    }
  }
}

struct Snapshot {
  std::vector<torch::Tensor> pos, k, v;
};

Snapshot snapshot(const PagedKvMemory& m, int64_t seq) {
  Snapshot s;
  for (int64_t l = 0; l < kL; ++l) {
    s.pos.push_back(m.cache().positions(seq, l));
    auto [k, v] = m.cache().gather(seq, l);
    s.k.push_back(k);
    s.v.push_back(v);
  }
  return s;
}

void expect_same(const Snapshot& a, const Snapshot& b, const std::string& what) {
  for (int64_t l = 0; l < kL; ++l) {
    EXPECT_TRUE(torch::equal(a.pos[l], b.pos[l])) << what << ": layer " << l << " positions changed";
    EXPECT_TRUE(torch::equal(a.k[l], b.k[l])) << what << ": layer " << l << " keys changed";
    EXPECT_TRUE(torch::equal(a.v[l], b.v[l])) << what << ": layer " << l << " values changed";
  }
}

TEST(PagedKvMemory, PoolTooSmallIsAClearErrorAndOthersSurvive) {
  // Per layer: a full 40-token prompt + decodes 11 blocks, snap (24 kept + decodes) 7 blocks; 5 layers.
  // After sequences 1 and 2: 90 of 140 blocks used, 50 free.
  auto m = make_memory(140);
  prefill_checked(m, 1, make_prompt(40, 1), "full");
  prefill_checked(m, 2, make_prompt(30, 2), "snap");
  decode_checked(m, {1, 2}, {40, 30});
  const auto s1 = snapshot(m, 1), s2 = snapshot(m, 2);
  const int64_t used = m.blocks_used();

  // Never fits: refused up front.
  EXPECT_FALSE(fits_when_empty(m, 400, "full"));
  EXPECT_FALSE(admits_now(m, 400, "full"));
  // Fits an empty pool but not now.
  EXPECT_TRUE(fits_when_empty(m, 40, "full"));
  EXPECT_FALSE(admits_now(m, 40, "full"));
  // A compressing policy's compressed size fits.
  EXPECT_TRUE(admits_now(m, 400, "snap"));

  // Forced anyway: a KvError naming the problem, thrown before anything changes.
  const auto big = make_prompt(400, 3);
  m.begin_prefill(3, 400, "full");
  try {
    for (int64_t l = 0; l < kL; ++l) m.store_prefill(3, l, big.q[l], big.k[l], big.v[l]);
    FAIL() << "prefill of 400 tokens into a 140-block pool did not throw";
  } catch (const KvError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("KV pool exhausted"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sequence 3"), std::string::npos) << msg;
  }
  expect_accounting(m);
  expect_same(s1, snapshot(m, 1), "sequence 1 after another's failed prefill");
  expect_same(s2, snapshot(m, 2), "sequence 2 after another's failed prefill");
  m.release(3);
  expect_accounting(m);
  EXPECT_EQ(m.blocks_used(), used);
  EXPECT_THROW(m.cached_tokens(3, 0), KvError);

  // The survivors decode on, at their true positions, and the compressed prompt still fits.
  decode_checked(m, {1, 2}, {41, 31});
  prefill_checked(m, 4, big, "snap");
  decode_checked(m, {1, 2, 4}, {42, 32, 400});

  // Decode until the pool runs dry: decode_demand says so first (exactly, without decode-time
  // eviction); a forced step throws and changes nothing.
  std::vector<int64_t> pos = {43, 33, 401};
  while (decode_fits(m, {1, 2, 4})) {
    decode_checked(m, {1, 2, 4}, pos);
    if (HasFatalFailure()) return;
    for (auto& p : pos) ++p;
  }
  // The layer that runs out throws before changing anything (earlier layers of the step appended).
  bool threw = false;
  std::vector<int64_t> lens_before;
  for (int64_t l = 0; l < kL && !threw; ++l) {
    const auto a = snapshot(m, 1), b = snapshot(m, 2), c = snapshot(m, 4);
    const int64_t used_before = m.blocks_used();
    DecodeBatch batch{{1, 2, 4}, pos};
    try {
      m.decode_attention(l, batch, torch::randn({3, kH, kD}), torch::randn({3, kKV, kD}), torch::randn({3, kKV, kD}));
    } catch (const KvError& e) {
      threw = true;
      EXPECT_NE(std::string(e.what()).find("KV pool exhausted"), std::string::npos) << e.what();
      expect_accounting(m);
      EXPECT_EQ(m.blocks_used(), used_before);
      expect_same(a, snapshot(m, 1), "sequence 1 after a failed decode step");
      expect_same(b, snapshot(m, 2), "sequence 2 after a failed decode step");
      expect_same(c, snapshot(m, 4), "sequence 4 after a failed decode step");
    }
  }
  EXPECT_TRUE(threw) << "decode_demand said no, yet the forced step found blocks in every layer";
  const auto a = snapshot(m, 1);
  // Releasing one sequence lets the others go on.
  m.release(2);
  expect_accounting(m);
  EXPECT_TRUE(decode_fits(m, {1, 4}));
  for (int64_t l = 0; l < kL; ++l) EXPECT_EQ(m.cached_tokens(1, l), a.pos[l].size(1));
  m.release(1);
  m.release(4);
  EXPECT_EQ(m.blocks_used(), 0);
  EXPECT_EQ(m.cache().free_blocks(), m.blocks_total());
}

// Self-speculation over a policy's kept set: a prompt kept whole runs the draft policy's selection
// as its prefill ends and keeps everything; each layer's draft view holds the blocks with most of
// what the policy chose (as blocks_of_kept ranks them), the same whether the prompt came whole or in
// chunks whose last one is shorter than the policy's window.
TEST(PagedKvMemory, DraftPolicyChoosesViewBlocksAndDropsNothing) {
  auto m = make_memory(4096);
  m.set_draft_policy("snap", 24, 0, 4);
  const int64_t T = 100;
  const Prompt p = make_prompt(T, 11);
  m.begin_prefill(1, T, "full");
  for (int64_t l = 0; l < kL; ++l) m.store_prefill(1, l, p.q[static_cast<size_t>(l)], p.k[static_cast<size_t>(l)], p.v[static_cast<size_t>(l)]);
  m.end_prefill(1);
  m.begin_prefill(2, T, "full");
  for (auto [start, end] : {std::pair<int64_t, int64_t>{0, 49}, {49, 98}, {98, 100}}) {
    for (int64_t l = 0; l < kL; ++l) {
      const auto& q = p.q[static_cast<size_t>(l)];
      m.store_prefill_chunk(2, l, start, q.narrow(1, start, end - start), p.k[static_cast<size_t>(l)].narrow(1, start, end - start),
                            p.v[static_cast<size_t>(l)].narrow(1, start, end - start));
    }
  }
  m.end_prefill(2);
  PolicyConfig cfg = m.policy("snap");
  cfg.budget = 24;
  PrefillSelector want(cfg, kL, kKV, T);
  for (int64_t l = 0; l < kL; ++l) {
    EXPECT_EQ(m.cache().length(1, l), T);
    const auto expected = blocks_of_kept(want.on_layer(l, p.q[static_cast<size_t>(l)], p.k[static_cast<size_t>(l)]), {}, kBS, 1);
    ASSERT_FALSE(expected.empty());
    EXPECT_LE(expected.size(), 6u);
    EXPECT_GE(expected.front(), 1);  // the sink block is the view's anyway
    const auto* whole = m.cache().draft_blocks(1, l, 0);
    const auto* chunked = m.cache().draft_blocks(2, l, 0);
    ASSERT_TRUE(whole && chunked) << "layer " << l;
    EXPECT_EQ(*whole, expected) << "layer " << l;
    EXPECT_EQ(*chunked, expected) << "layer " << l;
  }
  // A compressing sequence drafts over what it keeps: no draft blocks; nor does a short prompt.
  m.begin_prefill(3, T, "snap");
  for (int64_t l = 0; l < kL; ++l) m.store_prefill(3, l, p.q[static_cast<size_t>(l)], p.k[static_cast<size_t>(l)], p.v[static_cast<size_t>(l)]);
  m.end_prefill(3);
  EXPECT_EQ(m.cache().draft_blocks(3, 0, 0), nullptr);
  m.set_draft_policy("snap", 24, T + 1, 4);
  m.begin_prefill(4, T, "full");
  for (int64_t l = 0; l < kL; ++l) m.store_prefill(4, l, p.q[static_cast<size_t>(l)], p.k[static_cast<size_t>(l)], p.v[static_cast<size_t>(l)]);
  m.end_prefill(4);
  EXPECT_EQ(m.cache().draft_blocks(4, 0, 0), nullptr);
  for (int64_t id : {1, 2, 3, 4}) m.release(id);
  EXPECT_EQ(m.blocks_used(), 0);
  // Policies whose selection cannot run so are refused by name.
  for (const char* bad : {"full", "dyn", "h2o", "nope"}) {
    try {
      m.set_draft_policy(bad, 24, 0, 4);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(m.set_draft_policy("snap", 0, 0, 4), std::exception);
  m.set_draft_policy("pyramidkv", 24, 0, 4);  // not configured: the method with its defaults
}

// With draft_refresh_tokens the draft policy's selection runs again over the whole cache with the
// latest decode queries: here every 4 tokens, window 4. The queries of a verify step's rejected rows
// leave with their K/V, and a draft step (its rows truncated) records none, so the re-scored view is
// a fresh selection over the positions the sequence holds, with the queries of its last 4.
TEST(PagedKvMemory, DraftViewIsChosenAgainFromTheLatestQueries) {
  auto m = make_memory(4096);
  m.set_draft_policy("snap", 24, 0, 4, 4);
  const int64_t T = 100;
  const Prompt p = make_prompt(T, 12);
  m.begin_prefill(1, T, "full");
  for (int64_t l = 0; l < kL; ++l) m.store_prefill(1, l, p.q[static_cast<size_t>(l)], p.k[static_cast<size_t>(l)], p.v[static_cast<size_t>(l)]);
  m.end_prefill(1);
  // Per layer what the sequence holds: queries [H, n, D] and keys [KV, n, D] by position.
  std::vector<torch::Tensor> qs, ks;
  for (int64_t l = 0; l < kL; ++l) {
    qs.push_back(p.q[static_cast<size_t>(l)]);
    ks.push_back(p.k[static_cast<size_t>(l)]);
  }
  torch::manual_seed(13);
  auto step = [&](std::vector<int64_t> positions, bool draft) {
    DecodeBatch b;
    b.seq_ids.assign(positions.size(), 1);
    b.positions = positions;
    if (draft) b.view = DraftView{1, 2};
    const auto R = static_cast<int64_t>(positions.size());
    for (int64_t l = 0; l < kL; ++l) {
      const torch::Tensor q = torch::randn({R, kH, kD}), k = torch::randn({R, kKV, kD});
      m.decode_attention(l, b, q, k, torch::randn({R, kKV, kD}));
      if (draft) continue;
      qs[static_cast<size_t>(l)] = torch::cat({qs[static_cast<size_t>(l)], q.transpose(0, 1)}, 1);
      ks[static_cast<size_t>(l)] = torch::cat({ks[static_cast<size_t>(l)], k.transpose(0, 1)}, 1);
    }
  };
  auto drop = [&](int64_t n) {
    m.truncate(1, n);
    for (auto* v : {&qs, &ks})
      for (auto& t : *v) t = t.narrow(1, 0, t.size(1) - n);
  };
  const std::vector<int32_t> chosen_at_prompt = *m.cache().draft_blocks(1, 3, 0);
  step({100}, false);
  step({101}, false);
  step({102, 103, 104}, false);  // a verify step whose two drafts are rejected
  drop(2);
  step({103}, true);  // 103 - 100 < 4: the prompt's choice stays
  m.truncate(1, 1);
  EXPECT_EQ(*m.cache().draft_blocks(1, 3, 0), chosen_at_prompt);
  step({103}, false);
  step({104}, false);
  step({105}, true);  // re-scored over 105 positions with the queries of 101..104
  m.truncate(1, 1);
  PolicyConfig cfg = m.policy("snap");
  cfg.budget = 24;
  PrefillSelector want(cfg, kL, kKV, 105);
  bool moved = false;
  for (int64_t l = 0; l < kL; ++l) {
    const torch::Tensor& k = ks[static_cast<size_t>(l)];
    ASSERT_EQ(k.size(1), 105);
    const auto expected = blocks_of_kept(want.on_layer(l, qs[static_cast<size_t>(l)].narrow(1, 101, 4), k), {}, kBS, 1);
    const auto* got = m.cache().draft_blocks(1, l, 0);
    ASSERT_TRUE(got) << "layer " << l;
    EXPECT_EQ(*got, expected) << "layer " << l;
    moved = moved || (l == 3 && expected != chosen_at_prompt);
  }
  EXPECT_TRUE(moved) << "the decode queries were meant to choose other blocks than the prompt's";
  m.release(1);
  EXPECT_EQ(m.blocks_used(), 0);
}

TEST(PagedKvMemory, UnknownPolicyAndDuplicateSequenceAreClearErrors) {
  auto m = make_memory(64);
  try {
    m.begin_prefill(1, 10, "nope");
    FAIL() << "unknown policy accepted";
  } catch (const KvError& e) {
    EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos) << e.what();
  }
  EXPECT_EQ(m.blocks_used(), 0);
  prefill_checked(m, 1, make_prompt(10, 1), "full");
  EXPECT_THROW(m.begin_prefill(1, 10, "full"), KvError);
  for (int64_t l = 0; l < kL; ++l) EXPECT_EQ(m.cached_tokens(1, l), 10);
  m.release(1);
  EXPECT_EQ(m.blocks_used(), 0);
}

TEST(PagedKvMemory, DecodeEvictionKeepsUnderDecodeBudget) {
  auto m = make_memory(4096);
  const int64_t T = 60;
  prefill_checked(m, 1, make_prompt(T, 5), "knorm_dec");
  prefill_checked(m, 2, make_prompt(T, 6), "stream_dec");
  std::vector<int64_t> pos = {T, T};
  for (int step = 0; step < 60; ++step) {
    decode_checked(m, {1, 2}, pos);
    if (HasFatalFailure()) return;
    for (int64_t l = 0; l < kL; ++l) {
      // knorm: layers 0 and 1 are skipped (paper) and never evict; the others stay under decode_budget.
      if (l >= 2) {
        EXPECT_LE(m.cached_tokens(1, l), 40) << "knorm_dec layer " << l << " step " << step;
      }
      EXPECT_LE(m.cached_tokens(2, l), 24) << "stream_dec layer " << l << " step " << step;
    }
    for (auto& p : pos) ++p;
  }
  for (int64_t l = 0; l < kL; ++l) {
    auto sp = m.cache().positions(2, l);
    for (int64_t h = 0; h < kKV; ++h) {
      auto s = row_set(sp, h);
      EXPECT_TRUE(s.count(0) && s.count(1)) << "stream_dec dropped a sink (layer " << l << ")";
      EXPECT_TRUE(s.count(pos[1] - 1)) << "stream_dec dropped the newest token (layer " << l << ")";
    }
    if (l < 2) {
      EXPECT_EQ(m.cached_tokens(1, l), T + 60) << "knorm_dec evicted a skipped layer " << l;
    }
  }
  m.release(1);
  m.release(2);
  EXPECT_EQ(m.blocks_used(), 0);
}

}  // namespace
}  // namespace kvserve

namespace kvserve {
namespace {

// H2O's decode-time eviction ranks by attention accumulated during decoding, which the paged decode
// path does not produce: such a policy must be refused up front with a clear error (or work), never
// fail in the middle of a generation.
TEST(PagedKvMemory, H2oDecodeBudgetRefusedUpFrontOrWorks) {
  const Specs specs = {{"h2o_dec", {{"name", "h2o"}, {"budget", "24"}, {"window", "4"}, {"decode_budget", "32"},
                                    {"decode_evict_chunk", "8"}}}};
  std::unique_ptr<PagedKvMemory> m;
  try {
    m = std::make_unique<PagedKvMemory>(kL, pool_opts(1024), resolve_policies(specs));
  } catch (const KvError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("h2o_dec"), std::string::npos) << msg;
    EXPECT_NE(msg.find("decode_budget"), std::string::npos) << msg;
    return;
  }
  prefill_checked(*m, 1, make_prompt(60, 1), "h2o_dec");
  std::vector<int64_t> pos = {60};
  for (int step = 0; step < 20; ++step) {
    ASSERT_NO_THROW(decode_checked(*m, {1}, pos)) << "step " << step;
    for (int64_t l = 0; l < kL; ++l) EXPECT_LE(m->cached_tokens(1, l), 32);
    ++pos[0];
  }
  m->release(1);
  EXPECT_EQ(m->blocks_used(), 0);
}

}  // namespace
}  // namespace kvserve
