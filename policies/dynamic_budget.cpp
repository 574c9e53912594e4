#include "policies/dynamic_budget.h"

#include <algorithm>
#include <numeric>

#include "common/check.h"

namespace kvserve {

std::vector<int64_t> dynamic_topk_hits(const std::vector<torch::Tensor>& layer_scores, int64_t k) {
  KV_CHECK(!layer_scores.empty(), "dynamic_topk_hits: no layers");
  const int64_t n = static_cast<int64_t>(layer_scores.size());
  std::vector<torch::Tensor> flat;
  flat.reserve(n);
  for (const auto& s : layer_scores) {
    KV_CHECK(s.defined() && s.sizes() == layer_scores[0].sizes(),
             "dynamic_topk_hits: every layer's scores must have the same shape " << layer_scores[0].sizes());
    flat.push_back(s.to(torch::kFloat32).reshape({1, -1}));
  }
  auto all = torch::cat(flat, 0);  // [n, heads*N], layer-major like the flat concatenation
  const int64_t per_layer = all.size(1);
  KV_CHECK(k >= 0 && k <= n * per_layer, "dynamic_topk_hits: k=" << k << " outside [0, " << n * per_layer << "]");
  std::vector<int64_t> hits(n, 0);
  if (k == 0) return hits;
  // The k-th largest value is the threshold; everything above it is a hit, and the remaining hits
  // go to the values equal to it in flat order (lower layer first, then lower head/position).
  auto thr = std::get<0>(torch::topk(all.reshape({-1}), k, 0, /*largest=*/true, /*sorted=*/false)).min();
  auto greater = (all > thr).sum(1).to(torch::kCPU);
  auto equal = (all == thr).sum(1).to(torch::kCPU);
  auto g = greater.accessor<int64_t, 1>();
  auto e = equal.accessor<int64_t, 1>();
  int64_t left = k;
  for (int64_t i = 0; i < n; ++i) left -= g[i];
  for (int64_t i = 0; i < n; ++i) {
    const int64_t take = std::min(left, e[i]);
    hits[i] = g[i] + take;
    left -= take;
  }
  KV_CHECK(left == 0, "dynamic_topk_hits: tie accounting failed (non-finite scores?)");
  return hits;
}

std::vector<int64_t> dynamic_rebudget(const std::vector<int64_t>& hits, int64_t bs, int64_t base,
                                      int64_t num_layers, int64_t cap, const std::vector<int64_t>& current) {
  const int64_t n = static_cast<int64_t>(hits.size());
  KV_CHECK(n >= 1 && n <= num_layers, "dynamic_rebudget: " << n << " layers seen of " << num_layers);
  KV_CHECK(static_cast<int64_t>(current.size()) >= n, "dynamic_rebudget: current budgets too short");
  std::vector<int64_t> c(n);
  for (int64_t i = 0; i < n; ++i) c[i] = hits[i] / n;
  int64_t sum_c = std::accumulate(c.begin(), c.end(), int64_t{0});
  if (sum_c == 0) {
    c = hits;
    sum_c = std::accumulate(c.begin(), c.end(), int64_t{0});
  }
  std::vector<int64_t> b(n, 0);
  if (sum_c > 0) {
    for (int64_t i = 0; i < n; ++i) b[i] = bs * c[i] / sum_c;
  }
  const int64_t total = base * num_layers;
  const int64_t sum_b = std::accumulate(b.begin(), b.end(), int64_t{0});
  if (sum_b == 0) {
    for (int64_t i = 0; i < n; ++i) b[i] = total / n;
  } else {
    for (int64_t i = 0; i < n; ++i) b[i] = b[i] * total / sum_b;
  }
  const int64_t assigned = std::accumulate(b.begin(), b.end(), int64_t{0});
  b[n - 1] += total - assigned;
  for (int64_t i = 0; i < n; ++i) b[i] = std::max<int64_t>(0, std::min({b[i], cap, current[i]}));
  return b;
}

std::vector<int64_t> dynamic_shape(std::vector<int64_t> b, const DynamicOptions& opts, int64_t base,
                                   const std::vector<int64_t>& prior) {
  const int64_t n = static_cast<int64_t>(b.size());
  const auto mn = static_cast<int64_t>(opts.min_ratio * static_cast<double>(base));
  if (mn > 0) {
    int64_t raise = 0, over = 0;
    for (int64_t x : b) {
      raise += std::max<int64_t>(0, mn - x);
      over += std::max<int64_t>(0, x - mn);
    }
    for (auto& x : b) {
      const int64_t above = std::max<int64_t>(0, x - mn);
      // The raise is taken from the layers above the minimum in proportion to their excess.
      x = std::max(x, mn) - (over > 0 ? std::min(above, raise * above / over) : 0);
    }
  }
  if (!prior.empty()) {
    KV_CHECK(static_cast<int64_t>(prior.size()) >= n, "dynamic_shape: prior has " << prior.size() << " layers, need " << n);
    for (int64_t i = 0; i < n; ++i) {
      b[i] = static_cast<int64_t>(opts.prior_weight * static_cast<double>(b[i]) +
                                  (1.0 - opts.prior_weight) * static_cast<double>(prior[i]));
    }
  }
  return b;
}

torch::Tensor normalize_scores(const torch::Tensor& scores, ScoreNorm norm, int64_t cap, int64_t kth) {
  if (norm == ScoreNorm::kNone) return scores;
  constexpr double kTiny = 1e-30;
  if (norm == ScoreNorm::kLayer) return scores / scores.sum().clamp_min(kTiny);
  auto rows = scores.reshape({-1, cap});
  torch::Tensor scale;
  if (norm == ScoreNorm::kHead) {
    scale = rows.sum(1, true);
  } else if (norm == ScoreNorm::kMax) {
    scale = std::get<0>(rows.max(1, true));
  } else {
    const int64_t k = std::clamp<int64_t>(kth, 1, cap);
    scale = std::get<0>(torch::topk(rows, k, 1)).narrow(1, k - 1, 1);
  }
  return (rows / scale.clamp_min(kTiny)).view(scores.sizes());
}

DynamicBudget::DynamicBudget(int64_t num_layers, int64_t base, int64_t bs, int64_t update_interval, int64_t cap,
                             DynamicOptions opts, std::vector<int64_t> prior)
    : num_layers_(num_layers), base_(base), bs_(bs), m_(update_interval), cap_(cap), opts_(opts),
      prior_(std::move(prior)), budgets_(num_layers, bs), scores_(num_layers), normed_(num_layers) {
  KV_CHECK(cap >= 0, "DynamicBudget: cap must be >= 0, got " << cap);
  KV_CHECK(prior_.empty() || static_cast<int64_t>(prior_.size()) == num_layers,
           "DynamicBudget: prior has " << prior_.size() << " layers, not " << num_layers);
  KV_CHECK(num_layers >= 1, "DynamicBudget: num_layers must be >= 1");
  KV_CHECK(base >= 0 && bs >= base, "DynamicBudget: need 0 <= base <= bs, got base=" << base << " bs=" << bs);
  KV_CHECK(update_interval >= 1, "DynamicBudget: update interval must be >= 1");
}

void DynamicBudget::set_layer_scores(int64_t layer, torch::Tensor scores) {
  KV_CHECK(layer >= 0 && layer < num_layers_, "DynamicBudget: layer " << layer << " out of range");
  KV_CHECK(scores.dim() == 2, "DynamicBudget: layer scores must be [heads, N], got " << scores.sizes());
  if (cap_ == 0) cap_ = scores.size(1);
  KV_CHECK(cap_ > 0 && scores.size(1) % cap_ == 0,
           "DynamicBudget: layer " << layer << " scores " << scores.sizes() << " are not rows of " << cap_ << " positions");
  if (scores.scalar_type() != torch::kFloat32) scores = scores.to(torch::kFloat32);
  const auto kth = std::max<int64_t>(1, static_cast<int64_t>(opts_.norm_rank * static_cast<double>(base_)));
  normed_[layer] = normalize_scores(scores, opts_.norm, cap_, kth);
  scores_[layer] = std::move(scores);
}

bool DynamicBudget::has_layer_scores(int64_t layer) const {
  return layer >= 0 && layer < num_layers_ && scores_[layer].defined();
}

const torch::Tensor& DynamicBudget::layer_scores(int64_t layer) const {
  KV_CHECK(has_layer_scores(layer), "DynamicBudget: no scores for layer " << layer);
  return scores_[layer];
}

std::vector<int64_t> DynamicBudget::update(int64_t n) {
  KV_CHECK(n >= 1 && n <= num_layers_, "DynamicBudget::update: n=" << n);
  std::vector<torch::Tensor> seen;
  seen.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    KV_CHECK(has_layer_scores(i), "DynamicKV update after layer " << n - 1 << " needs the scores of layer " << i
                                                                  << " (import them from the stage that owns it)");
    seen.push_back(normed_[i]);
  }
  const int64_t rows = seen[0].numel() / cap_;  // ranking rows per layer (KV heads, or query heads)
  const auto hits = dynamic_topk_hits(seen, base_ * rows * n);
  auto nb = dynamic_rebudget(hits, bs_, base_, num_layers_, cap_, budgets_);
  if (!opts_.is_paper()) {
    nb = dynamic_shape(std::move(nb), opts_, base_, prior_);
    for (int64_t i = 0; i < n; ++i) nb[i] = std::max<int64_t>(0, std::min({nb[i], cap_, budgets_[i]}));
  }
  std::copy(nb.begin(), nb.end(), budgets_.begin());
  if (n == num_layers_) final_done_ = true;
  return nb;
}

std::optional<std::vector<int64_t>> DynamicBudget::final_update() {
  if (!final_update_due()) return std::nullopt;
  return update(num_layers_);
}

}  // namespace kvserve
