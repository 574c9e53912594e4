#pragma once
// The model's small elementwise chains (RMSNorm with its residual add, RoPE of q and k with v's
// copy, SiLU-and-multiply), each one kernel on a CUDA device, one pass per row on the CPU
// (backend/kernels/fused_ops_cpu.h), and the plain torch op chain otherwise (other dtypes and layouts).
// All give transformers' rounding: every op of the chain returns the activations' dtype (fp32
// inside RMSNorm), and the kernels round where the chain does. The decode step on a GPU is bound by
// its number of kernels as much as by its bytes (docs/gpu.md), so these cut a layer's launches from
// ~40 to ~13 (8B decode step 1.28-1.32x faster on an H100, docs/gpu.md); on the CPU they cut the
// per-op dispatches and temporaries (docs/benchmarks.md, "Fused elementwise ops on the CPU").
//
// Two switches, read once at start, so that each path can be A/B'd against the chains in one
// binary: KVSERVE_FUSED_OPS=0|1|2 for CUDA (level()), KVSERVE_FUSED_OPS_CPU=0|1|2 for the CPU
// (cpu_level()). They are apart because the CUDA levels mean kernel variants the CPU has no
// counterpart of (and carry the K/V append's copy), and because each device's default follows its
// own A/B.
#include <torch/torch.h>

#include <cstdint>
#include <tuple>
#include <utility>

#include "backend/model/rope.h"

namespace kvserve::fused {

// Which ops run on a CUDA device: 0 the torch chains, 1 the fused kernels, 2 (the default) the fused
// kernels' vectorized variants (16-byte loads, a row over up to 1024 threads). KVSERVE_FUSED_OPS sets
// it at start; set_level changes it (tests, A/B runs).
int level();
void set_level(int level);

// True when x is on a CUDA device, the build has the kernels and level() is not 0.
bool active(const torch::Tensor& x);
// True when this build has the CUDA kernels.
bool compiled();

// Which ops run on the CPU: 0 the torch chains; 1 (the default) the loops that give the chains' bits
// (rope_qkv; rms_norm and add_rms_norm with the fp32 mean of the squares left to torch's own
// reduction; silu_mul stays the chain, whose exp is torch's); 2 every loop (the norms add their squares
// themselves, silu_mul has its own exp: the last fp32 bit may differ from the chain's). The chains'
// bits are transformers' bits on a CPU (docs/benchmarks.md), which is why 2 is not the default.
// KVSERVE_FUSED_OPS_CPU sets it at start; set_cpu_level changes it (tests, A/B runs).
int cpu_level();
void set_cpu_level(int level);
// True when x is a CPU tensor of fp32, bf16 or fp16 with elements and cpu_level() is not 0 (some ops
// also need level 2).
bool cpu_active(const torch::Tensor& x);

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
