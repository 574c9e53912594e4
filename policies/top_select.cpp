#include "top_select.h"

#include "kv_check.h"

namespace kvserve {

torch::Tensor stable_rank_order(const torch::Tensor& scores, int64_t n) {
  KV_CHECK(scores.dim() == 2, "stable_rank_order: scores must be [rows, N], got " << scores.sizes());
  const int64_t total = scores.size(1);
  KV_CHECK(n >= 0 && n <= total, "stable_rank_order: n=" << n << " outside [0, " << total << "]");
  if (n == 0) return torch::empty({scores.size(0), 0}, scores.options().dtype(torch::kInt64));
  // A stable descending sort keeps equal scores in position order, so ties go to the lower position.
  auto sorted = std::get<1>(torch::sort(scores, /*stable=*/true, /*dim=*/1, /*descending=*/true));
  return sorted.narrow(1, 0, n);
}

torch::Tensor stable_top_positions(const torch::Tensor& scores, int64_t n) {
  KV_CHECK(scores.dim() == 2, "stable_top_positions: scores must be [rows, N], got " << scores.sizes());
  if (n == scores.size(1)) return position_range(scores.size(0), 0, n, scores.device());
  return std::get<0>(torch::sort(stable_rank_order(scores, n), /*dim=*/1));
}

torch::Tensor position_range(int64_t rows, int64_t start, int64_t count, const torch::Device& device) {
  auto r = torch::arange(start, start + count, torch::TensorOptions().dtype(torch::kInt64).device(device));
  return r.unsqueeze(0).expand({rows, count}).contiguous();
}

}  // namespace kvserve
