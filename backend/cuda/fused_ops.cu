// The decode step's fused elementwise kernels (see fused_ops.cuh). Why these: a decode layer ran
// ~40 kernels, of which ~27 were the small ops of two RMSNorms, RoPE of q and k, v's copy, SiLU,
// the multiply and the residual adds; at batch sizes of 1-64 each is a few microseconds of launch,
// ramp-up and drain inside the graph for almost no bytes (docs/gpu.md). One kernel per chain:
// - RMSNorm: one CTA per row; the row is read once into fp32 registers/shared sums, the residual
//   sum rounded to the dtype first (as `x + delta` in the dtype does), written back, normalised.
// - RoPE: one CTA per row covers q, k and v: rotation needs only the partner element d +/- D/2 of
//   the same head, so each thread computes its outputs independently.
// - SiLU-and-mul: grid-stride over rows x inter.
#include "backend/cuda/fused_ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

namespace kvserve::fused_kernels {
namespace {

constexpr int kThreads = 256;

template <typename T> __device__ __forceinline__ float load(const T* p, int64_t i);
template <> __device__ __forceinline__ float load<float>(const float* p, int64_t i) { return p[i]; }
template <> __device__ __forceinline__ float load<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <> __device__ __forceinline__ float load<__half>(const __half* p, int64_t i) { return __half2float(p[i]); }

template <typename T> __device__ __forceinline__ T cast(float v);
template <> __device__ __forceinline__ float cast<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 cast<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half cast<__half>(float v) { return __float2half_rn(v); }

// v rounded to T and widened again: what a torch op returning T leaves for the next op.
template <typename T> __device__ __forceinline__ float rnd(float v);
template <> __device__ __forceinline__ float rnd<float>(float v) { return v; }
template <> __device__ __forceinline__ float rnd<__nv_bfloat16>(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
template <> __device__ __forceinline__ float rnd<__half>(float v) { return __half2float(__float2half_rn(v)); }

__device__ __forceinline__ float block_sum(float v, float* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) shared[0] = v;
  }
  __syncthreads();
  return shared[0];
}

template <typename T>
__global__ void rms_norm_kernel(RmsNormArgs a) {
  __shared__ float sums[kThreads / 32];
  const int64_t r = blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + r * a.x_stride;
  const T* delta = a.delta ? static_cast<const T*>(a.delta) + r * a.delta_stride : nullptr;
  T* x_out = a.delta ? static_cast<T*>(a.x_out) + r * a.cols : nullptr;
  T* out = static_cast<T*>(a.out) + r * a.cols;
  const T* w = static_cast<const T*>(a.w);
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < a.cols; i += blockDim.x) {
    float v = load(x, i);
    if (delta) {
      v = rnd<T>(__fadd_rn(v, load(delta, i)));
      x_out[i] = cast<T>(v);
    }
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss, sums) * (1.0f / static_cast<float>(a.cols)) + a.eps);
  for (int64_t i = threadIdx.x; i < a.cols; i += blockDim.x) {
    // Re-read (x_out for the residual case: this thread wrote exactly these elements above).
    const float v = delta ? load(static_cast<const T*>(x_out), i) : load(x, i);
    out[i] = cast<T>(__fmul_rn(load(w, i), rnd<T>(__fmul_rn(v, inv))));
  }
}

template <typename T>
__global__ void rope_qkv_kernel(RopeQkvArgs a) {
  const int64_t r = blockIdx.x;
  const int64_t D = a.head_dim, half = D / 2, H = a.q_heads, KV = a.kv_heads;
  const T* row = static_cast<const T*>(a.qkv) + r * a.qkv_stride;
  const T* cs = static_cast<const T*>(a.cos) + r * D;
  const T* sn = static_cast<const T*>(a.sin) + r * D;
  const int64_t n = (H + 2 * KV) * D;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t head = i / D, d = i % D;
    if (head >= H + KV) {
      static_cast<T*>(a.v)[(r * KV + head - H - KV) * D + d] = row[i];
      continue;
    }
    const float x = load(row, i);
    const float partner = d < half ? -load(row, i + half) : load(row, i - half);
    // _rn intrinsics: no fused multiply-add, so fp32 rounds exactly as the chain's three ops do.
    const float y = rnd<T>(__fadd_rn(rnd<T>(__fmul_rn(x, load(cs, d))), rnd<T>(__fmul_rn(partner, load(sn, d)))));
    if (head < H) {
      static_cast<T*>(a.q)[(r * H + head) * D + d] = cast<T>(y);
    } else {
      static_cast<T*>(a.k)[(r * KV + head - H) * D + d] = cast<T>(y);
    }
  }
}

template <typename T>
__global__ void silu_mul_kernel(SiluMulArgs a) {
  const int64_t total = a.rows * a.inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.inter, c = i % a.inter;
    const T* row = static_cast<const T*>(a.gu) + r * a.gu_stride;
    const float g = load(row, c);
    const float s = rnd<T>(g / (1.0f + expf(-g)));
    static_cast<T*>(a.out)[i] = cast<T>(__fmul_rn(s, load(row, a.inter + c)));
  }
}

template <template <typename> class Launch, typename Args>
cudaError_t dispatch(const Args& a, dim3 grid, cudaStream_t stream) {
  switch (a.dtype) {
    case DType::kFloat32: Launch<float>::run(a, grid, stream); break;
    case DType::kBFloat16: Launch<__nv_bfloat16>::run(a, grid, stream); break;
    case DType::kFloat16: Launch<__half>::run(a, grid, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename T> struct RmsNormLaunch {
  static void run(const RmsNormArgs& a, dim3 g, cudaStream_t s) { rms_norm_kernel<T><<<g, kThreads, 0, s>>>(a); }
};
template <typename T> struct RopeLaunch {
  static void run(const RopeQkvArgs& a, dim3 g, cudaStream_t s) { rope_qkv_kernel<T><<<g, kThreads, 0, s>>>(a); }
};
template <typename T> struct SiluMulLaunch {
  static void run(const SiluMulArgs& a, dim3 g, cudaStream_t s) { silu_mul_kernel<T><<<g, kThreads, 0, s>>>(a); }
};

bool fits_grid(int64_t rows) { return rows > 0 && rows <= 0x7fffffff; }

}  // namespace

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (!fits_grid(a.rows) || a.cols <= 0 || a.x == nullptr || a.out == nullptr || a.w == nullptr ||
      (a.delta != nullptr && a.x_out == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return dispatch<RmsNormLaunch>(a, dim3(static_cast<unsigned>(a.rows)), stream);
}

cudaError_t launch_rope_qkv(const RopeQkvArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (!fits_grid(a.rows) || a.head_dim <= 0 || a.head_dim % 2 != 0 || a.q_heads <= 0 || a.kv_heads <= 0 ||
      a.qkv == nullptr || a.cos == nullptr || a.sin == nullptr || a.q == nullptr || a.k == nullptr || a.v == nullptr) {
    return cudaErrorInvalidValue;
  }
  return dispatch<RopeLaunch>(a, dim3(static_cast<unsigned>(a.rows)), stream);
}

cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream) {
  const int64_t total = a.rows * a.inter;
  if (total == 0) return cudaSuccess;
  if (a.rows < 0 || a.inter <= 0 || a.gu == nullptr || a.out == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535);
  return dispatch<SiluMulLaunch>(a, dim3(static_cast<unsigned>(blocks)), stream);
}

}  // namespace kvserve::fused_kernels
