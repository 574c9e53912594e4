#include "backend/kernels/chunk_attention.h"

#include "common/check.h"

namespace kvserve {
namespace {

// Below this many queries the split's second call and merge cost more than the causal half saves
// (measured on 2 cores with SmolLM2-135M's 9 heads of 64: a 100-token question after 7.9K cached
// positions is 25 % slower split, 5.5K tokens after 2.5K are 1.8x faster).
constexpr int64_t kMinSplitQueries = 512;

torch::Tensor masked(const torch::Tensor& q, const torch::Tensor& pk, const torch::Tensor& pv, const torch::Tensor& k,
                     const torch::Tensor& v) {
  const int64_t T = q.size(1), P = pk.size(1);
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(q.device());
  auto qi = torch::arange(T, i64).unsqueeze(1);
  auto kj = torch::arange(P + T, i64).unsqueeze(0);
  auto mask = kj <= qi + P;  // [T, P + T]
  auto kc = torch::cat({pk, k}, 1), vc = torch::cat({pv, v}, 1);
  return at::scaled_dot_product_attention(q.unsqueeze(0), kc.unsqueeze(0), vc.unsqueeze(0), mask, 0.0,
                                          /*is_causal=*/false, std::nullopt, /*enable_gqa=*/q.size(0) != k.size(0))
      .squeeze(0);
}

}  // namespace

bool chunk_attention_splits(int64_t t, int64_t p, const torch::Device& device) {
  return device.is_cpu() && p > 0 && t >= kMinSplitQueries;
}

torch::Tensor chunk_attention(const torch::Tensor& q, const torch::Tensor& pk, const torch::Tensor& pv,
                              const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), KV = k.size(0), P = pk.size(1);
  KV_CHECK(KV > 0 && H % KV == 0 && k.size(1) == T && pk.size(0) == KV && pk.size(2) == D,
           "internal: chunk attention of q " << q.sizes() << " over earlier keys " << pk.sizes() << " and keys "
                                             << k.sizes());
  if (P == 0) {
    return at::scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), {}, 0.0,
                                            /*is_causal=*/true, std::nullopt, /*enable_gqa=*/H != KV)
        .squeeze(0);
  }
  if (!chunk_attention_splits(T, P, q.device())) return masked(q, pk, pv, k, v);
  const int64_t G = H / KV;
  // The earlier positions, unmasked: a KV head's G query heads fold into one sequence of G * T rows,
  // so the grouped keys are read as they are stored.
  auto qg = q.contiguous().view({1, KV, G * T, D});
  auto [o1, l1] = at::_scaled_dot_product_flash_attention_for_cpu(qg, pk.unsqueeze(0), pv.unsqueeze(0), 0.0, false);
  // The chunk's own positions, causally (square, so top-left alignment is the right one).
  auto ks = G == 1 ? k : k.repeat_interleave(G, 0), vs = G == 1 ? v : v.repeat_interleave(G, 0);
  auto [o2, l2] = at::_scaled_dot_product_flash_attention_for_cpu(q.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), 0.0, true);
  // softmax over both parts = each part's softmax weighted by its share of the total exp-sum.
  auto a = l1.reshape({H, T}).to(torch::kFloat32), b = l2.reshape({H, T}).to(torch::kFloat32);
  auto lse = torch::logaddexp(a, b);
  auto w1 = (a - lse).exp_().unsqueeze(-1), w2 = (b - lse).exp_().unsqueeze(-1);
  auto out = o1.reshape({H, T, D}).to(torch::kFloat32).mul_(w1).add_(o2.reshape({H, T, D}).to(torch::kFloat32).mul_(w2));
  return out.to(q.scalar_type());
}

torch::Tensor chunk_attention(const torch::Tensor& q, const torch::Tensor& pk, const torch::Tensor& pv,
                              const torch::Tensor& k, const torch::Tensor& v, const std::vector<int64_t>& head_lengths) {
  if (head_lengths.empty()) return chunk_attention(q, pk, pv, k, v);
  const int64_t H = q.size(0), KV = k.size(0);
  KV_CHECK(static_cast<int64_t>(head_lengths.size()) == KV && pk.size(0) == KV && H % KV == 0,
           "internal: chunk attention over " << head_lengths.size() << " head lengths for " << KV << " KV heads");
  const int64_t G = H / KV;
  std::vector<torch::Tensor> out;
  out.reserve(static_cast<size_t>(KV));
  for (int64_t h = 0; h < KV; ++h) {
    const int64_t n = head_lengths[static_cast<size_t>(h)];
    KV_CHECK(n >= 0 && n <= pk.size(1), "internal: KV head " << h << " holds " << n << " of " << pk.size(1) << " rows");
    out.push_back(chunk_attention(q.narrow(0, h * G, G), pk.narrow(0, h, 1).narrow(1, 0, n),
                                  pv.narrow(0, h, 1).narrow(1, 0, n), k.narrow(0, h, 1), v.narrow(0, h, 1)));
  }
  return torch::cat(out, 0);
}

}  // namespace kvserve
