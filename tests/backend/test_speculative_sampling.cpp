// Speculative sampling (backend/sampling/speculative_sampling.h) and the sampler rows that verify
// drafts drawn from a distribution: every emitted token must be distributed as plain sampling's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "backend/sampling/sampler.h"
#include "backend/sampling/speculative_sampling.h"

namespace kvserve {
namespace {

// The distribution a temperature draw keeps, computed the plain way: every candidate sorted
// (logit descending, id ascending), softmax over the first top_k, top-p's shortest prefix reaching
// top_p, min-p's run, renormalised.
std::vector<double> naive_kept(const std::vector<float>& l, const SamplingParams& sp) {
  const auto V = static_cast<int64_t>(l.size());
  std::vector<int64_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
  const int64_t m = sp.top_k > 0 && sp.top_k < V ? sp.top_k : V;
  std::vector<double> p(static_cast<size_t>(m));
  double sum = 0;
  for (int64_t j = 0; j < m; ++j) sum += p[j] = std::exp(double(l[order[j]]) / sp.temperature - double(l[order[0]]) / sp.temperature);
  int64_t n = m;
  if (sp.top_p < 1.0) {
    double acc = 0;
    for (int64_t j = 0; j < m; ++j)
      if ((acc += p[j] / sum) >= sp.top_p) {
        n = j + 1;
        break;
      }
  }
  int64_t run = 1;
  while (run < n && p[run] >= sp.min_p * p[0]) ++run;
  double kept = 0;
  for (int64_t j = 0; j < run; ++j) kept += p[j];
  std::vector<double> out(static_cast<size_t>(V), 0.0);
  for (int64_t j = 0; j < run; ++j) out[order[j]] = p[j] / kept;
  return out;
}

// Pearson's statistic of counts against probabilities p (n draws), with the categories whose
// expected count is below 5 pooled; also returns the degrees of freedom.
std::pair<double, int64_t> chi_square(const std::vector<int64_t>& counts, const std::vector<double>& p, int64_t n) {
  double stat = 0, pooled_e = 0;
  int64_t pooled_o = 0, cats = 0;
  for (size_t t = 0; t < p.size(); ++t) {
    const double e = p[t] * static_cast<double>(n);
    if (e < 5) {
      pooled_e += e, pooled_o += counts[t];
      continue;
    }
    stat += (counts[t] - e) * (counts[t] - e) / e;
    ++cats;
  }
  if (pooled_e > 0) {
    stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / std::max(pooled_e, 1.0);
    ++cats;
  }
  return {stat, cats - 1};
}

// The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty): a correct sampler fails once in 10,000 seeds.
double critical(int64_t df) {
  const double k = static_cast<double>(df), z = 3.719;
  return k * std::pow(1 - 2 / (9 * k) + z * std::sqrt(2 / (9 * k)), 3);
}

std::vector<float> random_logits(int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.f, 2.f);
  std::vector<float> l(static_cast<size_t>(V));
  for (auto& x : l) x = n(rng);
  l[3] = l[5];  // a tie: the lower id ranks first
  l[7] = -std::numeric_limits<float>::infinity();  // a banned token
  return l;
}

SamplingParams params(double temp, int64_t top_k, double top_p, double min_p) {
  SamplingParams sp;
  sp.temperature = temp, sp.top_k = top_k, sp.top_p = top_p, sp.min_p = min_p;
  return sp;
}

const std::vector<SamplingParams> kSettings = {params(0.7, 0, 1.0, 0.0), params(1.3, 7, 1.0, 0.0), params(0.9, 0, 0.8, 0.0),
                                               params(1.0, 0, 1.0, 0.1), params(0.8, 20, 0.9, 0.05), params(1.0, 4, 0.3, 0.0)};

TEST(KeptDistribution, EqualsTheFiltersAppliedToTheSortedRow) {
  for (uint64_t seed : {1, 2, 3})
    for (int64_t V : {40, 3000}) {
      const auto l = random_logits(V, seed);
      for (const auto& sp : kSettings) {
        const auto got = kept_distribution(l.data(), V, sp);
        const auto want = naive_kept(l, sp);
        for (int64_t t = 0; t < V; ++t) ASSERT_NEAR(got[t], want[t], 1e-12) << "token " << t << " V " << V;
      }
    }
}

TEST(KeptDistribution, IsWhatTheSamplerDraws) {
  const int64_t V = 40, N = 20000;
  const auto l = random_logits(V, 9);
  const auto logits = torch::tensor(l).reshape({1, V});
  for (const auto& sp : kSettings) {
    SamplerBank bank;
    bank.add(1, sp, {}, 1234, {});
    std::vector<int64_t> counts(V, 0);
    for (int64_t i = 0; i < N; ++i) ++counts[bank.sample_batch({1}, logits, {0}).at(0).token];
    const auto p = kept_distribution(l.data(), V, sp);
    for (int64_t t = 0; t < V; ++t)
      if (p[t] == 0) { EXPECT_EQ(counts[t], 0) << "token " << t << " is not kept but was drawn"; }
    const auto [stat, df] = chi_square(counts, p, N);
    if (df > 0) { EXPECT_LT(stat, critical(df)) << "temperature " << sp.temperature << " top_k " << sp.top_k; }
  }
}

TEST(SpeculativeSampling, KeepsTheTargetDistributionWhateverTheDraft) {
  const int64_t V = 12, N = 200000;
  std::mt19937_64 rng(77);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const auto p = kept_distribution(random_logits(V, 4).data(), V, params(1.0, 0, 1.0, 0.0));
  for (uint64_t draft_seed : {5, 6}) {
    // The draft differs from the target: a few tokens it never proposes, others it over-weights.
    const auto q = kept_distribution(random_logits(V, draft_seed).data(), V, params(0.8, 8, 1.0, 0.0));
    std::vector<int64_t> counts(V, 0);
    int64_t accepted = 0;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t x = draw_by_id(q, u(rng));
      const double ua = u(rng), ur = u(rng);
      const int64_t t = accept_or_resample(p, q, x, ua, ur);
      accepted += t == x;
      ++counts[t];
    }
    const auto [stat, df] = chi_square(counts, p, N);
    EXPECT_LT(stat, critical(df));
    // The acceptance rate is the overlap sum min(p, q) (Leviathan et al., Theorem 3.5).
    double overlap = 0;
    for (int64_t t = 0; t < V; ++t) overlap += std::min(p[t], q[t]);
    EXPECT_NEAR(static_cast<double>(accepted) / N, overlap, 4 * std::sqrt(overlap * (1 - overlap) / N));
  }
  // A draft drawn from the target itself is always kept.
  for (int64_t i = 0; i < 1000; ++i) {
    const int64_t x = draw_by_id(p, u(rng));
    EXPECT_EQ(accept_or_resample(p, p, x, u(rng), u(rng)), x);
  }
}

TEST(SpeculativeSampling, ARejectedDraftIsNeverEmitted) {
  const std::vector<double> p = {0.5, 0.5, 0.0}, q = {0.1, 0.1, 0.8};
  for (double ua : {0.0, 0.3, 0.999})
    for (double ur : {0.0, 0.5, 0.999}) EXPECT_NE(accept_or_resample(p, q, 2, ua, ur), 2);
  EXPECT_EQ(accept_or_resample(p, q, 0, 0.999, 0.5), 0);  // p(x) >= q(x): kept whatever the uniform
}

// SamplerBank end to end: drafts drawn by SamplerBank::draft from one row of logits, verified by a
// sample_batch over other logits with a logit bias the draft does not see: the emitted tokens follow
// the verifying row's distribution, and drafts are kept at the rate of the overlap.
TEST(SamplerBankDrafts, VerifiedTokensFollowTheTargetRow) {
  const int64_t V = 40, N = 20000;
  const auto target = random_logits(V, 21), draft = random_logits(V, 22);
  SamplingParams sp = params(0.9, 12, 0.95, 0.0);
  sp.logit_bias = {{2, 1.5}};
  SamplerBank bank;
  bank.add(1, sp, {}, 99, {});
  const auto target_t = torch::tensor(target).reshape({1, V});
  std::vector<int64_t> counts(V, 0);
  int64_t accepted = 0;
  for (int64_t i = 0; i < N; ++i) {
    const SampledDraft d = bank.draft(1, draft.data(), V);
    const SampledDraft* slot[] = {&d};
    const int64_t t = bank.sample_batch({1}, target_t, {0}, slot).at(0).token;
    accepted += t == d.token;
    ++counts[t];
  }
  auto biased = target;
  biased[2] += 1.5f;
  const auto p = kept_distribution(biased.data(), V, sp);
  const auto [stat, df] = chi_square(counts, p, N);
  EXPECT_LT(stat, critical(df));
  const auto q = kept_distribution(draft.data(), V, sp);
  double overlap = 0;
  for (int64_t t = 0; t < V; ++t) overlap += std::min(p[t], q[t]);
  EXPECT_NEAR(static_cast<double>(accepted) / N, overlap, 4 * std::sqrt(overlap * (1 - overlap) / N));
  // A greedy sequence ignores a drawn draft: its row takes the argmax.
  bank.add(2, params(0.0, 0, 1.0, 0.0), {}, 5, {});
  EXPECT_FALSE(bank.samples(2));
  SampledDraft d{0, std::vector<double>(V, 1.0 / V)};
  const SampledDraft* slot[] = {&d};
  EXPECT_EQ(bank.sample_batch({2}, target_t, {0}, slot).at(0).token,
            std::max_element(target.begin(), target.end()) - target.begin());
}

}  // namespace
}  // namespace kvserve
