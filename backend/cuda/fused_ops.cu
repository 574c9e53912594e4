// The decode step's fused elementwise kernels (see fused_ops.cuh). Why these: a decode layer ran
// ~40 kernels, of which ~27 were the small ops of two RMSNorms, RoPE of q and k, v's copy, SiLU,
// the multiply and the residual adds; at batch sizes of 1-64 each is a few microseconds of launch,
// ramp-up and drain inside the graph for almost no bytes (docs/gpu.md). One kernel per chain:
// - RMSNorm: one CTA per row; the row is read once into fp32 registers/shared sums, the residual
//   sum rounded to the dtype first (as `x + delta` in the dtype does), written back, normalised.
// - RoPE: one CTA per row covers q, k and v: rotation needs only the partner element d +/- D/2 of
//   the same head, so each thread computes its outputs independently.
// - SiLU-and-mul: grid-stride over rows x inter.
// The vectorized variants (Args::vectorized) exist because the scalar ones are latency-bound at
// decode's batch sizes: one CTA per row walks the row in a loop whose loads cannot pass the
// previous iteration's stores (the pointers may alias), so an 8B layer's norm took ~17 us and its
// RoPE ~18 us under ncu (docs/gpu.md) for 8-24 KB. They issue every 16-byte load of a row before
// the first store, hold the row in registers, and spread a row over up to 1024 threads.
#include "backend/cuda/fused_ops.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backend/cuda/element_load.cuh"

namespace kvserve::fused_kernels {
namespace {

constexpr int kThreads = 256;

using cuda_elements::load;

template <typename T> __device__ __forceinline__ T cast(float v);
template <> __device__ __forceinline__ float cast<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 cast<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half cast<__half>(float v) { return __float2half_rn(v); }

// v rounded to T and widened again: what a torch op returning T leaves for the next op.
template <typename T> __device__ __forceinline__ float rnd(float v);
template <> __device__ __forceinline__ float rnd<float>(float v) { return v; }
template <> __device__ __forceinline__ float rnd<__nv_bfloat16>(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
template <> __device__ __forceinline__ float rnd<__half>(float v) { return __half2float(__float2half_rn(v)); }

// 16 bytes of T: the unit of the vectorized kernels' loads and stores.
template <typename T> struct Vec {
  static constexpr int kN = 16 / sizeof(T);
  uint4 raw;
  __device__ __forceinline__ float get(int e) const { return load(reinterpret_cast<const T*>(&raw), e); }
  __device__ __forceinline__ void set(int e, float v) { reinterpret_cast<T*>(&raw)[e] = cast<T>(v); }
};
template <typename T> __device__ __forceinline__ Vec<T> vload(const T* p, int64_t i) {
  return Vec<T>{__ldg(reinterpret_cast<const uint4*>(p + i))};
}
template <typename T> __device__ __forceinline__ void vstore(T* p, int64_t i, const Vec<T>& v) {
  *reinterpret_cast<uint4*>(p + i) = v.raw;
}

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
  __shared__ float sums[32];
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

// The row in registers: thread t holds vectors t, t + blockDim, ... (kPer of them at most).
template <typename T, int kPer>
__global__ void __launch_bounds__(1024) rms_norm_vec_kernel(RmsNormArgs a) {
  constexpr int N = Vec<T>::kN;
  __shared__ float sums[32];
  const int64_t r = blockIdx.x;
  const int64_t nv = a.cols / N;
  const T* x = static_cast<const T*>(a.x) + r * a.x_stride;
  const T* delta = a.delta ? static_cast<const T*>(a.delta) + r * a.delta_stride : nullptr;
  const T* w = static_cast<const T*>(a.w);
  Vec<T> xv[kPer], dv[kPer], wv[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (i < nv) {
      xv[j] = vload(x, i * N);
      if (delta) dv[j] = vload(delta, i * N);
      wv[j] = vload(w, i * N);
    }
  }
  float v[kPer][N];
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (i >= nv) continue;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      v[j][e] = delta ? rnd<T>(__fadd_rn(xv[j].get(e), dv[j].get(e))) : xv[j].get(e);
      ss += v[j][e] * v[j][e];
    }
    if (delta) {
      Vec<T> s;
#pragma unroll
      for (int e = 0; e < N; ++e) s.set(e, v[j][e]);
      vstore(static_cast<T*>(a.x_out) + r * a.cols, i * N, s);
    }
  }
  const float inv = rsqrtf(block_sum(ss, sums) * (1.0f / static_cast<float>(a.cols)) + a.eps);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int64_t i = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
    if (i >= nv) continue;
    Vec<T> o;
#pragma unroll
    for (int e = 0; e < N; ++e) o.set(e, __fmul_rn(wv[j].get(e), rnd<T>(__fmul_rn(v[j][e], inv))));
    vstore(static_cast<T*>(a.out) + r * a.cols, i * N, o);
  }
}

// Thread i of a row: head i / (D / 2N), the vector pair at d and d + D/2 of that head.
template <typename T>
__global__ void __launch_bounds__(1024) rope_qkv_vec_kernel(RopeQkvArgs a) {
  constexpr int N = Vec<T>::kN;
  const int64_t r = blockIdx.x;
  const int64_t D = a.head_dim, half = D / 2, pairs = half / N, H = a.q_heads, KV = a.kv_heads;
  const T* row = static_cast<const T*>(a.qkv) + r * a.qkv_stride;
  const T* cs = static_cast<const T*>(a.cos) + r * D;
  const T* sn = static_cast<const T*>(a.sin) + r * D;
  for (int64_t i = threadIdx.x; i < (H + 2 * KV) * pairs; i += blockDim.x) {
    const int64_t head = i / pairs, d0 = (i % pairs) * N, d1 = d0 + half;
    const Vec<T> x0 = vload(row, head * D + d0), x1 = vload(row, head * D + d1);
    if (head >= H + KV) {
      T* v = static_cast<T*>(a.v) + (r * KV + head - H - KV) * D;
      vstore(v, d0, x0);
      vstore(v, d1, x1);
      continue;
    }
    const Vec<T> c0 = vload(cs, d0), c1 = vload(cs, d1), s0 = vload(sn, d0), s1 = vload(sn, d1);
    Vec<T> y0, y1;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      // As the scalar kernel: rotate_half gives -x1 beside x0 and x0 beside x1; no FMA.
      y0.set(e, rnd<T>(__fadd_rn(rnd<T>(__fmul_rn(x0.get(e), c0.get(e))), rnd<T>(__fmul_rn(-x1.get(e), s0.get(e))))));
      y1.set(e, rnd<T>(__fadd_rn(rnd<T>(__fmul_rn(x1.get(e), c1.get(e))), rnd<T>(__fmul_rn(x0.get(e), s1.get(e))))));
    }
    T* out = head < H ? static_cast<T*>(a.q) + (r * H + head) * D : static_cast<T*>(a.k) + (r * KV + head - H) * D;
    vstore(out, d0, y0);
    vstore(out, d1, y1);
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
int elem_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }
unsigned warps_of(int64_t threads) { return static_cast<unsigned>(std::min<int64_t>(1024, (threads + 31) / 32 * 32)); }

template <typename T> struct RmsNormVecLaunch {
  static void run(const RmsNormArgs& a, dim3 g, cudaStream_t s) {
    const int64_t nv = a.cols / Vec<T>::kN;
    const int per = nv <= 1024 ? 1 : nv <= 2048 ? 2 : nv <= 4096 ? 4 : 8;
    const dim3 block(warps_of((nv + per - 1) / per));
    switch (per) {
      case 1: rms_norm_vec_kernel<T, 1><<<g, block, 0, s>>>(a); break;
      case 2: rms_norm_vec_kernel<T, 2><<<g, block, 0, s>>>(a); break;
      case 4: rms_norm_vec_kernel<T, 4><<<g, block, 0, s>>>(a); break;
      default: rms_norm_vec_kernel<T, 8><<<g, block, 0, s>>>(a); break;
    }
  }
};
template <typename T> struct RopeVecLaunch {
  static void run(const RopeQkvArgs& a, dim3 g, cudaStream_t s) {
    const int64_t pairs = a.head_dim / 2 / Vec<T>::kN;
    rope_qkv_vec_kernel<T><<<g, warps_of((a.q_heads + 2 * a.kv_heads) * pairs), 0, s>>>(a);
  }
};

// Where the vectorized kernels may run: whole 16-byte vectors at 16-byte aligned addresses.
bool rms_norm_vectorizable(const RmsNormArgs& a) {
  const int64_t n = 16 / elem_bytes(a.dtype);
  const bool rows_ok = a.cols % n == 0 && a.cols / n <= 8 * 1024 && (a.rows == 1 || a.x_stride % n == 0);
  const bool delta_ok = a.delta == nullptr ||
                        (aligned16(a.delta) && aligned16(a.x_out) && (a.rows == 1 || a.delta_stride % n == 0));
  return a.vectorized && rows_ok && delta_ok && aligned16(a.x) && aligned16(a.out) && aligned16(a.w);
}
bool rope_vectorizable(const RopeQkvArgs& a) {
  const int64_t n = 16 / elem_bytes(a.dtype);
  return a.vectorized && a.head_dim % (2 * n) == 0 && (a.rows == 1 || a.qkv_stride % n == 0) && aligned16(a.qkv) &&
         aligned16(a.cos) && aligned16(a.sin) && aligned16(a.q) && aligned16(a.k) && aligned16(a.v);
}

}  // namespace

cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (!fits_grid(a.rows) || a.cols <= 0 || a.x == nullptr || a.out == nullptr || a.w == nullptr ||
      (a.delta != nullptr && a.x_out == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(a.rows));
  return rms_norm_vectorizable(a) ? dispatch<RmsNormVecLaunch>(a, grid, stream) : dispatch<RmsNormLaunch>(a, grid, stream);
}

cudaError_t launch_rope_qkv(const RopeQkvArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (!fits_grid(a.rows) || a.head_dim <= 0 || a.head_dim % 2 != 0 || a.q_heads <= 0 || a.kv_heads <= 0 ||
      a.qkv == nullptr || a.cos == nullptr || a.sin == nullptr || a.q == nullptr || a.k == nullptr || a.v == nullptr) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(a.rows));
  return rope_vectorizable(a) ? dispatch<RopeVecLaunch>(a, grid, stream) : dispatch<RopeLaunch>(a, grid, stream);
}

cudaError_t launch_silu_mul(const SiluMulArgs& a, cudaStream_t stream) {
  const int64_t total = a.rows * a.inter;
  if (total == 0) return cudaSuccess;
  if (a.rows < 0 || a.inter <= 0 || a.gu == nullptr || a.out == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535);
  return dispatch<SiluMulLaunch>(a, dim3(static_cast<unsigned>(blocks)), stream);
}

}  // namespace kvserve::fused_kernels
