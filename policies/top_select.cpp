#include "policies/top_select.h"

#include "common/check.h"

namespace kvserve {

namespace {

// Mask [rows, N] with exactly n true per row: every score above the row's n-th largest, plus the
// lowest-positioned scores equal to it. O(N) plus a partial top-k, no full sort.
torch::Tensor top_mask(const torch::Tensor& scores, int64_t n) {
  auto thr = std::get<0>(torch::topk(scores, n, 1, /*largest=*/true, /*sorted=*/false)).amin(1, /*keepdim=*/true);
  auto above = scores > thr;
  auto tied = scores == thr;
  auto need = n - above.sum(1, /*keepdim=*/true);
  return above.logical_or_(tied.logical_and(tied.cumsum(1) <= need));
}

}  // namespace

torch::Tensor stable_top_positions(const torch::Tensor& scores, int64_t n) {
  KV_CHECK(scores.dim() == 2, "stable_top_positions: scores must be [rows, N], got " << scores.sizes());
  const int64_t rows = scores.size(0), total = scores.size(1);
  KV_CHECK(n >= 0 && n <= total, "stable_top_positions: n=" << n << " outside [0, " << total << "]");
  if (n == total) return position_range(rows, 0, n, scores.device());
  if (n == 0) return torch::empty({rows, 0}, scores.options().dtype(torch::kInt64));
  // nonzero walks row-major, so each row's positions come out ascending.
  auto idx = top_mask(scores, n).nonzero();
  KV_CHECK(idx.size(0) == rows * n, "stable_top_positions: selection lost positions (non-finite scores?)");
  return idx.select(1, 1).reshape({rows, n});
}

torch::Tensor stable_rank_order(const torch::Tensor& scores, int64_t n) {
  KV_CHECK(scores.dim() == 2, "stable_rank_order: scores must be [rows, N], got " << scores.sizes());
  KV_CHECK(n >= 0 && n <= scores.size(1), "stable_rank_order: n=" << n << " outside [0, " << scores.size(1) << "]");
  if (n == 0) return torch::empty({scores.size(0), 0}, scores.options().dtype(torch::kInt64));
  // Top n by position, then a stable descending sort of just those: ties stay in position order.
  auto pos = stable_top_positions(scores, n);
  auto order = std::get<1>(torch::sort(scores.gather(1, pos), /*stable=*/true, /*dim=*/1, /*descending=*/true));
  return pos.gather(1, order);
}

torch::Tensor position_range(int64_t rows, int64_t start, int64_t count, const torch::Device& device) {
  auto r = torch::arange(start, start + count, torch::TensorOptions().dtype(torch::kInt64).device(device));
  return r.unsqueeze(0).expand({rows, count}).contiguous();
}

}  // namespace kvserve
