#pragma once
// Head-wise allocation (AdaKV, Feng et al. 2024): a layer's budget spent by one top-k over all of
// its KV heads' scores, so that each head keeps its own number of tokens.
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace kvserve {

// What each KV head of a layer keeps: positions [KV, width] ascending per head, head h's first
// counts[h] entries real (the rest repeat valid positions, to be ignored), width = max(counts).
struct HeadSelection {
  torch::Tensor positions;
  std::vector<int64_t> counts;
  torch::Tensor kept{};  // bool [KV, N + window]: what each head keeps (adaptive_head_selection only)
};

// Selects KV * per_head positions of scores [KV, N] jointly: first each head's top `guaranteed`
// (its safeguard), then the best of the rest over all heads, ties to the lower (head, position).
// The trailing `window` positions [N, N + window) are kept by every head on top. 0 <= guaranteed
// <= per_head <= N. Scores of -inf are never chosen (a re-selection masks what a head no longer
// holds); each head needs `guaranteed` finite scores and all heads KV * per_head together.
HeadSelection adaptive_head_selection(const torch::Tensor& scores, int64_t per_head, int64_t guaranteed, int64_t window);

// Kept positions as one [KV, width] tensor with the per-head counts (a uniform selection: every
// count is the width).
HeadSelection uniform_head_selection(const torch::Tensor& positions);

}  // namespace kvserve
