// CUDA kernels of quantized KV pools (cache_manager/kv_quant.h's rows: q8_0, q4_0, q4_1, fp8_e4m3).
//
// Design, and why:
// - Encode, decode and rotate give the host's bytes and values bit for bit, so a pool written on
//   the GPU equals one written on the CPU and the `gguf` package stays the reference. One thread
//   takes one group of 32 values (the unit of a scale): it rotates them in registers with the
//   host's butterflies in the host's order, then quantizes them with ggml's reference recipe. Every
//   float operation is an explicitly rounded intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn), so nvcc
//   cannot contract a product and a sum into one FMA that the host (built with -ffp-contract=off
//   for kv_quant.cpp) does not do.
// - Decode attention: the structure of paged_decode.cu's kernel, simplified. One CTA per (batch
//   entry, KV head, chunk of up to 8 query heads, split); four warps take the split's blocks
//   round-robin; a group of TG lanes owns one token, each lane a chunk of 8 values of its row (8
//   int8 or e4m3 bytes, or 4 bytes of nibbles: values j..j+3 and j+16..j+19 of a group, as ggml packs
//   them), dequantized in registers with its group's fp16 scale. A token group keeps its own
//   online-softmax state; groups, warps and splits are merged by the log-sum-exp rule
//   (decode_common.cuh). A row is read once per step for every query head of its GQA group: the
//   step reads the pool's small bytes, which is the point of a quantized pool.
// - Rows are 2-byte aligned at least (D is a multiple of 32, so row bytes are even); where the row
//   size is a multiple of 4 (D a multiple of 64: q8_0 and fp8_e4m3 rows are 17 D / 16 bytes, q4_0 9 D / 16,
//   q4_1 5 D / 8) the lanes use 4-byte loads, else 2-byte ones.
// - q and the output are fp32 here: the torch wrapper converts the [B, H, D] rows (a few KB), so
//   the kernel is instantiated per format and head chunk only (16 variants), not per dtype too.
// - Out-of-range table entries are skipped, masked slots never read (as paged_decode.cu).
#include "cache_manager/cuda/kv_quant_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cache_manager/cuda/decode_common.cuh"

namespace kvserve::cuda_kernels {
namespace {

constexpr int kGroup = 32;     // values per scale group
constexpr int kChunk = 8;      // values per lane chunk in the attention kernel
constexpr int kMaxDim = 256;   // the attention kernel's largest head_dim (32 lanes x 8 values)

__host__ __device__ constexpr int scale_bytes(QuantFormat f) { return f == QuantFormat::kQ4_1 ? 4 : 2; }
// A byte per value (q8_0, fp8_e4m3) or two values a byte (the 4-bit formats).
__host__ __device__ constexpr bool byte_values(QuantFormat f) {
  return f == QuantFormat::kQ8_0 || f == QuantFormat::kFp8E4M3;
}
__host__ __device__ constexpr int64_t data_bytes(QuantFormat f, int64_t d) { return byte_values(f) ? d : d / 2; }
// A group's data bytes.
__host__ __device__ constexpr int group_bytes(QuantFormat f) { return byte_values(f) ? kGroup : kGroup / 2; }

// An e4m3 byte's value (exact in fp16, so in fp32).
__device__ __forceinline__ float fp8_value(uint8_t b) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3)));
}

__device__ __forceinline__ float load_half(const uint8_t* p) { return __half2float(*reinterpret_cast<const __half*>(p)); }
__device__ __forceinline__ void store_half(uint8_t* p, float x) { *reinterpret_cast<__half*>(p) = __float2half_rn(x); }

// The host's kv_quant_rotate_row on one group: butterflies in natural order, then the scale.
__device__ __forceinline__ void rotate_group(float* v, float s) {
#pragma unroll
  for (int len = 1; len < kGroup; len <<= 1) {
#pragma unroll
    for (int i = 0; i < kGroup; i += 2 * len) {
#pragma unroll
      for (int j = i; j < i + len; ++j) {
        const float a = v[j], b = v[j + len];
        v[j] = __fadd_rn(a, b);
        v[j + len] = __fsub_rn(a, b);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kGroup; ++j) v[j] = __fmul_rn(v[j], s);
}

// ggml's reference quantizers (quantize_row_*_ref), as kv_quant.cpp runs them: qs gets the group's
// data bytes, sc its scale bytes.
template <QuantFormat F>
__device__ __forceinline__ void encode_group(const float* x, uint8_t* qs, uint8_t* sc) {
  if constexpr (F == QuantFormat::kQ8_0) {
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) amax = fmaxf(amax, fabsf(x[j]));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      qs[j] = static_cast<uint8_t>(static_cast<int8_t>(static_cast<int>(roundf(__fmul_rn(x[j], id)))));
    }
    store_half(sc, d);
  } else if constexpr (F == QuantFormat::kFp8E4M3) {
    // c10's float8_e4m3fn conversion rounds to nearest even, as cvt with satfinite does; x * id never
    // passes 448 by more than a rounding, which both take to 448.
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) amax = fmaxf(amax, fabsf(x[j]));
    const float d = __fdiv_rn(amax, 448.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      qs[j] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(x[j], id), __NV_SATFINITE, __NV_E4M3));
    }
    store_half(sc, d);
  } else if constexpr (F == QuantFormat::kQ4_0) {
    float amax = 0.0f, max = 0.0f;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (amax < fabsf(x[j])) {
        amax = fabsf(x[j]);
        max = x[j];
      }
    }
    const float d = __fdiv_rn(max, -8.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
#pragma unroll
    for (int j = 0; j < kGroup / 2; ++j) {
      const int lo = min(15, static_cast<int>(__fadd_rn(__fmul_rn(x[j], id), 8.5f)));
      const int hi = min(15, static_cast<int>(__fadd_rn(__fmul_rn(x[j + kGroup / 2], id), 8.5f)));
      qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
    store_half(sc, d);
  } else {
    float lo = x[0], hi = x[0];
#pragma unroll
    for (int j = 1; j < kGroup; ++j) {
      lo = fminf(lo, x[j]);
      hi = fmaxf(hi, x[j]);
    }
    const float d = __fdiv_rn(__fsub_rn(hi, lo), 15.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
#pragma unroll
    for (int j = 0; j < kGroup / 2; ++j) {
      const int a = min(15, static_cast<int>(__fadd_rn(__fmul_rn(__fsub_rn(x[j], lo), id), 0.5f)));
      const int b = min(15, static_cast<int>(__fadd_rn(__fmul_rn(__fsub_rn(x[j + kGroup / 2], lo), id), 0.5f)));
      qs[j] = static_cast<uint8_t>(a | (b << 4));
    }
    store_half(sc, d);
    store_half(sc + 2, lo);
  }
}

// kv_quant_decode_row on one group.
template <QuantFormat F>
__device__ __forceinline__ void decode_group(const uint8_t* qs, const uint8_t* sc, float* x) {
  const float d = load_half(sc);
  if constexpr (F == QuantFormat::kQ8_0) {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) x[j] = __fmul_rn(static_cast<float>(static_cast<int8_t>(qs[j])), d);
  } else if constexpr (F == QuantFormat::kFp8E4M3) {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) x[j] = __fmul_rn(fp8_value(qs[j]), d);
  } else {
    const float m = F == QuantFormat::kQ4_1 ? load_half(sc + 2) : __fmul_rn(-8.0f, d);
#pragma unroll
    for (int j = 0; j < kGroup / 2; ++j) {
      x[j] = __fadd_rn(__fmul_rn(static_cast<float>(qs[j] & 0x0F), d), m);
      x[j + kGroup / 2] = __fadd_rn(__fmul_rn(static_cast<float>(qs[j] >> 4), d), m);
    }
  }
}

template <typename T>
__device__ __forceinline__ void load_group(const T* p, float* x) {
#pragma unroll
  for (int j = 0; j < kGroup; ++j) x[j] = to_float(p[j]);
}

// Group g of every row: row g / groups_per_row, group g % groups_per_row.
template <typename T, QuantFormat F>
__global__ void encode_kernel(const T* __restrict__ x, int64_t groups, int64_t D, bool rotate, float rs,
                              uint8_t* __restrict__ out) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= groups) return;
  const int64_t per_row = D / kGroup, r = g / per_row, gi = g % per_row;
  const int64_t rb = data_bytes(F, D) + per_row * scale_bytes(F);
  float v[kGroup];
  load_group(x + r * D + gi * kGroup, v);
  if (rotate) rotate_group(v, rs);
  uint8_t* row = out + r * rb;
  encode_group<F>(v, row + gi * group_bytes(F), row + data_bytes(F, D) + gi * scale_bytes(F));
}

template <typename T, QuantFormat F>
__global__ void decode_kernel(const uint8_t* __restrict__ in, int64_t groups, int64_t D, bool rotate, float rs,
                              T* __restrict__ out) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= groups) return;
  const int64_t per_row = D / kGroup, r = g / per_row, gi = g % per_row;
  const int64_t rb = data_bytes(F, D) + per_row * scale_bytes(F);
  const uint8_t* row = in + r * rb;
  float v[kGroup];
  decode_group<F>(row + gi * group_bytes(F), row + data_bytes(F, D) + gi * scale_bytes(F), v);
  if (rotate) rotate_group(v, rs);
  T* o = out + r * D + gi * kGroup;
#pragma unroll
  for (int j = 0; j < kGroup; ++j) o[j] = from_float<T>(v[j]);
}

template <typename T>
__global__ void rotate_kernel(const T* x, int64_t groups, float rs, T* out) {
  const int64_t g = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (g >= groups) return;
  float v[kGroup];
  load_group(x + g * kGroup, v);
  rotate_group(v, rs);
#pragma unroll
  for (int j = 0; j < kGroup; ++j) out[g * kGroup + j] = from_float<T>(v[j]);
}

// One CTA per batch entry; each thread takes (K or V, KV head, group) tasks of the entry's row.
template <typename T, QuantFormat F>
__global__ void __launch_bounds__(kThreads) append_quant_kernel(QuantAppendArgs a) {
  const int64_t b = blockIdx.x;
  const int row = a.rows[b];
  if (row < 0 || row >= a.num_rows) return;
  const int64_t slot = static_cast<int64_t>(a.lengths[row]) - 1;
  if (slot < 0) return;
  const int64_t col = slot / a.block_size;
  if (col >= a.table_cols) return;
  const int64_t id = a.tables[static_cast<int64_t>(row) * a.table_stride + col];
  if (id < 0 || id >= a.num_blocks) return;
  const int64_t D = a.head_dim, KV = a.num_kv_heads, per_row = D / kGroup;
  const int64_t rb = data_bytes(F, D) + per_row * scale_bytes(F);
  const int64_t tasks = 2 * KV * per_row;
  for (int64_t t = threadIdx.x; t < tasks; t += blockDim.x) {
    const int64_t half = t / (KV * per_row), h = (t / per_row) % KV, gi = t % per_row;
    const T* src = static_cast<const T*>(half == 0 ? a.k : a.v) + (b * KV + h) * D + gi * kGroup;
    float v[kGroup];
    load_group(src, v);
    if (a.rotate) rotate_group(v, a.rot_scale);
    uint8_t* dst = a.pool + ((id * 2 + half) * KV + h) * a.block_size * rb + (slot % a.block_size) * rb;
    encode_group<F>(v, dst + gi * group_bytes(F), dst + data_bytes(F, D) + gi * scale_bytes(F));
  }
}

// Resolved launch parameters of the quantized decode kernel.
struct QuantParams {
  const float* q;
  const uint8_t* pool;
  const int32_t* tables;
  int64_t table_stride;
  int64_t table_cols;
  const int32_t* rows;
  const int32_t* lengths;
  int64_t num_rows;
  float* out;
  float* partial_acc;
  float* partial_ml;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t num_blocks;
  int64_t row_bytes;
  int head_dim;
  int block_size;
  int group;   // G
  int chunks;  // ceil(G / GMAX)
  int num_splits;
  int blocks_per_split;
  float scale_log2;
  int64_t window;
  int lanes;  // TG: lanes per token, a power of two >= head_dim / 8
  bool wide;  // rows are 4-byte aligned: 4-byte loads
};

// Value e (0..7) of lane chunk c is element chunk_elem(c, e) of the row.
template <QuantFormat F>
__device__ __forceinline__ int chunk_elem(int c, int e) {
  if constexpr (byte_values(F)) {
    return c * kChunk + e;
  } else {
    return (c / 4) * kGroup + (c % 4) * 4 + (e < 4 ? e : 12 + e);
  }
}

__device__ __forceinline__ uint32_t load_u32(const uint8_t* p, bool wide) {
  if (wide) return *reinterpret_cast<const uint32_t*>(p);
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return static_cast<uint32_t>(h[0]) | (static_cast<uint32_t>(h[1]) << 16);
}

// Lane chunk c of one row, dequantized (the same products as decode_group).
template <QuantFormat F>
__device__ __forceinline__ void load_chunk(const uint8_t* row, int c, int data, bool wide, float* x) {
  const uint8_t* sc = row + data + (c / 4) * scale_bytes(F);
  const float d = load_half(sc);
  if constexpr (byte_values(F)) {
    const uint32_t w[2] = {load_u32(row + c * kChunk, wide), load_u32(row + c * kChunk + 4, wide)};
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      const uint8_t b = static_cast<uint8_t>((w[e / 4] >> (8 * (e % 4))) & 0xFF);
      if constexpr (F == QuantFormat::kQ8_0) {
        x[e] = __fmul_rn(static_cast<float>(static_cast<int8_t>(b)), d);
      } else {
        x[e] = __fmul_rn(fp8_value(b), d);
      }
    }
  } else {
    const uint32_t w = load_u32(row + (c / 4) * (kGroup / 2) + (c % 4) * 4, wide);
    const float m = F == QuantFormat::kQ4_1 ? load_half(sc + 2) : __fmul_rn(-8.0f, d);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t byte = (w >> (8 * i)) & 0xFF;
      x[i] = __fadd_rn(__fmul_rn(static_cast<float>(byte & 0x0F), d), m);
      x[4 + i] = __fadd_rn(__fmul_rn(static_cast<float>(byte >> 4), d), m);
    }
  }
}

template <QuantFormat F, int GMAX>
__global__ void __launch_bounds__(kThreads) paged_decode_quant_kernel(const QuantParams p) {
  __shared__ float red_m[kWarps][GMAX];
  __shared__ float red_l[kWarps][GMAX];
  __shared__ float red_acc[kWarps][GMAX][kMaxDim];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int TG = p.lanes;
  const int grp = lane / TG;        // token slot of this lane's group within a pass
  const int gl = lane % TG;         // this lane's chunk
  const int tokens_per_pass = 32 / TG;
  const int D = p.head_dim;
  const bool has_chunk = gl < D / kChunk;
  const int data = static_cast<int>(data_bytes(F, D));

  const int64_t b = blockIdx.x;
  const int kvh = static_cast<int>(blockIdx.y) / p.chunks;
  const int g0 = (static_cast<int>(blockIdx.y) % p.chunks) * GMAX;
  const int gn = min(GMAX, p.group - g0);
  const int split = blockIdx.z;
  const int64_t H = p.num_heads;
  const int64_t h0 = static_cast<int64_t>(kvh) * p.group + g0;

  const SplitRange r = split_range(p, b, split);
  const int row = r.row;
  const int64_t bs = p.block_size;
  const int64_t len = r.len, lo = r.lo, blk_begin = r.blk_begin, blk_end = r.blk_end;

  if (blk_begin >= blk_end) {
    if (p.num_splits == 1) {
      float* out = p.out + (b * H + h0) * D;
      for (int i = threadIdx.x; i < gn * D; i += kThreads) out[i] = 0.0f;
    } else if (threadIdx.x < gn) {
      float* ml = p.partial_ml + ((b * H + h0 + threadIdx.x) * p.num_splits + split) * 2;
      ml[0] = -INFINITY;
      ml[1] = 0.0f;
    }
    return;
  }

  float q[GMAX][kChunk];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
      q[g][e] = g < gn && has_chunk ? p.q[(b * H + h0 + g) * D + chunk_elem<F>(gl, e)] * p.scale_log2 : 0.0f;
    }
  }
  float m[GMAX], l[GMAX], acc[GMAX][kChunk];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kChunk; ++e) acc[g][e] = 0.0f;
  }

  const int64_t R = p.row_bytes;
  const int64_t half = p.num_kv_heads * bs * R;  // bytes of the K (or V) half of a block
  const int32_t* trow = p.tables + static_cast<int64_t>(row) * p.table_stride;
  for (int64_t blk = blk_begin + warp; blk < blk_end; blk += kWarps) {
    const int64_t id = trow[blk];
    if (id < 0 || id >= p.num_blocks) continue;  // uniform per warp
    const uint8_t* kbase = p.pool + id * 2 * half + static_cast<int64_t>(kvh) * bs * R;
    const uint8_t* vbase = kbase + half;
    for (int t0 = 0; t0 < bs; t0 += tokens_per_pass) {
      const int t = t0 + grp;
      const int64_t pos = blk * bs + t;
      const bool valid = t < bs && pos < len && pos >= lo;
      float kf[kChunk];
      if (valid && has_chunk) {
        load_chunk<F>(kbase + t * R, gl, data, p.wide, kf);
      } else {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) kf[e] = 0.0f;
      }
      float s[GMAX];
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) dot = fmaf(q[g][e], kf[e], dot);
        s[g] = dot;
      }
      // Every lane takes part in the shuffles (masked slots contribute zeros).
      for (int off = TG / 2; off > 0; off /= 2) {
#pragma unroll
        for (int g = 0; g < GMAX; ++g) s[g] += __shfl_xor_sync(kFullMask, s[g], off);
      }
      if (!valid) continue;  // uniform within the token group; no shuffle below
      float vf[kChunk];
      if (has_chunk) {
        load_chunk<F>(vbase + t * R, gl, data, p.wide, vf);
      } else {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) vf[e] = 0.0f;
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g >= gn) break;
        const float mx = fmaxf(m[g], s[g]);
        const float alpha = exp2f(m[g] - mx);  // 0 while m is -inf
        const float pr = exp2f(s[g] - mx);
        l[g] = l[g] * alpha + pr;
        m[g] = mx;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) acc[g][e] = fmaf(pr, vf[e], acc[g][e] * alpha);
      }
    }
  }

  // Merge the token groups of this warp (lanes with the same gl hold the same values).
  for (int off = TG; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const float mo = __shfl_xor_sync(kFullMask, m[g], off);
      const float lo2 = __shfl_xor_sync(kFullMask, l[g], off);
      float ao[kChunk];
#pragma unroll
      for (int e = 0; e < kChunk; ++e) ao[e] = __shfl_xor_sync(kFullMask, acc[g][e], off);
      merge_state<kChunk>(m[g], l[g], acc[g], mo, lo2, ao);
    }
  }
  if (lane < TG) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (gl == 0) {
        red_m[warp][g] = m[g];
        red_l[warp][g] = l[g];
      }
      if (has_chunk) {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) red_acc[warp][g][chunk_elem<F>(gl, e)] = acc[g][e];
      }
    }
  }
  __syncthreads();

  write_cta_result<float>(p, red_m, red_l, red_acc, b * H + h0, gn, split, D);
}

unsigned grid_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// Calls f with a QuantFormat constant (a template argument) for the runtime value.
template <typename Fn>
cudaError_t with_format(QuantFormat f, Fn&& fn) {
  switch (f) {
    case QuantFormat::kQ8_0: return fn(std::integral_constant<QuantFormat, QuantFormat::kQ8_0>{});
    case QuantFormat::kQ4_0: return fn(std::integral_constant<QuantFormat, QuantFormat::kQ4_0>{});
    case QuantFormat::kQ4_1: return fn(std::integral_constant<QuantFormat, QuantFormat::kQ4_1>{});
    case QuantFormat::kFp8E4M3: return fn(std::integral_constant<QuantFormat, QuantFormat::kFp8E4M3>{});
  }
  return cudaErrorInvalidValue;
}

// ... and with an element type for the runtime dtype.
template <typename Fn>
cudaError_t with_type(DType t, Fn&& fn) {
  switch (t) {
    case DType::kFloat32: return fn(float{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
    case DType::kFloat16: return fn(__half{});
  }
  return cudaErrorInvalidValue;
}

template <QuantFormat F, int GMAX>
cudaError_t launch_quant(const QuantParams& p, dim3 grid, cudaStream_t stream) {
  paged_decode_quant_kernel<F, GMAX><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

int64_t quant_row_bytes(QuantFormat f, int64_t head_dim) {
  return data_bytes(f, head_dim) + head_dim / kGroup * scale_bytes(f);
}

cudaError_t launch_kv_quant_encode(const void* x, DType dtype, int64_t rows, int64_t head_dim, QuantFormat f,
                                   bool rotate, float rot_scale, uint8_t* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || out == nullptr || rows < 0 || head_dim <= 0 || head_dim % kGroup != 0) return cudaErrorInvalidValue;
  const int64_t groups = rows * (head_dim / kGroup);
  constexpr int kBlock = 128;
  return with_type(dtype, [&](auto t) {
    using T = decltype(t);
    return with_format(f, [&](auto fc) {
      encode_kernel<T, decltype(fc)::value><<<grid_for(groups, kBlock), kBlock, 0, stream>>>(
          static_cast<const T*>(x), groups, head_dim, rotate, rot_scale, out);
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_kv_quant_decode(const uint8_t* in, int64_t rows, int64_t head_dim, QuantFormat f, bool rotate,
                                   float rot_scale, void* out, DType dtype, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (in == nullptr || out == nullptr || rows < 0 || head_dim <= 0 || head_dim % kGroup != 0) return cudaErrorInvalidValue;
  const int64_t groups = rows * (head_dim / kGroup);
  constexpr int kBlock = 128;
  return with_type(dtype, [&](auto t) {
    using T = decltype(t);
    return with_format(f, [&](auto fc) {
      decode_kernel<T, decltype(fc)::value><<<grid_for(groups, kBlock), kBlock, 0, stream>>>(
          in, groups, head_dim, rotate, rot_scale, static_cast<T*>(out));
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_kv_rotate(const void* x, void* out, DType dtype, int64_t rows, int64_t head_dim, float rot_scale,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || out == nullptr || rows < 0 || head_dim <= 0 || head_dim % kGroup != 0) return cudaErrorInvalidValue;
  const int64_t groups = rows * (head_dim / kGroup);
  constexpr int kBlock = 128;
  return with_type(dtype, [&](auto t) {
    using T = decltype(t);
    rotate_kernel<T><<<grid_for(groups, kBlock), kBlock, 0, stream>>>(static_cast<const T*>(x), groups, rot_scale,
                                                                      static_cast<T*>(out));
    return cudaGetLastError();
  });
}

cudaError_t launch_paged_append_quant(const QuantAppendArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  if (a.num_kv_heads <= 0 || a.head_dim <= 0 || a.head_dim % kGroup != 0 || a.block_size <= 0 ||
      a.batch > 0x7fffffff || a.pool == nullptr || a.tables == nullptr || a.rows == nullptr || a.lengths == nullptr ||
      a.k == nullptr || a.v == nullptr) {
    return cudaErrorInvalidValue;
  }
  return with_type(a.dtype, [&](auto t) {
    using T = decltype(t);
    return with_format(a.format, [&](auto fc) {
      append_quant_kernel<T, decltype(fc)::value><<<static_cast<unsigned>(a.batch), kThreads, 0, stream>>>(a);
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_paged_decode_quant(const QuantDecodeArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.num_heads == 0) return cudaSuccess;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 || a.head_dim <= 0 || a.head_dim > kMaxDim ||
      a.head_dim % kGroup != 0 || a.block_size <= 0 || a.window < 0 || a.num_splits < 1 || a.num_splits > 65535 ||
      a.blocks_per_split < 1 || a.batch > 0x7fffffff || a.table_cols < 0 || a.lengths == nullptr ||
      a.rows == nullptr || a.tables == nullptr || a.q == nullptr || a.pool == nullptr || a.out == nullptr ||
      (a.num_splits > 1 && (a.partial_acc == nullptr || a.partial_ml == nullptr))) {
    return cudaErrorInvalidValue;
  }
  QuantParams p{};
  p.q = a.q;
  p.pool = a.pool;
  p.tables = a.tables;
  p.table_stride = a.table_stride;
  p.table_cols = a.table_cols;
  p.rows = a.rows;
  p.lengths = a.lengths;
  p.num_rows = a.num_rows;
  p.out = a.out;
  p.partial_acc = a.partial_acc;
  p.partial_ml = a.partial_ml;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.num_blocks = a.num_blocks;
  p.row_bytes = quant_row_bytes(a.format, a.head_dim);
  p.head_dim = static_cast<int>(a.head_dim);
  p.block_size = static_cast<int>(a.block_size);
  p.group = static_cast<int>(a.num_heads / a.num_kv_heads);
  p.num_splits = a.num_splits;
  p.blocks_per_split = a.blocks_per_split;
  p.scale_log2 = a.scale * kLog2e;
  p.window = a.window;
  int lanes = 1;
  while (lanes < a.head_dim / kChunk) lanes *= 2;
  p.lanes = lanes;
  p.wide = p.row_bytes % 4 == 0 && (reinterpret_cast<uintptr_t>(a.pool) & 3u) == 0;
  const int gmax = heads_per_cta(p.group);
  p.chunks = (p.group + gmax - 1) / gmax;
  if (a.num_kv_heads * p.chunks > 65535) return cudaErrorInvalidValue;  // grid.y limit
  const dim3 grid(static_cast<unsigned>(a.batch), static_cast<unsigned>(a.num_kv_heads * p.chunks),
                  static_cast<unsigned>(a.num_splits));
  const cudaError_t err = with_format(a.format, [&](auto fc) {
    constexpr QuantFormat F = decltype(fc)::value;
    switch (gmax) {
      case 1: return launch_quant<F, 1>(p, grid, stream);
      case 2: return launch_quant<F, 2>(p, grid, stream);
      case 4: return launch_quant<F, 4>(p, grid, stream);
      default: return launch_quant<F, 8>(p, grid, stream);
    }
  });
  if (err != cudaSuccess || a.num_splits == 1) return err;
  merge_splits_kernel<float><<<static_cast<unsigned>(a.batch * a.num_heads), kThreads, 0, stream>>>(
      a.partial_acc, a.partial_ml, a.out, static_cast<int>(a.head_dim), a.num_splits);
  return cudaGetLastError();
}

}  // namespace kvserve::cuda_kernels
