#include "policies/head_allocation.h"

#include <algorithm>

#include "common/check.h"
#include "policies/top_select.h"

namespace kvserve {

HeadSelection adaptive_head_selection(const torch::Tensor& scores, int64_t per_head, int64_t guaranteed, int64_t window) {
  KV_CHECK(scores.dim() == 2, "adaptive_head_selection: scores must be [KV, N], got " << scores.sizes());
  const int64_t heads = scores.size(0), n = scores.size(1);
  KV_CHECK(per_head >= 0 && per_head <= n, "adaptive_head_selection: " << per_head << " per head outside [0, " << n << "]");
  KV_CHECK(guaranteed >= 0 && guaranteed <= per_head,
           "adaptive_head_selection: guaranteed " << guaranteed << " outside [0, " << per_head << "]");
  KV_CHECK(window >= 0, "adaptive_head_selection: negative window " << window);
  const auto s = scores.to(torch::kFloat32).contiguous();
  const auto bool_opts = s.options().dtype(torch::kBool);
  auto scored = torch::zeros({heads, n}, bool_opts);
  if (guaranteed > 0) scored.scatter_(1, stable_top_positions(s, guaranteed), true);
  // The rest of the layer's total goes to the best scores not yet kept, whichever head holds them;
  // flattening head-major breaks ties to the lower head, then the lower position.
  const int64_t rest = heads * (per_head - guaranteed);
  if (rest > 0) {
    constexpr float kLow = -std::numeric_limits<float>::infinity();
    auto flat = s.masked_fill(scored, kLow).reshape({1, heads * n});
    auto pick = stable_top_positions(flat, rest).reshape({-1});
    scored.view({-1}).index_fill_(0, pick, true);
  }
  const auto kept = window > 0 ? torch::cat({scored, torch::ones({heads, window}, bool_opts)}, 1) : scored;
  const int64_t total = n + window;
  auto counts_t = kept.sum(1).to(torch::kCPU);
  HeadSelection out;
  out.counts.assign(counts_t.data_ptr<int64_t>(), counts_t.data_ptr<int64_t>() + heads);
  const int64_t width = heads == 0 ? 0 : *std::max_element(out.counts.begin(), out.counts.end());
  // Kept positions first in ascending order, then the dropped ones (padding that indexes validly).
  auto idx = torch::arange(total, s.options().dtype(torch::kInt64)).unsqueeze(0).expand({heads, total});
  auto key = torch::where(kept, idx, idx + total);
  out.positions = std::get<0>(torch::sort(key, 1)).narrow(1, 0, width).remainder(total).contiguous();
  KV_CHECK(static_cast<int64_t>(kept.sum().item<int64_t>()) == heads * (per_head + window),
           "adaptive_head_selection: selected " << kept.sum().item<int64_t>() << " positions, expected "
                                                << heads * (per_head + window) << " (non-finite scores?)");
  out.kept = kept;
  return out;
}

HeadSelection uniform_head_selection(const torch::Tensor& positions) {
  return {positions, std::vector<int64_t>(static_cast<size_t>(positions.size(0)), positions.size(1))};
}

}  // namespace kvserve
