#pragma once
// Speculative sampling over whole distributions: the distribution a request's temperature draw
// samples from, a draw from such a distribution, and the rule that keeps a draft token drawn from a
// draft distribution q while leaving every emitted token distributed as the target p.
#include <cstdint>
#include <span>
#include <vector>

#include "backend/sampling/sampling_params.h"

namespace kvserve {

// What a temperature draw of SamplerBank samples a row's token from, by token id: softmax(l / T)
// over the top-k candidates, cut to top-p's shortest prefix and min-p's run (the candidates in
// descending logit order, lower id first), renormalised over what is kept; 0 elsewhere. Equal to
// the sampler's own arithmetic up to float64 rounding of its sums. `logits` fp32 [V] after every
// edit the request's row got (penalties, grammar, EOS ban); params.temperature must be > 0. A row
// with nothing finite to keep (a grammar dead end) gives all mass to its first maximum.
std::vector<double> kept_distribution(const float* logits, int64_t V, const SamplingParams& params);

// The first id whose running sum (in id order) exceeds u x the total; u in [0, 1). A weight vector
// need not be normalised. Ids of weight 0 are never drawn.
int64_t draw_by_id(std::span<const double> weights, double u);

// Speculative sampling (Leviathan et al. 2023, Algorithm 1): a draft token x drawn from q is kept
// when u_accept < p(x) / q(x); otherwise the token is drawn (u_residual) from max(0, p - q)
// renormalised, which never holds x. The result is distributed as p whatever q is. p, q: [V]
// distributions (p normalised; q(x) > 0).
int64_t accept_or_resample(std::span<const double> p, std::span<const double> q, int64_t x, double u_accept,
                           double u_residual);

}  // namespace kvserve
