// SequenceSampler: greedy, filters, penalties and seeded reproducibility on hand-made logits.
#include <gtest/gtest.h>

#include <map>

#include "backend/sampler.h"

using kvserve::SamplingParams;
using kvserve::SequenceSampler;
using kvserve::TokenLogprob;

namespace {
torch::Tensor logits(std::vector<float> v) { return torch::tensor(v, torch::kFloat32); }

std::map<int64_t, int> histogram(const SamplingParams& p, const torch::Tensor& l, int n, uint64_t seed = 1) {
  SequenceSampler s(p, {}, seed);
  std::map<int64_t, int> h;
  for (int i = 0; i < n; ++i) ++h[s.sample(l, nullptr, nullptr)];
  return h;
}
}  // namespace

TEST(Sampler, GreedyTakesTheFirstMaximum) {
  SamplingParams p;
  p.temperature = 0;
  SequenceSampler s(p, {}, 0);
  EXPECT_EQ(s.sample(logits({0.1f, 2.0f, 2.0f, -1.0f}), nullptr, nullptr), 1);
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
  SequenceSampler a(p, {}, 1), b(p, {}, 2);  // an explicit seed wins over the fallback
  std::vector<int64_t> ta, tb;
  for (int i = 0; i < 32; ++i) {
    ta.push_back(a.sample(l, nullptr, nullptr));
    tb.push_back(b.sample(l, nullptr, nullptr));
  }
  EXPECT_EQ(ta, tb);
  p.seed = 43;
  SequenceSampler c(p, {}, 1);
  std::vector<int64_t> tc;
  for (int i = 0; i < 32; ++i) tc.push_back(c.sample(l, nullptr, nullptr));
  EXPECT_NE(ta, tc);
}

TEST(Sampler, PenaltiesFollowVllmSemantics) {
  SamplingParams p;
  p.temperature = 0;
  p.repetition_penalty = 2.0;  // positive logits of seen tokens are divided, negative multiplied
  SequenceSampler s(p, {0}, 0);
  EXPECT_EQ(s.sample(logits({3.0f, 2.0f}), nullptr, nullptr), 1);  // 3/2 < 2
  SamplingParams f;
  f.temperature = 0;
  f.frequency_penalty = 1.0;
  SequenceSampler g(f, {}, 0);
  g.observe(0);
  g.observe(0);
  EXPECT_EQ(g.sample(logits({2.5f, 1.0f}), nullptr, nullptr), 1);  // 2.5 - 2 < 1
  SamplingParams pr;
  pr.temperature = 0;
  pr.presence_penalty = 1.0;
  SequenceSampler h(pr, {}, 0);
  h.observe(0);
  h.observe(0);
  EXPECT_EQ(h.sample(logits({2.5f, 1.0f}), nullptr, nullptr), 0);  // 2.5 - 1 > 1: counted once
}

TEST(Sampler, LogprobsAreTheModelsOwn) {
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 2;
  p.repetition_penalty = 5.0;  // must not change the reported logprobs
  SequenceSampler s(p, {0}, 0);
  TokenLogprob chosen;
  std::vector<TokenLogprob> top;
  auto l = logits({1.0f, 0.9f, -1.0f});  // the penalty turns token 0 into 0.2: token 1 wins
  const int64_t t = s.sample(l, &chosen, &top);
  auto ref = torch::log_softmax(l, 0);
  EXPECT_EQ(t, 1);
  EXPECT_NEAR(chosen.logprob, ref[1].item<float>(), 1e-6);
  ASSERT_EQ(top.size(), 2u);
  EXPECT_EQ(top[0].token_id, 0);
  EXPECT_NEAR(top[0].logprob, ref[0].item<float>(), 1e-6);
  EXPECT_EQ(top[1].token_id, 1);
}
