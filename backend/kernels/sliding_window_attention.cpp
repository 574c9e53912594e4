#include "backend/kernels/sliding_window_attention.h"

#include <algorithm>

#include "common/check.h"

namespace kvserve {

torch::Tensor sliding_window_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       int64_t q_start, int64_t k_start, int64_t window) {
  KV_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(2) == k.size(2),
           "internal: sliding-window attention of q " << q.sizes() << ", k " << k.sizes() << ", v " << v.sizes());
  const int64_t H = q.size(0), T = q.size(1), KV = k.size(0), P = k.size(1);
  KV_CHECK(window > 0 && H % KV == 0, "internal: sliding-window attention with window " << window);
  KV_CHECK(k_start + P == q_start + T && k_start <= q_start,
           "internal: keys [" << k_start << ", " << k_start + P << ") do not end at the queries' end " << q_start + T);
  // A block of queries needs keys from (its first position - window, its last position]: with blocks
  // of about a window, every block reads at most twice a window of keys.
  const int64_t block = std::max<int64_t>(window, 256);
  torch::Tensor out = T <= block ? torch::Tensor() : torch::empty({H, T, q.size(2)}, q.options());
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
  for (int64_t a = 0; a < T; a += block) {
    const int64_t n = std::min(block, T - a);
    const int64_t first_q = q_start + a, last_q = first_q + n - 1;
    const int64_t k_lo = std::max(k_start, first_q - window + 1), k_hi = last_q + 1;  // key positions [k_lo, k_hi)
    const int64_t m = k_hi - k_lo;
    auto qpos = torch::arange(first_q, last_q + 1, i64).view({n, 1});
    auto kpos = torch::arange(k_lo, k_hi, i64).view({1, m});
    // True = attend (SDPA's boolean mask): causal and inside the window.
    auto mask = (kpos <= qpos) & (kpos > qpos - window);
    auto kb = k.narrow(1, k_lo - k_start, m).unsqueeze(0), vb = v.narrow(1, k_lo - k_start, m).unsqueeze(0);
    auto a_out = at::scaled_dot_product_attention(q.narrow(1, a, n).unsqueeze(0), kb, vb, mask, 0.0, /*is_causal=*/false,
                                                  std::nullopt, /*enable_gqa=*/H != KV)
                     .squeeze(0);
    if (T <= block) return a_out;
    out.narrow(1, a, n).copy_(a_out);
  }
  return out;
}

}  // namespace kvserve
