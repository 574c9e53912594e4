// CUDA paged decode attention (split-K flash-decoding) and the device K/V append.
//
// Design, and why:
// - One CTA per (batch entry, KV head, chunk of up to GMAX query heads, split). The CTA loads every
//   K/V vector of its block range once and uses it for all query heads of the GQA group, so the
//   pool is read once per step however many query heads share a KV head (decode is bound by the
//   bytes read). G > 8 falls back to several head chunks, each re-reading K/V (rare: MQA-like).
// - Inside a warp, a group of TG lanes owns one token: each lane loads 16-byte vectors of that
//   token's K and V row (rows are contiguous [bs, D] tiles in the pool, so a group's loads are one
//   coalesced segment), dots them with its slice of the G query rows kept in registers, and the
//   group finishes the dot products with TG-wide xor shuffles. 32 / TG tokens per pass; U passes
//   are loaded before any is used (U shrinks as G grows, to bound registers) so each warp keeps
//   several loads in flight; `loads` = 2 doubles U, for the bandwidth sweep
//   (bench/bench_paged_decode_cuda.cpp): more bytes in flight per warp against more registers
//   (bf16, D 128, G 4: 167 registers instead of 126, so at most 3 CTAs per SM instead of 4).
//   Each token group keeps its own online-softmax state (m, l, acc) in registers; groups, then
//   warps (through shared memory), then splits are merged with the same log-sum-exp rule. Scores
//   live in the log2 domain (q is pre-scaled by scale * log2 e) so every exponential is one exp2f.
// - Split merge: by default a second kernel (one CTA per (b, h)). With fold_merge the last CTA of
//   each (b, KV head, head chunk) to finish merges instead, which saves a launch (~9 us per layer at
//   1K x 1 on an H100): every split CTA writes its partial, fences (__threadfence), then one thread
//   takes a ticket (atomicAdd on that group's counter); the CTA that draws num_splits - 1 fences
//   again, reads every split's partial through L2 (__ldcg: other SMs wrote them, and L1 is not
//   coherent), writes out and puts the counter back to 0, so the caller's persistent zeroed
//   counters stay zero between launches and graph replays. Empty splits take a ticket too. Two
//   folded launches must not run at once on one counter buffer (the wrapper keeps one per device).
// - The load depth and the fold are template arguments, so today's kernel (1, no fold) compiles to
//   the same code as before they existed; only the vector layouts with TG >= 8 (D >= 64 in 16-bit
//   types, >= 32 in fp32) have the other variants, the rest always run today's kernel and merge.
//   How many CTAs plan_splits aims at per SM (ctas_per_sm, default 2) is the third knob.
// - The four warps of a CTA take the split's blocks round-robin; a warp reads the block id from the
//   table row itself, so no host-built index exists and the launch shape depends only on host
//   values (num_splits, blocks_per_split): the kernel is CUDA-graph friendly, lengths are read on
//   the device. The last split also takes any blocks past num_splits * blocks_per_split, so a low
//   host hint loses speed, never tokens.
// - Empty work (length 0, or a split past the length) writes m = -inf, l = 0 and no acc; every
//   merge (the kernel's or the fold's) skips partials whose max is -inf, so neither 0/0 nor
//   -inf - -inf ever happens and stale workspace is never read. Masked token slots load zeros
//   (never the pool's stale bytes, which may be NaN) and get probability exactly 0.
// - A sliding-window layer (window > 0) reads from its window's first block on: the splits cover
//   [lo / bs, nblocks) and the slots before lo in that first block are masked like slots past len.
// - Out-of-range table entries (block id outside [0, N)) and rows/lengths that point past the table
//   are skipped or clamped instead of read: a bad table gives a wrong answer, not a memory fault.
// - Pool offsets are int64 (N * 2 * KV * bs * D passes 2^31 elements on an 80 GB card); per-row
//   offsets inside one block tile stay int.
// - Head dims: the vector path needs D * sizeof(T) % 16 == 0 and 16-byte aligned q / pool / out
//   bases (torch allocations are 256-byte aligned); TG = next power of two of D / VEC, so D = 64
//   and 128 use every lane and 80 / 96 leave a few idle. Any other D <= 256 (or unaligned views)
//   takes the scalar path: one element per lane per step, TG = 32.
// - fp32 accumulation everywhere; bf16/fp16 are converted on load.
#include "cache_manager/cuda/paged_decode.cuh"
#include "cache_manager/cuda/decode_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvserve::cuda_kernels {
namespace {

constexpr int kMaxSplits = kMaxFoldSplits;
constexpr int kMinBlocksPerSplit = 4;  // one block per warp: fewer leaves warps idle for nothing

// Resolved launch parameters shared by the decode kernels (plain values: passed by value).
struct DecodeParams {
  const void* q;
  const void* pool;
  const int32_t* tables;
  int64_t table_stride;
  int64_t table_cols;
  const int32_t* rows;
  const int32_t* lengths;
  int64_t num_rows;  // S: valid row ids are [0, S)
  void* out;
  float* partial_acc;
  float* partial_ml;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t num_blocks;
  int head_dim;
  int block_size;
  int group;   // G
  int chunks;  // ceil(G / GMAX)
  int num_splits;
  int blocks_per_split;
  float scale_log2;
  int64_t window;  // 0: every slot
  int32_t* split_counters;  // FOLD: one zeroed int per (b, blockIdx.y)
};

// VEC consecutive elements of one row, as loaded: one 16-byte load when VEC * sizeof(T) == 16 (the
// caller guarantees alignment), else VEC scalar loads. Kept packed until used so that bf16/fp16
// tiles in flight cost half the registers.
template <typename T, int VEC, bool kWide = VEC * sizeof(T) == 16>
struct Packet {
  T e[VEC];
  __device__ __forceinline__ void load(const T* p) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) e[i] = p[i];
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < VEC; ++i) e[i] = from_float<T>(0.0f);
  }
  __device__ __forceinline__ void to_floats(float* dst) const {
#pragma unroll
    for (int i = 0; i < VEC; ++i) dst[i] = to_float(e[i]);
  }
};

template <typename T, int VEC>
struct Packet<T, VEC, true> {
  uint4 raw;
  __device__ __forceinline__ void load(const T* p) { raw = *reinterpret_cast<const uint4*>(p); }
  __device__ __forceinline__ void zero() { raw = make_uint4(0u, 0u, 0u, 0u); }
  __device__ __forceinline__ void to_floats(float* dst) const {
    if constexpr (sizeof(T) == 4) {
      dst[0] = __uint_as_float(raw.x);
      dst[1] = __uint_as_float(raw.y);
      dst[2] = __uint_as_float(raw.z);
      dst[3] = __uint_as_float(raw.w);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      __nv_bfloat162 h[4];
      memcpy(h, &raw, sizeof(raw));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        dst[2 * i] = f.x;
        dst[2 * i + 1] = f.y;
      }
    } else {
      __half2 h[4];
      memcpy(h, &raw, sizeof(raw));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        dst[2 * i] = f.x;
        dst[2 * i + 1] = f.y;
      }
    }
  }
};

// The folded split merge, run by every CTA of a split launch once its partial (acc, m, l) is
// written: the last CTA of this (b, KV head, head chunk) to arrive merges all num_splits partials
// into out and resets the counter. Every thread of the CTA must call it (it has barriers).
template <typename T, int GMAX>
__device__ __forceinline__ void fold_splits(const DecodeParams& p, int64_t b, int64_t h0, int gn) {
  __shared__ int last;
  __shared__ float coef[GMAX][kMaxFoldSplits];  // split s's weight in head g's output
  int32_t* counter = p.split_counters + b * gridDim.y + blockIdx.y;
  const int S = p.num_splits;
  // Release: each thread's partial stores are ordered before the ticket that thread 0 takes after
  // the barrier (the threadFenceReduction pattern of the CUDA samples).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(counter, 1);
    // Acquire: the other CTAs' partials are read only after the ticket that saw all of them were
    // published; the barrier passes this on to the other threads.
    __threadfence();
    last = ticket == S - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // and every reading thread fences too (once per merge: cheap)
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t H = p.num_heads;
  for (int g = warp; g < gn; g += kWarps) {
    const float* ml = p.partial_ml + (b * H + h0 + g) * S * 2;
    float mx = -INFINITY;
    for (int s = lane; s < S; s += 32) mx = fmaxf(mx, __ldcg(ml + 2 * s));
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
    float lsum = 0.0f;
    if (mx != -INFINITY) {
      for (int s = lane; s < S; s += 32) {
        const float ms = __ldcg(ml + 2 * s);
        if (ms != -INFINITY) lsum += __ldcg(ml + 2 * s + 1) * exp2f(ms - mx);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) lsum += __shfl_xor_sync(kFullMask, lsum, off);
    const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
    for (int s = lane; s < S; s += 32) {
      const float ms = __ldcg(ml + 2 * s);
      coef[g][s] = ms != -INFINITY ? exp2f(ms - mx) * inv : 0.0f;  // mx finite whenever ms is
    }
  }
  __syncthreads();
  const int D = p.head_dim;
  T* out = static_cast<T*>(p.out);
  for (int i = threadIdx.x; i < gn * D; i += kThreads) {
    const int g = i / D;
    const int d = i % D;
    const int64_t bh = b * H + h0 + g;
    const float* acc = p.partial_acc + bh * S * D + d;
    float a = 0.0f;
    for (int s = 0; s < S; ++s) {
      const float c = coef[g][s];
      if (c != 0.0f) a = fmaf(c, __ldcg(acc + static_cast<int64_t>(s) * D), a);  // never reads empty splits
    }
    out[bh * D + d] = from_float<T>(a);
  }
  // Every other CTA of this group has taken its ticket, so nothing touches the counter until the
  // next launch, which the stream orders after this store.
  if (threadIdx.x == 0) *counter = 0;
}

// T: element type; VEC: elements per lane load; TG: lanes per token (power of two <= 32);
// VPL: vector loads per lane per row (D <= TG * VPL * VEC); GMAX: query heads per CTA; LOADS:
// multiplies the token passes loaded before use; FOLD: the last split CTA merges (num_splits > 1).
// LOADS and FOLD are template arguments so that today's kernel (1, false) compiles to the same code.
template <typename T, int VEC, int TG, int VPL, int GMAX, int LOADS, bool FOLD>
__global__ void __launch_bounds__(kThreads) paged_decode_kernel(const DecodeParams p) {
  constexpr int kTokensPerPass = 32 / TG;
  constexpr int kU = LOADS * (GMAX >= 8 ? 1 : (GMAX >= 4 ? 2 : 4));  // passes loaded before use
  constexpr int kE = VPL * VEC;                             // elements per lane per row
  constexpr int kDcap = TG * VPL * VEC;
  static_assert(TG >= 1 && TG <= 32 && (TG & (TG - 1)) == 0, "TG must be a power of two <= 32");

  __shared__ float red_m[kWarps][GMAX];
  __shared__ float red_l[kWarps][GMAX];
  __shared__ float red_acc[kWarps][GMAX][kDcap];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int grp = lane / TG;  // token slot of this lane's group within a pass
  const int gl = lane % TG;   // lane within the group
  const int D = p.head_dim;
  const int nv = D / VEC;  // vectors per row

  const int64_t b = blockIdx.x;
  const int kvh = static_cast<int>(blockIdx.y) / p.chunks;
  const int g0 = (static_cast<int>(blockIdx.y) % p.chunks) * GMAX;
  const int gn = min(GMAX, p.group - g0);
  const int split = blockIdx.z;
  const int64_t H = p.num_heads;
  const int64_t h0 = static_cast<int64_t>(kvh) * p.group + g0;

  // This entry's row, length and block range (all uniform across the CTA).
  const SplitRange r = split_range(p, b, split);
  const int row = r.row;
  const int64_t bs = p.block_size;
  const int64_t len = r.len, lo = r.lo, blk_begin = r.blk_begin, blk_end = r.blk_end;

  if (blk_begin >= blk_end) {
    if (p.num_splits == 1) {
      T* out = static_cast<T*>(p.out) + (b * H + h0) * D;
      for (int i = threadIdx.x; i < gn * D; i += kThreads) out[i] = from_float<T>(0.0f);
      return;
    }
    if (threadIdx.x < gn) {
      float* ml = p.partial_ml + ((b * H + h0 + threadIdx.x) * p.num_splits + split) * 2;
      ml[0] = -INFINITY;
      ml[1] = 0.0f;
    }
    if constexpr (FOLD) fold_splits<T, GMAX>(p, b, h0, gn);  // an empty split still takes its ticket
    return;  // whole CTA: no barrier below is reached by anyone
  }

  // This lane's slice of the G query rows, pre-scaled into the log2 domain.
  float q[GMAX][kE];
  {
    const T* qb = static_cast<const T*>(p.q) + (b * H + h0) * D;
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const int vi = gl + j * TG;
        float* dst = &q[g][j * VEC];
        if (g < gn && vi < nv) {
          Packet<T, VEC> pk;
          pk.load(qb + g * D + vi * VEC);
          pk.to_floats(dst);
#pragma unroll
          for (int e = 0; e < VEC; ++e) dst[e] *= p.scale_log2;
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) dst[e] = 0.0f;
        }
      }
    }
  }

  float m[GMAX], l[GMAX], acc[GMAX][kE];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[g][e] = 0.0f;
  }

  const T* pool = static_cast<const T*>(p.pool);
  const int32_t* trow = p.tables + static_cast<int64_t>(row) * p.table_stride;
  const int64_t half = p.num_kv_heads * bs * D;  // elements of the K (or V) half of a block
  const int64_t head_off = static_cast<int64_t>(kvh) * bs * D;

  for (int64_t blk = blk_begin + warp; blk < blk_end; blk += kWarps) {
    const int64_t id = trow[blk];
    if (id < 0 || id >= p.num_blocks) continue;  // uniform per warp
    const T* kbase = pool + id * 2 * half + head_off;
    const T* vbase = kbase + half;
    const int ntok = static_cast<int>(min(bs, len - blk * bs));  // >= 1
    const int skip = static_cast<int>(max(int64_t{0}, lo - blk * bs));  // slots before the window
    for (int t0 = (skip / (kTokensPerPass * kU)) * (kTokensPerPass * kU); t0 < ntok; t0 += kTokensPerPass * kU) {
      Packet<T, VEC> kp[kU][VPL], vp[kU][VPL];
      bool valid[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int t = t0 + u * kTokensPerPass + grp;
        valid[u] = t < ntok && t >= skip;
#pragma unroll
        for (int j = 0; j < VPL; ++j) {
          const int vi = gl + j * TG;
          if (valid[u] && vi < nv) {
            const int off = t * D + vi * VEC;  // < bs * D: one tile
            kp[u][j].load(kbase + off);
            vp[u][j].load(vbase + off);
          } else {
            kp[u][j].zero();
            vp[u][j].zero();
          }
        }
      }
      float s[kU][GMAX];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        float kf[kE];
#pragma unroll
        for (int j = 0; j < VPL; ++j) kp[u][j].to_floats(&kf[j * VEC]);
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < kE; ++e) dot = fmaf(q[g][e], kf[e], dot);
          s[u][g] = dot;
        }
      }
      // Every lane takes part in the shuffles (masked slots contribute zeros).
#pragma unroll
      for (int off = TG / 2; off > 0; off /= 2) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
#pragma unroll
          for (int g = 0; g < GMAX; ++g) s[u][g] += __shfl_xor_sync(kFullMask, s[u][g], off);
        }
      }
      bool any = false;
#pragma unroll
      for (int u = 0; u < kU; ++u) any = any || valid[u];
      if (!any) continue;  // this group has no visible token in this step
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (g >= gn) break;
        float mx = m[g];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          if (valid[u]) mx = fmaxf(mx, s[u][g]);
        }
        const float alpha = exp2f(m[g] - mx);  // mx is finite: some valid[u]; exp2f(-inf) = 0
        float pr[kU];
        float psum = 0.0f;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          pr[u] = valid[u] ? exp2f(s[u][g] - mx) : 0.0f;
          psum += pr[u];
        }
        l[g] = l[g] * alpha + psum;
        m[g] = mx;
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[g][e] *= alpha;
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          float vf[kE];
#pragma unroll
          for (int j = 0; j < VPL; ++j) vp[u][j].to_floats(&vf[j * VEC]);
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[g][e] = fmaf(pr[u], vf[e], acc[g][e]);
        }
      }
    }
  }

  // Merge the token groups of this warp (lanes with the same gl hold the same dims).
#pragma unroll
  for (int off = TG; off < 32; off *= 2) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const float mo = __shfl_xor_sync(kFullMask, m[g], off);
      const float lo = __shfl_xor_sync(kFullMask, l[g], off);
      float ao[kE];
#pragma unroll
      for (int e = 0; e < kE; ++e) ao[e] = __shfl_xor_sync(kFullMask, acc[g][e], off);
      merge_state<kE>(m[g], l[g], acc[g], mo, lo, ao);
    }
  }

  // Group 0 of every warp publishes the warp's state; every warp writes (zeros when it had no block).
  if (lane < TG) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      if (gl == 0) {
        red_m[warp][g] = m[g];
        red_l[warp][g] = l[g];
      }
#pragma unroll
      for (int j = 0; j < VPL; ++j) {
        const int vi = gl + j * TG;
        if (vi < nv) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) red_acc[warp][g][vi * VEC + e] = acc[g][j * VEC + e];
        }
      }
    }
  }
  __syncthreads();

  write_cta_result<T>(p, red_m, red_l, red_acc, b * H + h0, gn, split, D);
  if constexpr (FOLD) {
    if (p.num_splits > 1) fold_splits<T, GMAX>(p, b, h0, gn);
  }
}

// One CTA per batch entry copies its K and V rows of every KV head into the slot lengths - 1.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads) paged_append_kernel(PagedAppendArgs a, int64_t num_rows) {
  const int64_t b = blockIdx.x;
  const int row = a.rows[b];
  if (row < 0 || row >= num_rows) return;
  const int64_t slot = static_cast<int64_t>(a.lengths[row]) - 1;
  if (slot < 0) return;
  const int64_t col = slot / a.block_size;
  if (col >= a.table_cols) return;
  const int64_t id = a.tables[static_cast<int64_t>(row) * a.table_stride + col];
  if (id < 0 || id >= a.num_blocks) return;
  const int64_t D = a.head_dim;
  const int64_t half = a.num_kv_heads * a.block_size * D;
  T* kdst = static_cast<T*>(a.pool) + id * 2 * half + (slot % a.block_size) * D;
  const T* k = static_cast<const T*>(a.k) + b * a.num_kv_heads * D;
  const T* v = static_cast<const T*>(a.v) + b * a.num_kv_heads * D;
  if constexpr (VEC) {  // k then v as 16-byte vectors; one per thread for 8 KV heads of 128 bf16 at 256 threads
    constexpr int N = 16 / sizeof(T);
    const int64_t nv = a.num_kv_heads * D / N;
    for (int64_t j = threadIdx.x; j < 2 * nv; j += blockDim.x) {
      const bool is_v = j >= nv;
      const int64_t e = (is_v ? j - nv : j) * N;
      const uint4 val = __ldg(reinterpret_cast<const uint4*>((is_v ? v : k) + e));
      *reinterpret_cast<uint4*>(kdst + (is_v ? half : 0) + (e / D) * a.block_size * D + e % D) = val;
    }
  } else {
    for (int64_t i = threadIdx.x; i < a.num_kv_heads * D; i += blockDim.x) {
      const int64_t h = i / D;
      const int64_t dst = h * a.block_size * D + i % D;
      kdst[dst] = k[i];
      kdst[half + dst] = v[i];
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, int VEC, int TG, int VPL, int GMAX, int LOADS, bool FOLD>
cudaError_t launch(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  paged_decode_kernel<T, VEC, TG, VPL, GMAX, LOADS, FOLD><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The tuned variants (deeper loads, folded merge) of one vector lane layout; `folded` tells the
// caller whether the splits are already merged.
template <typename T, int VEC, int TG, int VPL, int GMAX>
cudaError_t launch_tuned(const DecodeParams& p, int loads, bool fold, dim3 grid, cudaStream_t stream,
                         bool& folded) {
  folded = fold;
  if (loads == 2) {
    return fold ? launch<T, VEC, TG, VPL, GMAX, 2, true>(p, grid, stream)
                : launch<T, VEC, TG, VPL, GMAX, 2, false>(p, grid, stream);
  }
  return fold ? launch<T, VEC, TG, VPL, GMAX, 1, true>(p, grid, stream)
              : launch<T, VEC, TG, VPL, GMAX, 1, false>(p, grid, stream);
}

// Picks the lane layout for D: 16-byte vectors when D and the pointers allow, else scalars. Only
// the vector layouts with TG >= 8 (D >= 64 in 16-bit types, >= 32 in fp32: every real model's
// head dim) have the tuned variants; the others (fixture-sized D, the scalar path for odd D or
// unaligned views) always run today's kernel and merge kernel, which keeps the number of
// instantiations, and so the build time, in bounds.
template <typename T, int GMAX>
cudaError_t launch_layout(const DecodeParams& p, bool vec_ok, int loads, bool fold, dim3 grid, cudaStream_t stream,
                          bool& folded) {
  constexpr int kVec = 16 / sizeof(T);
  folded = false;
  if (vec_ok) {
    const int nv = p.head_dim / kVec;
    if (nv <= 2) return launch<T, kVec, 2, 1, GMAX, 1, false>(p, grid, stream);
    if (nv <= 4) return launch<T, kVec, 4, 1, GMAX, 1, false>(p, grid, stream);
    if (nv <= 8) return launch_tuned<T, kVec, 8, 1, GMAX>(p, loads, fold, grid, stream, folded);
    if (nv <= 16) return launch_tuned<T, kVec, 16, 1, GMAX>(p, loads, fold, grid, stream, folded);
    if (nv <= 32) return launch_tuned<T, kVec, 32, 1, GMAX>(p, loads, fold, grid, stream, folded);
    if constexpr (sizeof(T) == 4) {
      if (nv <= 64) return launch_tuned<T, kVec, 32, 2, GMAX>(p, loads, fold, grid, stream, folded);
    }
  }
  static_assert(kMaxHeadDim == 32 * 8, "the scalar path covers kMaxHeadDim with 8 elements per lane");
  return launch<T, 1, 32, 8, GMAX, 1, false>(p, grid, stream);
}

template <typename T>
cudaError_t launch_typed(const PagedDecodeArgs& a, DecodeParams p, cudaStream_t stream) {
  const int gmax = heads_per_cta(p.group);
  p.chunks = (p.group + gmax - 1) / gmax;
  if (a.num_kv_heads * p.chunks > 65535) return cudaErrorInvalidValue;  // grid.y limit
  const dim3 grid(static_cast<unsigned>(a.batch), static_cast<unsigned>(a.num_kv_heads * p.chunks),
                  static_cast<unsigned>(a.num_splits));
  const bool vec_ok = (a.head_dim * static_cast<int64_t>(sizeof(T))) % 16 == 0 && aligned16(a.q) &&
                      aligned16(a.pool) && aligned16(a.out);
  const bool fold = a.fold_merge && a.num_splits > 1;
  bool folded = false;
  cudaError_t err = cudaSuccess;
  switch (gmax) {
    case 1: err = launch_layout<T, 1>(p, vec_ok, a.loads, fold, grid, stream, folded); break;
    case 2: err = launch_layout<T, 2>(p, vec_ok, a.loads, fold, grid, stream, folded); break;
    case 4: err = launch_layout<T, 4>(p, vec_ok, a.loads, fold, grid, stream, folded); break;
    default: err = launch_layout<T, 8>(p, vec_ok, a.loads, fold, grid, stream, folded); break;
  }
  if (err != cudaSuccess || a.num_splits == 1 || folded) return err;
  merge_splits_kernel<T><<<static_cast<unsigned>(a.batch * a.num_heads), kThreads, 0, stream>>>(
      a.partial_acc, a.partial_ml, static_cast<T*>(a.out), static_cast<int>(a.head_dim), a.num_splits);
  return cudaGetLastError();
}

}  // namespace

SplitPlan plan_splits(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t max_blocks, int sm_count,
                      int ctas_per_sm) {
  SplitPlan plan;
  if (batch <= 0 || num_kv_heads <= 0 || max_blocks <= kMinBlocksPerSplit) {
    plan.blocks_per_split = static_cast<int>(max_blocks > 1 ? max_blocks : 1);
    return plan;
  }
  const int64_t group = std::max<int64_t>(1, num_heads / num_kv_heads);
  const int64_t gmax = heads_per_cta(group);
  const int64_t ctas = batch * num_kv_heads * ((group + gmax - 1) / gmax);
  const int64_t target = std::max(1, ctas_per_sm) * static_cast<int64_t>(sm_count > 0 ? sm_count : 1);
  int64_t splits = (target + ctas - 1) / ctas;
  splits = std::min<int64_t>(splits, (max_blocks + kMinBlocksPerSplit - 1) / kMinBlocksPerSplit);
  splits = std::max<int64_t>(1, std::min<int64_t>(splits, kMaxSplits));
  const int64_t per = (max_blocks + splits - 1) / splits;
  plan.blocks_per_split = static_cast<int>(per);
  plan.num_splits = static_cast<int>((max_blocks + per - 1) / per);  // no trailing always-empty split
  return plan;
}

int64_t split_counter_count(int64_t batch, int64_t num_heads, int64_t num_kv_heads) {
  if (batch <= 0 || num_kv_heads <= 0) return 0;
  const int64_t group = std::max<int64_t>(1, num_heads / num_kv_heads);
  const int64_t gmax = heads_per_cta(group);
  return batch * num_kv_heads * ((group + gmax - 1) / gmax);
}

size_t workspace_floats(int64_t batch, int64_t num_heads, int64_t head_dim, int num_splits) {
  if (num_splits <= 1) return 0;
  return static_cast<size_t>(batch * num_heads * num_splits) * static_cast<size_t>(head_dim + 2);
}

cudaError_t launch_paged_decode(const PagedDecodeArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.num_heads == 0) return cudaSuccess;
  if (a.num_kv_heads <= 0 || a.num_heads % a.num_kv_heads != 0 || a.head_dim <= 0 || a.head_dim > kMaxHeadDim ||
      a.block_size <= 0 || a.window < 0 || a.num_splits < 1 || a.num_splits > 65535 || a.blocks_per_split < 1 ||
      a.batch > 0x7fffffff || a.table_cols < 0 || a.lengths == nullptr ||
      a.rows == nullptr || a.tables == nullptr || a.q == nullptr || a.pool == nullptr || a.out == nullptr ||
      (a.num_splits > 1 && (a.partial_acc == nullptr || a.partial_ml == nullptr)) || (a.loads != 1 && a.loads != 2) ||
      (a.fold_merge && a.num_splits > 1 && (a.split_counters == nullptr || a.num_splits > kMaxFoldSplits))) {
    return cudaErrorInvalidValue;
  }
  DecodeParams p{};
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
  p.head_dim = static_cast<int>(a.head_dim);
  p.block_size = static_cast<int>(a.block_size);
  p.group = static_cast<int>(a.num_heads / a.num_kv_heads);
  p.num_splits = a.num_splits;
  p.blocks_per_split = a.blocks_per_split;
  p.scale_log2 = a.scale * kLog2e;
  p.window = a.window;
  p.split_counters = a.split_counters;
  switch (a.dtype) {
    case DType::kFloat32: return launch_typed<float>(a, p, stream);
    case DType::kBFloat16: return launch_typed<__nv_bfloat16>(a, p, stream);
    case DType::kFloat16: return launch_typed<__half>(a, p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_paged_append(const PagedAppendArgs& a, cudaStream_t stream) {
  if (a.batch == 0) return cudaSuccess;
  if (a.num_kv_heads <= 0 || a.head_dim <= 0 || a.block_size <= 0 || a.batch > 0x7fffffff || a.pool == nullptr ||
      a.tables == nullptr || a.rows == nullptr || a.lengths == nullptr || a.k == nullptr || a.v == nullptr) {
    return cudaErrorInvalidValue;
  }
  const unsigned grid = static_cast<unsigned>(a.batch);
  const int n = 16 / (a.dtype == DType::kFloat32 ? 4 : 2);
  if (a.vectorized && a.head_dim % n == 0 && aligned16(a.pool) && aligned16(a.k) && aligned16(a.v)) {
    switch (a.dtype) {
      case DType::kFloat32: paged_append_kernel<float, true><<<grid, kThreads, 0, stream>>>(a, a.num_rows); break;
      case DType::kBFloat16: paged_append_kernel<__nv_bfloat16, true><<<grid, kThreads, 0, stream>>>(a, a.num_rows); break;
      case DType::kFloat16: paged_append_kernel<__half, true><<<grid, kThreads, 0, stream>>>(a, a.num_rows); break;
      default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
  }
  switch (a.dtype) {
    case DType::kFloat32: paged_append_kernel<float, false><<<grid, kThreads, 0, stream>>>(a, a.num_rows); break;
    case DType::kBFloat16: paged_append_kernel<__nv_bfloat16, false><<<grid, kThreads, 0, stream>>>(a, a.num_rows); break;
    case DType::kFloat16: paged_append_kernel<__half, false><<<grid, kThreads, 0, stream>>>(a, a.num_rows); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kvserve::cuda_kernels
