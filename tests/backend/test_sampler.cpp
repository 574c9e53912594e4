// SamplerBank: greedy, filters, penalties, logprobs and seeded reproducibility on hand-made logits, and
// token-for-token equality with the former per-row host sampler on random batches of mixed params.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <random>

#include "backend/sampling/sampler.h"
#include "tests/support/reference_sampler.h"

using kvserve::ReferenceSampler;
using kvserve::SampledToken;
using kvserve::SamplerBank;
using kvserve::SamplingParams;
using kvserve::TokenLogprob;

namespace {
torch::Tensor logits(std::vector<float> v) { return torch::tensor(v, torch::kFloat32); }

std::map<int64_t, int> histogram(const SamplingParams& p, const torch::Tensor& l, int n, uint64_t seed = 1) {
  SamplerBank bank;
  bank.add(0, p, {}, seed, {});
  std::map<int64_t, int> h;
  for (int i = 0; i < n; ++i) ++h[bank.sample(0, l, false).token];
  return h;
}

// One sequence of a random batch: what the bank and the reference are both given.
struct Spec {
  SamplingParams params;
  std::vector<int64_t> prompt;
  uint64_t seed = 0;
  std::vector<int64_t> eos;
};

template <typename T>
T pick(std::mt19937_64& g, std::initializer_list<T> xs) {
  return xs.begin()[std::uniform_int_distribution<size_t>(0, xs.size() - 1)(g)];
}

// Random params drawn so that every filter, penalty and logprob option appears alone and combined.
Spec random_spec(std::mt19937_64& g, int64_t V) {
  Spec s;
  SamplingParams& p = s.params;
  p.temperature = pick<double>(g, {0.0, 0.0, 0.3, 0.7, 1.0, 1.5});
  p.top_k = pick<int64_t>(g, {0, 0, 1, 5, 40, V, V + 7});
  p.top_p = pick<double>(g, {1.0, 1.0, 0.95, 0.6, 0.2, 1e-9});
  p.min_p = pick<double>(g, {0.0, 0.0, 0.02, 0.2, 0.9});
  p.repetition_penalty = pick<double>(g, {1.0, 1.0, 1.3, 0.7});
  p.presence_penalty = pick<double>(g, {0.0, 0.0, 0.5, -0.4});
  p.frequency_penalty = pick<double>(g, {0.0, 0.0, 0.3, 1.1});
  p.logprobs = pick<int64_t>(g, {-1, -1, 0, 1, 5});
  if (g() % 2) p.seed = g();
  s.seed = g();
  for (int i = 0, n = static_cast<int>(g() % 20); i < n; ++i) s.prompt.push_back(static_cast<int64_t>(g() % V));
  s.eos = {static_cast<int64_t>(g() % V), V - 1};
  return s;
}

// Random logits with many exact ties on some rows (coarse values), so tie order is exercised.
torch::Tensor random_logits(int64_t B, int64_t V, uint64_t seed) {
  torch::manual_seed(seed);
  auto l = torch::randn({B, V}, torch::kFloat32) * 3.0;
  for (int64_t i = 0; i < B; i += 3) l[i] = torch::round(l[i] * 2.0) / 2.0;
  return l;
}

// Runs `steps` steps of the bank (batched) and of one reference sampler per row on the same logits,
// checking tokens and logprobs row by row. Returns how many tokens were not the raw argmax (draws,
// penalties, bans), so a caller can see that more than plain greedy was compared.
int64_t expect_same_as_reference(int64_t B, int64_t V, int steps, uint64_t seed,
                                 const std::function<void(std::mt19937_64&, Spec&)>& tweak = {}) {
  int64_t off_argmax = 0;
  std::mt19937_64 g(seed);
  SamplerBank bank;
  std::vector<ReferenceSampler> ref;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < B; ++i) {
    Spec s = random_spec(g, V);
    if (tweak) tweak(g, s);
    bank.add(100 + i, s.params, s.prompt, s.seed, s.eos);
    ref.emplace_back(s.params, s.prompt, s.seed, s.eos);
    ids.push_back(100 + i);
  }
  for (int step = 0; step < steps; ++step) {
    auto l = random_logits(B, V, seed * 1000 + static_cast<uint64_t>(step));
    std::vector<char> ban(static_cast<size_t>(B));
    for (auto& b : ban) b = static_cast<char>(g() % 3 == 0);
    const auto got = bank.sample_batch(ids, l, ban);
    EXPECT_EQ(got.size(), static_cast<size_t>(B));
    if (got.size() != static_cast<size_t>(B)) return off_argmax;
    const auto argmax = l.argmax(1);
    for (int64_t i = 0; i < B; ++i) {
      TokenLogprob chosen;
      std::vector<TokenLogprob> top;
      const auto r = static_cast<size_t>(i);
      const int64_t want = ref[r].sample_and_observe(l[i], ban[r], &chosen, &top);
      const SampledToken& s = got[static_cast<size_t>(i)];
      EXPECT_EQ(s.token, want) << "row " << i << " step " << step;
      if (s.token != want) return off_argmax;  // the streams part here: later steps compare nothing
      off_argmax += s.token != argmax[i].item<int64_t>();
      EXPECT_EQ(s.chosen.token_id, chosen.token_id);
      EXPECT_NEAR(s.chosen.logprob, chosen.logprob, 1e-5);
      EXPECT_EQ(s.top.size(), top.size()) << "row " << i;
      for (size_t k = 0; k < std::min(top.size(), s.top.size()); ++k) {
        EXPECT_EQ(s.top[k].token_id, top[k].token_id) << "row " << i << " rank " << k;
        EXPECT_NEAR(s.top[k].logprob, top[k].logprob, 1e-5);
      }
    }
  }
  return off_argmax;
}
}  // namespace

TEST(Sampler, GreedyTakesTheFirstMaximum) {
  SamplingParams p;
  p.temperature = 0;
  SamplerBank bank;
  bank.add(0, p, {}, 0, {});
  EXPECT_EQ(bank.sample(0, logits({0.1f, 2.0f, 2.0f, -1.0f}), false).token, 1);
}

TEST(Sampler, TopKTopPMinPRestrictTheCandidates) {
  auto l = logits({3.0f, 2.9f, 2.8f, -5.0f, -6.0f});
  SamplingParams p;
  p.top_k = 2;
  for (auto [tok, n] : histogram(p, l, 400)) EXPECT_LT(tok, 2);
  SamplingParams q;
  q.top_p = 0.5;  // the first token alone holds < 0.5, the first two more
  for (auto [tok, n] : histogram(q, l, 400)) EXPECT_LT(tok, 2);
  SamplingParams m;
  m.min_p = 0.5;  // tokens 3 and 4 are far below half of the top probability
  auto h = histogram(m, l, 400);
  EXPECT_EQ(h.count(3) + h.count(4), 0u);
  EXPECT_EQ(h.size(), 3u);
}

TEST(Sampler, SameSeedSameTokensDifferentSeedDiffers) {
  auto l = logits(std::vector<float>(50, 0.0f));
  SamplingParams p;
  p.seed = 42;
  SamplerBank bank;
  bank.add(0, p, {}, 1, {});
  bank.add(1, p, {}, 2, {});  // an explicit seed wins over the fallback
  p.seed = 43;
  bank.add(2, p, {}, 1, {});
  std::vector<int64_t> ta, tb, tc;
  for (int i = 0; i < 32; ++i) {
    auto r = bank.sample_batch({0, 1, 2}, l.expand({3, 50}), {0, 0, 0});
    ta.push_back(r[0].token), tb.push_back(r[1].token), tc.push_back(r[2].token);
  }
  EXPECT_EQ(ta, tb);
  EXPECT_NE(ta, tc);
  // Without a request seed the fallback seeds the stream: different fallbacks, different tokens.
  SamplerBank other;
  other.add(0, SamplingParams{}, {}, 7, {});
  other.add(1, SamplingParams{}, {}, 8, {});
  std::vector<int64_t> t7, t8;
  for (int i = 0; i < 32; ++i) {
    auto r = other.sample_batch({0, 1}, l.expand({2, 50}), {0, 0});
    t7.push_back(r[0].token), t8.push_back(r[1].token);
  }
  EXPECT_NE(t7, t8);
}

TEST(Sampler, PenaltiesFollowVllmSemantics) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0;  // positive logits of seen tokens are divided, negative multiplied
  SamplerBank bank;
  bank.add(0, p, {0}, 0, {});
  EXPECT_EQ(bank.sample(0, logits({3.0f, 2.0f}), false).token, 1);  // 3/2 < 2
  bank.add(1, p, {0}, 0, {});
  EXPECT_EQ(bank.sample(1, logits({-0.5f, -0.9f}), false).token, 1);  // -0.5 * 2 < -0.9

  // Two outputs of token 0 first (5 beats 0 even after the penalties), then the logits under test.
  SamplingParams f;
  f.temperature = 0;
  f.frequency_penalty = 1.0;
  SamplingParams pr;
  pr.temperature = 0;
  pr.presence_penalty = 1.0;
  SamplerBank b2;
  b2.add(0, f, {}, 0, {});
  b2.add(1, pr, {}, 0, {});
  for (int i = 0; i < 2; ++i) {
    auto r = b2.sample_batch({0, 1}, logits({5.0f, 0.0f}).expand({2, 2}), {0, 0});
    ASSERT_EQ(r[0].token, 0);
    ASSERT_EQ(r[1].token, 0);
  }
  auto r = b2.sample_batch({0, 1}, logits({2.5f, 1.0f}).expand({2, 2}), {0, 0});
  EXPECT_EQ(r[0].token, 1);  // 2.5 - 2 < 1
  EXPECT_EQ(r[1].token, 0);  // 2.5 - 1 > 1: counted once
  // Only penalised sequences hold a device row, and remove() gives it back.
  EXPECT_EQ(bank.penalty_rows_in_use(), 2);
  EXPECT_EQ(b2.penalty_rows_in_use(), 2);
  b2.remove(0);
  EXPECT_EQ(b2.penalty_rows_in_use(), 1);
  b2.add(2, SamplingParams{}, {}, 0, {});
  b2.sample(2, logits({1.0f, 2.0f}), false);
  EXPECT_EQ(b2.penalty_rows_in_use(), 1);
}

TEST(Sampler, AReusedPenaltyRowStartsClean) {
  SamplingParams f;
  f.temperature = 0;
  f.frequency_penalty = 10.0;
  SamplerBank bank;
  bank.add(0, f, {}, 0, {});
  for (int i = 0; i < 3; ++i) bank.sample(0, logits({5.0f, 4.99f, 0.0f}), false);
  bank.remove(0);
  bank.add(1, f, {}, 0, {});  // takes the freed row
  EXPECT_EQ(bank.sample(1, logits({5.0f, 4.99f, 0.0f}), false).token, 0);
}

TEST(Sampler, LogprobsAreTheModelsOwn) {
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 2;
  p.repetition_penalty = 5.0;  // must not change the reported logprobs
  SamplerBank bank;
  bank.add(0, p, {0}, 0, {});
  auto l = logits({1.0f, 0.9f, -1.0f});  // the penalty turns token 0 into 0.2: token 1 wins
  const SampledToken s = bank.sample(0, l, false);
  auto ref = torch::log_softmax(l, 0);
  EXPECT_EQ(s.token, 1);
  EXPECT_EQ(s.chosen.token_id, 1);
  EXPECT_NEAR(s.chosen.logprob, ref[1].item<float>(), 1e-6);
  ASSERT_EQ(s.top.size(), 2u);
  EXPECT_EQ(s.top[0].token_id, 0);
  EXPECT_NEAR(s.top[0].logprob, ref[0].item<float>(), 1e-6);
  EXPECT_EQ(s.top[1].token_id, 1);
}

TEST(Sampler, LogprobTiesListTheLowerIdFirstAndOnlyRequestedRowsReport) {
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 3;
  SamplerBank bank;
  bank.add(0, p, {}, 0, {});
  bank.add(1, SamplingParams{}, {}, 0, {});  // no logprobs asked: none reported
  auto l = torch::stack({logits({0.0f, 1.0f, 1.0f, 1.0f, 1.0f}), logits({0.0f, 1.0f, 1.0f, 1.0f, 1.0f})});
  auto r = bank.sample_batch({0, 1}, l, {0, 0});
  ASSERT_EQ(r[0].top.size(), 3u);
  EXPECT_EQ(r[0].top[0].token_id, 1);
  EXPECT_EQ(r[0].top[1].token_id, 2);
  EXPECT_EQ(r[0].top[2].token_id, 3);
  EXPECT_TRUE(r[1].top.empty());
  EXPECT_EQ(r[1].chosen.logprob, 0.0);
}

TEST(Sampler, BanEosMasksOnlyThatRow) {
  SamplingParams p;
  p.temperature = 0;
  SamplerBank bank;
  bank.add(0, p, {}, 0, {2});
  bank.add(1, p, {}, 0, {2});
  auto l = logits({0.0f, 1.0f, 9.0f}).expand({2, 3});
  auto r = bank.sample_batch({0, 1}, l, {1, 0});
  EXPECT_EQ(r[0].token, 1);
  EXPECT_EQ(r[1].token, 2);
  EXPECT_EQ(l[0][2].item<float>(), 9.0f);  // the caller's logits are untouched
}

TEST(Sampler, EveryTokenBannedButOne) {
  const int64_t V = 301;
  std::vector<int64_t> eos(V);
  std::iota(eos.begin(), eos.end(), 0);
  eos.erase(eos.begin() + 137);
  SamplingParams greedy, hot, filtered;
  greedy.temperature = 0;
  hot.temperature = 2.0;
  filtered.temperature = 1.0, filtered.top_k = 3, filtered.top_p = 0.1, filtered.min_p = 0.5;
  filtered.logprobs = 2;
  SamplerBank bank;
  bank.add(0, greedy, {}, 0, eos);
  bank.add(1, hot, {}, 1, eos);
  bank.add(2, filtered, {}, 2, eos);
  for (int step = 0; step < 20; ++step) {
    auto l = random_logits(3, V, static_cast<uint64_t>(step));
    for (const auto& s : bank.sample_batch({0, 1, 2}, l, {1, 1, 1})) EXPECT_EQ(s.token, 137);
  }
}

TEST(Sampler, MixedGreedyAndTemperatureBatch) {
  const int64_t V = 1001, B = 16;
  SamplingParams greedy, hot;
  greedy.temperature = 0;
  hot.temperature = 1.0;
  SamplerBank bank;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < B; ++i) bank.add(i, i % 2 ? hot : greedy, {}, static_cast<uint64_t>(i), {}), ids.push_back(i);
  auto l = random_logits(B, V, 5);
  auto r = bank.sample_batch(ids, l, std::vector<char>(B, 0));
  auto argmax = l.argmax(1);
  int hot_off_argmax = 0;
  for (int64_t i = 0; i < B; ++i) {
    if (i % 2 == 0)
      EXPECT_EQ(r[static_cast<size_t>(i)].token, argmax[i].item<int64_t>());
    else
      hot_off_argmax += r[static_cast<size_t>(i)].token != argmax[i].item<int64_t>();
  }
  EXPECT_GT(hot_off_argmax, 0);  // randn logits over 1001 tokens: temperature 1 rarely takes the top one
}

TEST(Sampler, ARowsTokenDoesNotDependOnTheOtherRows) {
  const int64_t V = 777;
  std::mt19937_64 g(3);
  std::vector<Spec> specs;
  for (int i = 0; i < 12; ++i) specs.push_back(random_spec(g, V));
  specs[0].params.temperature = 0.9;  // the tracked row samples
  auto make = [&] {
    SamplerBank b;
    for (size_t i = 0; i < specs.size(); ++i)
      b.add(static_cast<int64_t>(i), specs[i].params, specs[i].prompt, specs[i].seed, specs[i].eos);
    return b;
  };
  SamplerBank alone = make(), crowd = make(), again = make();
  std::vector<int64_t> ta, tc, tg;
  for (int step = 0; step < 24; ++step) {
    auto row = random_logits(1, V, 900 + static_cast<uint64_t>(step));
    ta.push_back(alone.sample_batch({0}, row, {0})[0].token);
    tg.push_back(again.sample_batch({0}, row, {0})[0].token);
    // A different crowd each step, the tracked row at a different position.
    std::vector<int64_t> ids;
    for (int64_t i = 1; i < 12; ++i)
      if ((i + step) % 3 != 0) ids.push_back(i);
    const size_t at = static_cast<size_t>(step) % (ids.size() + 1);
    ids.insert(ids.begin() + static_cast<std::ptrdiff_t>(at), 0);
    auto l = random_logits(static_cast<int64_t>(ids.size()), V, 50 + static_cast<uint64_t>(step));
    l[static_cast<int64_t>(at)] = row[0];
    tc.push_back(crowd.sample_batch(ids, l, std::vector<char>(ids.size(), 0))[at].token);
  }
  EXPECT_EQ(ta, tc);
  EXPECT_EQ(ta, tg);  // and the same across runs
}

TEST(Sampler, SameTokensAsTheHostSamplerB1) {
  int64_t off = 0;
  for (uint64_t seed = 1; seed < 9; ++seed) off += expect_same_as_reference(1, 613, 40, seed);
  EXPECT_GT(off, 20);
}
TEST(Sampler, SameTokensAsTheHostSamplerB64) { EXPECT_GT(expect_same_as_reference(64, 1237, 12, 2), 50); }
TEST(Sampler, SameTokensAsTheHostSamplerManyBatches) {
  int64_t off = 0;
  for (uint64_t seed = 10; seed < 40; ++seed)
    off += expect_same_as_reference(9, 97 + static_cast<int64_t>(seed), 8, seed);
  EXPECT_GT(off, 200);
}
TEST(Sampler, SameTokensAsTheHostSamplerLargeVocab) { EXPECT_GT(expect_same_as_reference(8, 49157, 3, 3), 3); }
// Temperature rows with more candidates than the CPU path sorts outright (no top-k, or a top-k of
// thousands): they are drawn from the head of the order only.
TEST(Sampler, SameTokensAsTheHostSamplerWithoutTopK) {
  const int64_t V = 20011;
  const auto many_candidates = [&](std::mt19937_64& g, Spec& s) {
    s.params.temperature = pick<double>(g, {0.3, 0.7, 1.0, 1.5, 4.0});
    s.params.top_k = pick<int64_t>(g, {0, 0, 5000, V - 1});
  };
  EXPECT_GT(expect_same_as_reference(16, V, 24, 77, many_candidates), 100);
}

TEST(Sampler, SameTokensOnTheDevice) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 32, V = 32003;
  std::mt19937_64 g(11);
  std::vector<Spec> specs;
  for (int64_t i = 0; i < B; ++i) specs.push_back(random_spec(g, V));
  SamplerBank cpu, gpu;
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < B; ++i) {
    const Spec& s = specs[static_cast<size_t>(i)];
    cpu.add(i, s.params, s.prompt, s.seed, s.eos);
    gpu.add(i, s.params, s.prompt, s.seed, s.eos);
    ids.push_back(i);
  }
  int64_t differ = 0, total = 0;
  for (int step = 0; step < 16; ++step) {
    auto l = random_logits(B, V, 300 + static_cast<uint64_t>(step));
    std::vector<char> ban(B, static_cast<char>(step % 2));
    auto a = cpu.sample_batch(ids, l, ban);
    auto b = gpu.sample_batch(ids, l.to(torch::kCUDA), ban);
    for (int64_t i = 0; i < B; ++i) {
      ++total;
      differ += a[static_cast<size_t>(i)].token != b[static_cast<size_t>(i)].token;
      EXPECT_NEAR(a[static_cast<size_t>(i)].chosen.logprob, b[static_cast<size_t>(i)].chosen.logprob, 1e-4);
    }
  }
  // CUDA sums in another order: a draw may land on the other side of a boundary, very rarely.
  EXPECT_LE(differ, total / 100) << differ << " of " << total << " tokens differ between CPU and CUDA";
}
