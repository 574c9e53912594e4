#pragma once
// The CPU loops behind the fused elementwise ops (backend/kernels/fused_ops.h): one pass over each row in
// place of a chain of torch ops (a dispatch and a temporary each), rounding where the chain rounds.
// fused_ops.cpp checks the layouts below before it calls them and keeps the chain for the rest.
#include <torch/torch.h>

#include <cstdint>
#include <tuple>
#include <utility>

namespace kvserve::fused::cpu {

// True for a CPU tensor of a dtype the loops take (fp32, bf16, fp16).
bool supports(const torch::Tensor& x);

// x [rows, cols] with unit column stride (rows at any stride); w [cols] contiguous, x's dtype.
// Returns the contiguous [rows, cols] norm. exact: the mean of the squares comes from torch's own
// reduction, so the result has the chain's bits (one dispatch); else the loop adds the squares in
// fp64 and the result may differ from the chain's in the last bit (fp32) or by a rounding step of a
// 16-bit dtype in a few elements in 1e4.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool exact);

// x and delta laid out as rms_norm's x: returns {x + delta, rms_norm(x + delta)}, both contiguous.
std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                     const torch::Tensor& w, double eps, bool exact);

// qkv [N, (H + 2 KV) D] with unit column stride, cos and sin contiguous with N * D elements of qkv's
// dtype, D even: returns contiguous q [N, H, D] and k [N, KV, D] rotated, and v [N, KV, D]; the
// chain's bits.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_qkv(const torch::Tensor& qkv, const torch::Tensor& cos,
                                                                 const torch::Tensor& sin, int64_t q_heads,
                                                                 int64_t kv_heads, int64_t head_dim);

// gu [N, 2I] with unit column stride: returns the contiguous silu(gu[:, :I]) * gu[:, I:]. Its e^x
// is not torch's: within a few fp32 ulps of the chain, a 16-bit dtype's rounding of silu moved by one
// step in a few elements in 1e4.
torch::Tensor silu_mul(const torch::Tensor& gu, int64_t inter);

}  // namespace kvserve::fused::cpu
