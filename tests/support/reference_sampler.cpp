#include "tests/support/reference_sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/check.h"

namespace kvserve {

ReferenceSampler::ReferenceSampler(const SamplingParams& params, const std::vector<int64_t>& prompt,
                                 uint64_t fallback_seed, std::vector<int64_t> eos_ids)
    : params_(params), rng_(params.seed.value_or(fallback_seed)), eos_ids_(std::move(eos_ids)) {
  for (int64_t t : prompt) {
    if (t >= static_cast<int64_t>(seen_mask_.size())) seen_mask_.resize(t + 1, 0);
    if (!seen_mask_[t]) {
      seen_mask_[t] = 1;
      seen_.push_back(t);
    }
  }
}

void ReferenceSampler::observe(int64_t t) {
  ++output_counts_[t];
  if (t >= static_cast<int64_t>(seen_mask_.size())) seen_mask_.resize(t + 1, 0);
  if (!seen_mask_[t]) {
    seen_mask_[t] = 1;
    seen_.push_back(t);
  }
}

int64_t ReferenceSampler::sample(const torch::Tensor& logits_in, TokenLogprob* chosen, std::vector<TokenLogprob>* top) {
  KV_CHECK(logits_in.dim() == 1 && logits_in.scalar_type() == torch::kFloat32 && logits_in.device().is_cpu(),
           "sampler needs fp32 CPU logits [V]");
  torch::Tensor raw = logits_in.contiguous();
  const int64_t V = raw.numel();
  const float* rl = raw.data_ptr<float>();

  // Logprobs report the model's own distribution (before penalties and temperature), as vLLM does.
  std::vector<float> logprobs;
  if (params_.logprobs >= 0) {
    const float mx = *std::max_element(rl, rl + V);
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(rl[i] - mx));
    const float lse = mx + static_cast<float>(std::log(sum));
    logprobs.resize(V);
    for (int64_t i = 0; i < V; ++i) logprobs[i] = rl[i] - lse;
  }

  std::vector<float> l(rl, rl + V);
  if (params_.repetition_penalty != 1.0) {
    const float rp = static_cast<float>(params_.repetition_penalty);
    for (int64_t t : seen_) {
      if (t < V) l[t] = l[t] > 0 ? l[t] / rp : l[t] * rp;
    }
  }
  if (params_.presence_penalty != 0.0 || params_.frequency_penalty != 0.0) {
    for (auto [t, n] : output_counts_) {
      if (t < V) l[t] -= static_cast<float>(params_.frequency_penalty * n + params_.presence_penalty);
    }
  }

  int64_t token = 0;
  if (params_.temperature <= 0.0) {
    token = std::max_element(l.begin(), l.end()) - l.begin();  // first maximum, like torch.argmax
  } else {
    const double temp = params_.temperature;
    std::vector<int64_t> idx(V);
    std::iota(idx.begin(), idx.end(), 0);
    // Candidates in descending logit order (stable: lower id first on ties) so every filter is a prefix.
    int64_t n = V;
    if (params_.top_k > 0 && params_.top_k < V) {
      n = params_.top_k;
      std::partial_sort(idx.begin(), idx.begin() + n, idx.end(),
                        [&](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    } else {
      std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
    }
    std::vector<double> p(n);
    const double mx = l[idx[0]] / temp;
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += p[i] = std::exp(l[idx[i]] / temp - mx);
    for (auto& x : p) x /= sum;
    if (params_.top_p < 1.0) {
      double cum = 0;
      int64_t keep = 0;
      while (keep < n) {
        cum += p[keep++];
        if (cum >= params_.top_p) break;
      }
      n = std::max<int64_t>(keep, 1);
    }
    if (params_.min_p > 0.0) {
      const double floor = params_.min_p * p[0];
      int64_t keep = 1;
      while (keep < n && p[keep] >= floor) ++keep;
      n = keep;
    }
    double total = 0;
    for (int64_t i = 0; i < n; ++i) total += p[i];
    std::uniform_real_distribution<double> u(0.0, total);
    double r = u(rng_), acc = 0;
    token = idx[n - 1];
    for (int64_t i = 0; i < n; ++i) {
      acc += p[i];
      if (r < acc) {
        token = idx[i];
        break;
      }
    }
  }

  if (params_.logprobs >= 0) {
    if (chosen) *chosen = TokenLogprob{token, "", logprobs[token]};
    if (top && params_.logprobs > 0) {
      const int64_t k = std::min<int64_t>(params_.logprobs, V);
      std::vector<int64_t> ids(V);
      std::iota(ids.begin(), ids.end(), 0);
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int64_t a, int64_t b) {
        return logprobs[a] > logprobs[b] || (logprobs[a] == logprobs[b] && a < b);
      });
      top->clear();
      for (int64_t i = 0; i < k; ++i) top->push_back(TokenLogprob{ids[i], "", logprobs[ids[i]]});
    }
  }
  return token;
}

int64_t ReferenceSampler::sample_and_observe(const torch::Tensor& logits, bool ban_eos, TokenLogprob* chosen,
                                             std::vector<TokenLogprob>* top) {
  torch::Tensor row = logits.to(torch::kCPU, torch::kFloat32);
  if (ban_eos) {
    row = row.clone();
    for (int64_t e : eos_ids_)
      if (e >= 0 && e < row.numel()) row[e] = -std::numeric_limits<float>::infinity();
  }
  const int64_t token = sample(row, chosen, top);
  observe(token);
  return token;
}

}  // namespace kvserve
