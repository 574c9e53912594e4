#include "backend/sampling/speculative_sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/check.h"

namespace kvserve {

namespace {

// A candidate of a row: the sampler's order is higher logit first, lower id first among equals.
struct Ranked {
  float v;
  int64_t id;
};
bool before(const Ranked& a, const Ranked& b) { return a.v > b.v || (a.v == b.v && a.id < b.id); }
// NaN never wins (the sampler's order keys give it no meaning either).
float logit(const float* l, int64_t t) { return std::isnan(l[t]) ? -std::numeric_limits<float>::infinity() : l[t]; }

}  // namespace

std::vector<double> kept_distribution(const float* l, int64_t V, const SamplingParams& sp) {
  KV_CHECK(V > 0 && sp.temperature > 0.0,
           "internal: the kept distribution of " << V << " logits at temperature " << sp.temperature);
  std::vector<double> p(static_cast<size_t>(V), 0.0);
  Ranked best{logit(l, 0), 0};
  for (int64_t t = 1; t < V; ++t)
    if (const Ranked r{logit(l, t), t}; before(r, best)) best = r;
  if (!std::isfinite(best.v)) {  // nothing finite (a grammar dead end), or an infinite logit
    p[static_cast<size_t>(best.id)] = 1.0;
    return p;
  }
  // top-k: the m-th candidate bounds the members.
  const int64_t m = sp.top_k > 0 && sp.top_k < V ? sp.top_k : V;
  Ranked last = best;
  if (m < V) {
    std::vector<Ranked> c(static_cast<size_t>(V));
    for (int64_t t = 0; t < V; ++t) c[static_cast<size_t>(t)] = {logit(l, t), t};
    std::nth_element(c.begin(), c.begin() + (m - 1), c.end(), before);
    last = c[static_cast<size_t>(m - 1)];
  }
  auto member = [&](int64_t t) { return m == V || !before(last, Ranked{logit(l, t), t}); };
  const double temp = sp.temperature, top = static_cast<double>(best.v) / temp;
  double sum = 0;
  for (int64_t t = 0; t < V; ++t)
    if (member(t)) sum += p[static_cast<size_t>(t)] = std::exp(static_cast<double>(logit(l, t)) / temp - top);
  for (double& x : p) x /= sum;
  const double p_best = p[static_cast<size_t>(best.id)];
  // top-p: the shortest prefix of the order whose running sum reaches top_p. Only the candidates
  // above a threshold are sorted (they are a prefix of the order, p rising with the logit); the
  // threshold falls until they hold top_p.
  if (sp.top_p < 1.0) {
    std::vector<Ranked> head;
    for (double tau : {1e-2, 1e-4, 1e-8, 1e-16, 0.0}) {
      head.clear();
      double mass = 0;
      for (int64_t t = 0; t < V; ++t)
        if (p[static_cast<size_t>(t)] > tau * p_best || (tau == 0.0 && member(t))) {
          head.push_back({logit(l, t), t});
          mass += p[static_cast<size_t>(t)];
        }
      if (mass < sp.top_p && tau > 0.0) continue;
      std::sort(head.begin(), head.end(), before);
      double acc = 0;
      size_t n = 0;
      while (n < head.size() && (acc += p[static_cast<size_t>(head[n].id)]) < sp.top_p) ++n;
      if (n == head.size()) {
        if (tau > 0.0) continue;
        break;  // rounding: the whole row stays
      }
      const Ranked boundary = head[n];
      for (int64_t t = 0; t < V; ++t)
        if (before(boundary, Ranked{logit(l, t), t})) p[static_cast<size_t>(t)] = 0.0;
      break;
    }
  }
  // min-p: the run of candidates whose probability is at least min_p x the first's.
  if (sp.min_p > 0.0)
    for (double& x : p)
      if (x < sp.min_p * p_best) x = 0.0;
  double kept = 0;
  for (double x : p) kept += x;
  for (double& x : p) x /= kept;
  return p;
}

int64_t draw_by_id(std::span<const double> w, double u) {
  double total = 0;
  for (double x : w) total += x;
  KV_CHECK(total > 0.0, "internal: a draw from " << w.size() << " weights that sum to " << total);
  const double r = u * total;
  double acc = 0;
  int64_t last = -1;
  for (size_t t = 0; t < w.size(); ++t) {
    if (w[t] <= 0.0) continue;
    last = static_cast<int64_t>(t);
    if ((acc += w[t]) > r) return last;
  }
  return last;
}

int64_t accept_or_resample(std::span<const double> p, std::span<const double> q, int64_t x, double u_accept,
                           double u_residual) {
  KV_CHECK(p.size() == q.size() && x >= 0 && x < static_cast<int64_t>(p.size()) && q[static_cast<size_t>(x)] > 0.0,
           "internal: verifying draft " << x << " drawn from " << q.size() << " probabilities against " << p.size());
  const auto xi = static_cast<size_t>(x);
  if (u_accept * q[xi] < p[xi]) return x;
  std::vector<double> residual(p.size());
  double mass = 0;
  for (size_t t = 0; t < p.size(); ++t) mass += residual[t] = std::max(0.0, p[t] - q[t]);
  // p and q equal up to rounding (a rejection with probability ~1e-16): p itself.
  return mass > 0.0 ? draw_by_id(residual, u_residual) : draw_by_id(p, u_residual);
}

}  // namespace kvserve
