#pragma once
// The model's small elementwise chains (RMSNorm with its residual add, RoPE of q and k with v's
// copy, SiLU-and-multiply), each one kernel on a CUDA device and the plain torch op chain elsewhere.
// Both give transformers' rounding: every op of the chain returns the activations' dtype (fp32
// inside RMSNorm), and the kernels round where the chain does. The decode step on a GPU is bound by
// its number of kernels as much as by its bytes (docs/gpu.md), so these cut a layer's launches from
// ~40 to ~11. They are opt-in for now: KVSERVE_FUSED_OPS=1 in the environment turns them on (the
// fp32 logits reference test failed with them on in their only GPU run; docs/gpu.md).
#include <torch/torch.h>

#include <cstdint>
#include <tuple>
#include <utility>

#include "backend/rope.h"

namespace kvserve::fused {

// True when x is on a CUDA device, the build has the kernels and KVSERVE_FUSED_OPS is 1.
bool active(const torch::Tensor& x);
// True when this build has the CUDA kernels.
bool compiled();

// w * dtype(fp32(x) * rsqrt(mean(fp32(x)^2, -1) + eps)), over x's last dimension.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);

// The residual add and the next norm: x' = x + delta (in x's dtype), returns {x', rms_norm(x')}.
std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                     const torch::Tensor& w, double eps);

// Splits a QKV projection [N, (H + 2 KV) * D] into contiguous q [N, H, D] and k [N, KV, D], both
// rotated by RoPE at the angles' rows, and v [N, KV, D].
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_qkv(const torch::Tensor& qkv, const RopeAngles& angles,
                                                                 int64_t q_heads, int64_t kv_heads, int64_t head_dim);

// silu(gu[:, :I]) * gu[:, I:] for gu [N, 2I].
torch::Tensor silu_mul(const torch::Tensor& gu, int64_t inter);

}  // namespace kvserve::fused
