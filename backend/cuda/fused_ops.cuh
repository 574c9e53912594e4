#pragma once
// Raw-pointer launchers of the decode step's fused elementwise kernels (RMSNorm with the residual
// add, RoPE of q and k with v's copy, SiLU-and-multiply). Plain CUDA on purpose: nvcc never parses
// ATen here; the torch wrappers (backend/kernels/fused_ops.h) are compiled by the host compiler.
//
// Each kernel rounds where the torch op chain it replaces rounds (every op of that chain returns the
// activations' dtype, fp32 inside RMSNorm), so bf16 results equal the chain's up to the order of
// RMSNorm's sum of squares.
#include <cuda_runtime.h>

#include <cstdint>

namespace kvserve::fused_kernels {

// Element type of every tensor of a call.
enum class DType { kFloat32, kBFloat16, kFloat16 };

// out[r] = w * dtype(x'[r] * rsqrt(mean(x'[r]^2) + eps)), x' = x (no delta) or dtype(x + delta),
// the fp32 part as transformers' RMSNorm. With a delta, x' is also written to x_out.
//   x, delta, x_out, out: rows x cols, row r at r * stride (stride >= cols, elements contiguous)
//   w: [cols]
struct RmsNormArgs {
  const void* x = nullptr;
  const void* delta = nullptr;  // nullptr: no residual add (x_out unused)
  void* x_out = nullptr;
  void* out = nullptr;
  const void* w = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t x_stride = 0, delta_stride = 0;  // x_out and out are contiguous [rows, cols]
  float eps = 1e-6f;
  DType dtype = DType::kFloat32;
  bool vectorized = false;  // 16-byte loads held in registers, where cols and the pointers allow
};
cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream);

// Splits one projection row [q heads | k heads | v heads] (row stride qkv_stride) into contiguous
// q [rows, H, D] and k [rows, KV, D] rotated by RoPE (x * cos + rotate_half(x) * sin, each product
// and the sum rounded to dtype) and v [rows, KV, D] copied. cos, sin: [rows, D] contiguous.
struct RopeQkvArgs {
  const void* qkv = nullptr;
  int64_t qkv_stride = 0;
  const void* cos = nullptr;
  const void* sin = nullptr;
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  int64_t rows = 0, q_heads = 0, kv_heads = 0, head_dim = 0;  // head_dim even
  DType dtype = DType::kFloat32;
  bool vectorized = false;  // one thread per pair of 16-byte vectors (d, d + D/2), where D and the pointers allow
};
cudaError_t launch_rope_qkv(const RopeQkvArgs& a, cudaStream_t stream);

// out[r, i] = dtype(dtype(silu(gu[r, i])) * gu[r, inter + i]) for i < inter; gu rows at r * gu_stride.
struct SiluMulArgs {
  const void* gu = nullptr;
  int64_t gu_stride = 0;
  void* out = nullptr;  // contiguous [rows, inter]
  int64_t rows = 0, inter = 0;
  DType dtype = DType::kFloat32;
};
cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream);

}  // namespace kvserve::fused_kernels
