#include "cache_manager/paged_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSERVE_PAGED_AVX2 1
#endif
#if defined(KVSERVE_PAGED_AVX2) && defined(__F16C__)
#define KVSERVE_PAGED_F16C 1
#endif

#include <c10/util/Half.h>

#include "common/check.h"

namespace kvserve {
namespace {

struct Shapes {
  int64_t B, H, KV, G, D, bs, N, max_blocks;
  int64_t R;  // storage elements per (token, head) row: D, or a quantized row's bytes
  bool rotated = false;  // rows hold kv_quant_rotate()d K/V: q is rotated in, the output back out
  // > 0: each kernel row is a run of G / row_heads consecutive query rows of one sequence (a
  // speculative verify step), row_heads query heads each; query row j of r sees the row's length
  // minus (r - 1 - j) slots (causal), so every K/V block is read once for the whole run.
  int64_t row_heads = 0;
};

Shapes check_args(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& table,
                  const torch::Tensor& lengths, KvQuant quant) {
  KV_CHECK(q.dim() == 3, "paged attention: q must be [B, H, D], got " << q.sizes());
  KV_CHECK(pool.dim() == 5 && pool.size(1) == 2, "paged attention: pool must be [N, 2, KV, bs, D], got " << pool.sizes());
  Shapes s{};
  s.B = q.size(0);
  s.H = q.size(1);
  s.D = q.size(2);
  s.N = pool.size(0);
  s.KV = pool.size(2);
  s.bs = pool.size(3);
  s.R = pool.size(4);
  if (quant == KvQuant::none) {
    KV_CHECK(s.R == s.D, "paged attention: head_dim of q (" << s.D << ") != pool's (" << s.R << ")");
  } else {
    check_kv_quant_head_dim(quant, s.D, "paged attention");
    KV_CHECK(pool.scalar_type() == torch::kUInt8 && s.R == kv_quant_row_bytes(quant, s.D),
             "paged attention: a " << kv_quant_name(quant) << " pool of head_dim " << s.D << " is uint8 rows of "
                                   << kv_quant_row_bytes(quant, s.D) << " bytes, got " << pool.scalar_type() << " rows of "
                                   << s.R);
  }
  KV_CHECK(s.KV > 0 && s.H % s.KV == 0, "paged attention: " << s.H << " query heads not a multiple of " << s.KV
                                                              << " KV heads");
  s.G = s.H / s.KV;
  KV_CHECK(table.dim() == 2 && table.size(0) == s.B, "paged attention: block_table must be [B=" << s.B << ", max_blocks], got "
                                                                                              << table.sizes());
  KV_CHECK(lengths.dim() == 1 && lengths.size(0) == s.B, "paged attention: lengths must be [B=" << s.B << "], got "
                                                                                               << lengths.sizes());
  KV_CHECK(table.scalar_type() == torch::kInt32 && lengths.scalar_type() == torch::kInt32,
           "paged attention: block_table and lengths must be int32");
  s.max_blocks = table.size(1);
  return s;
}

double resolve_scale(double scale, int64_t D) { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D)); }

// Host-side length check shared by all paths: a table too short for its length would read garbage.
void check_lengths(const Shapes& s, const int32_t* lens) {
  for (int64_t b = 0; b < s.B; ++b) {
    KV_CHECK(lens[b] >= 0 && (lens[b] + s.bs - 1) / s.bs <= s.max_blocks,
             "paged attention: sequence " << b << " length " << lens[b] << " needs more than " << s.max_blocks
                                          << " blocks");
  }
}

#ifdef KVSERVE_PAGED_AVX2

// 2^x for x <= 0 (scores minus their running max); lanes below -126 (incl. -inf) flush to exactly 0.
inline __m256 exp2_ps(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, n);  // [-0.5, 0.5]
  // Taylor series of e^(r ln 2) to degree 7: relative error < 1e-8 on [-0.5, 0.5].
  __m256 p = _mm256_set1_ps(1.5252733804059841e-05f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.5403530393381606e-04f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3333558146428441e-03f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6181291076284772e-03f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5504108664821580e-02f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4022650695910071e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9314718055994531e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane i of the result = horizontal sum of a[i]: eight dot products finished with 7 shuffles+adds.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [a0 a1 a2 a3 | a0 a1 a2 a3] (low / high halves)
  const __m256 u1 = _mm256_hadd_ps(t2, t3);  // same for a4..a7
  const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(u0, u1, 0x31);
  return _mm256_add_ps(lo, hi);
}

// How the kernel reads 8 consecutive K/V elements of a pool of each storage dtype as fp32 lanes.
// 16-bit pools are widened in registers: every byte still comes from memory once, and everything
// after the load (scores, softmax, the V sums) runs in fp32 as for an fp32 pool.
struct F32Elems {
  using Elem = float;
  static __m256 load8(const Elem* p) { return _mm256_loadu_ps(p); }
};
struct Bf16Elems {
  using Elem = uint16_t;
  // bf16 is the top half of an fp32: widen to 32 bits and shift into place (exact).
  static __m256 load8(const Elem* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
};
#ifdef KVSERVE_PAGED_F16C
struct F16Elems {
  using Elem = uint16_t;
  static __m256 load8(const Elem* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
#endif

// Quantized rows (cache_manager/kv_quant.h) are not read 8 at a time: a block's K and V tiles are
// decoded into fp32 tiles in L1 (every byte read from memory once), and the fp32 code runs on those.
inline float half_at(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
#ifdef KVSERVE_PAGED_F16C
  return _cvtsh_ss(b);
#else
  return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
#endif
}
template <KvQuant kQ>
struct QuantRows {
  using Elem = uint8_t;
  static constexpr bool kQuantized = true;
  // n rows of R bytes -> n rows of D floats.
  static void decode(const uint8_t* rows, int64_t n, int64_t D, int64_t R, float* out) {
    constexpr int64_t kG = kKvQuantGroup;
    const int64_t data = kQ == KvQuant::q8_0 ? D : D / 2;
    constexpr int64_t sb = kQ == KvQuant::q4_1 ? 4 : 2;
    for (int64_t t = 0; t < n; ++t, rows += R, out += D) {
      for (int64_t g = 0; g < D / kG; ++g) {
        const uint8_t* sc = rows + data + g * sb;
        const __m256 d = _mm256_set1_ps(half_at(sc));
        float* o = out + g * kG;
        if constexpr (kQ == KvQuant::q8_0) {
          const uint8_t* qs = rows + g * kG;
          for (int i = 0; i < 4; ++i) {
            const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i)));
            _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), d));
          }
        } else {
          const __m256 m = kQ == KvQuant::q4_1 ? _mm256_set1_ps(half_at(sc + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + g * kG / 2));
          const __m128i mask = _mm_set1_epi8(0x0F);
          const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
          const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
          for (int i = 0; i < 4; ++i) {
            const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
            _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(x, d, m));
          }
        }
      }
    }
  }
};
template <typename E>
constexpr bool quantized_elems() {
  if constexpr (requires { E::kQuantized; }) return E::kQuantized;
  return false;
}

// A slice of one (sequence, KV head)'s blocks; long contexts are split so that all threads stay busy.
struct WorkItem {
  int32_t b, kvh, blk_begin, blk_end;
};

// Online-softmax partial over blocks [blk_begin, blk_end) for the G query heads of KV head kvh.
// Writes unnormalised acc [G, D], running max m [G] (log2 domain) and sum l [G].
// 8-float chunks of D kept in registers per head in the V update: about 12 accumulators, a power of
// two that divides D / 8.
constexpr int register_chunks(int d, int g) {
  int r = 1;
  while (r * 2 * g <= 12 && r * 2 <= d / 8) r *= 2;
  return r;
}

// Bytes ahead to prefetch, in fp32 blocks (1 measured best of 1, 2, 4 on the 2-core box); a 16-bit
// block is half the bytes, so it looks twice as many blocks ahead to keep as many lines in flight.
constexpr int64_t kPrefetchDist = 1;

// Slots [lo, len) are visible: lo > 0 for a sliding-window layer, whose older slots stay in its first
// block until the whole block has left the window.
template <int kD, int kG, typename E>
void attend_chunk(const Shapes& s, const float* q, float qscale, const void* pool_raw, const int32_t* table_row,
                  int64_t lo, int64_t len, const WorkItem& w, float* acc, float* m, float* l, float* qs, float* sc,
                  float* kbuf, float* vbuf) {
  using T = typename E::Elem;
  constexpr bool kQuant = quantized_elems<E>();
  const T* pool = static_cast<const T*>(pool_raw);
  const int64_t D = kD ? kD : s.D;
  const int64_t G = kG ? kG : s.G, bs = s.bs;
  const int64_t tile = bs * s.R;         // one head's K (or V) in one block
  const int64_t block_stride = 2 * s.KV * tile;
  const float* qg0 = q + (static_cast<int64_t>(w.b) * s.H + static_cast<int64_t>(w.kvh) * G) * D;
  for (int64_t i = 0; i < G * D; ++i) qs[i] = qg0[i] * qscale;
  if (s.rotated)
    for (int64_t g = 0; g < G; ++g) kv_quant_rotate_row(qs + g * D, D);
  std::fill(acc, acc + G * D, 0.0f);
  for (int64_t g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.0f;
  }
  const __m256 iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());

  for (int64_t blk = w.blk_begin; blk < w.blk_end; ++blk) {
    const T* K = pool + static_cast<int64_t>(table_row[blk]) * block_stride + w.kvh * tile;
    const T* V = K + s.KV * tile;
    const int64_t n = std::min<int64_t>(bs, len - blk * bs);
    const int64_t skip = lo - blk * bs;  // > 0: this block's first slots are outside the window
    const int64_t ntiles = (n + 7) / 8;
    // As many bytes ahead as kPrefetchDist fp32 blocks: smaller rows look more blocks ahead.
    const int64_t kDist = std::max<int64_t>(1, kPrefetchDist * D * 4 / (s.R * static_cast<int64_t>(sizeof(T))));
    if (blk + kDist < w.blk_end) {
      // The next block lives anywhere in the pool, and each tile is about one page, so hardware
      // prefetchers never ramp up: request all of its K and V lines while this block computes.
      const char* nk = reinterpret_cast<const char*>(pool + static_cast<int64_t>(table_row[blk + kDist]) * block_stride +
                                                     w.kvh * tile);
      const char* nv = nk + s.KV * tile * static_cast<int64_t>(sizeof(T));
      const int64_t tile_bytes = tile * static_cast<int64_t>(sizeof(T));
      for (int64_t off = 0; off < tile_bytes; off += 64) {
        _mm_prefetch(nk + off, _MM_HINT_T0);
        _mm_prefetch(nv + off, _MM_HINT_T0);
      }
    }

    // A 16-bit K tile is widened once into kbuf (L1), not once per query head of the group; a
    // quantized one is decoded there, and its V tile into vbuf.
    const float* Kf;
    if constexpr (kQuant) {
      E::decode(K, n, D, s.R, kbuf);
      E::decode(V, n, D, s.R, vbuf);
      Kf = kbuf;
    } else if constexpr (std::is_same_v<T, float>) {
      Kf = K;
    } else {
      for (int64_t i = 0; i < ntiles * 8 * D; i += 8) _mm256_storeu_ps(kbuf + i, E::load8(K + i));
      Kf = kbuf;
    }

    // Scores (already in log2 units): each K row is read from memory once, then from L1 for the other heads.
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      float* sg = sc + g * bs;
      // A run's earlier query rows end before the block's last slots (possibly before the block).
      const int64_t ng = s.row_heads > 0 ? std::min<int64_t>(n, len - (G / s.row_heads - 1 - g / s.row_heads) - blk * bs) : n;
      for (int64_t t0 = 0; t0 < ntiles * 8; t0 += 8) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + d);
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(Kf + (t0 + i) * D + d), a[i]);
        }
        __m256 sv = hsum8(a);
        if (t0 + 8 > ng) {  // slots past the length hold stale data: mask them out
          const __m256 valid = _mm256_cmp_ps(iota, _mm256_set1_ps(static_cast<float>(ng - t0)), _CMP_LT_OQ);
          sv = _mm256_blendv_ps(neg_inf, sv, valid);
        }
        if (t0 < skip) {  // slots before the window: real K/V, but not visible to this query
          const __m256 seen = _mm256_cmp_ps(iota, _mm256_set1_ps(static_cast<float>(skip - t0)), _CMP_GE_OQ);
          sv = _mm256_blendv_ps(neg_inf, sv, seen);
        }
        _mm256_storeu_ps(sg + t0, sv);
      }
    }

    // Online softmax: rescale the running state once per block, not per token.
    for (int64_t g = 0; g < G; ++g) {
      float* sg = sc + g * bs;
      __m256 mx = _mm256_loadu_ps(sg);
      for (int64_t j = 1; j < ntiles; ++j) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + 8 * j));
      const float m_new = std::max(m[g], hmax(mx));
      if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing visible to this head yet
        std::fill(sg, sg + ntiles * 8, 0.0f);
        continue;
      }
      if (m_new > m[g]) {
        const float corr = std::exp2(m[g] - m_new);  // 0 on the first block (m = -inf)
        l[g] *= corr;
        const __m256 cv = _mm256_set1_ps(corr);
        float* ag = acc + g * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(ag + d, _mm256_mul_ps(_mm256_loadu_ps(ag + d), cv));
        m[g] = m_new;
      }
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < ntiles; ++j) {
        const __m256 p = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + 8 * j), mv));
        _mm256_storeu_ps(sg + 8 * j, p);
        sum = _mm256_add_ps(sum, p);
      }
      l[g] += hsum(sum);
    }

    // acc += p · V, valid rows only (stale rows may hold NaN and 0 * NaN is NaN).
    auto load_v = [&](int64_t i) {
      if constexpr (kQuant) {
        return _mm256_loadu_ps(vbuf + i);
      } else {
        return E::load8(V + i);
      }
    };
    if constexpr (kG > 0) {
      // Register-blocked: each V row chunk is loaded once for all G heads; acc stays in registers.
      constexpr int kRC = register_chunks(kD, kG);
      for (int64_t d0 = 0; d0 < D; d0 += 8 * kRC) {
        __m256 a[kG][kRC];
        for (int g = 0; g < kG; ++g)
          for (int c = 0; c < kRC; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + d0 + 8 * c);
        for (int64_t t = 0; t < n; ++t) {
          __m256 p[kG];
          for (int g = 0; g < kG; ++g) p[g] = _mm256_broadcast_ss(sc + g * bs + t);
          for (int c = 0; c < kRC; ++c) {
            const __m256 vv = load_v(t * D + d0 + 8 * c);
            for (int g = 0; g < kG; ++g) a[g][c] = _mm256_fmadd_ps(p[g], vv, a[g][c]);
          }
        }
        for (int g = 0; g < kG; ++g)
          for (int c = 0; c < kRC; ++c) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, a[g][c]);
      }
      continue;
    }
    for (int64_t d = 0; d < D; d += 8) {
      for (int64_t g = 0; g < G; ++g) {
        const float* pg = sc + g * bs;
        float* ag = acc + g * D + d;
        __m256 a0 = _mm256_loadu_ps(ag);
        __m256 a1 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 1 < n; t += 2) {
          a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pg + t), load_v(t * D + d), a0);
          a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(pg + t + 1), load_v((t + 1) * D + d), a1);
        }
        if (t < n) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pg + t), load_v(t * D + d), a0);
        _mm256_storeu_ps(ag, _mm256_add_ps(a0, a1));
      }
    }
  }
}

using ChunkFn = void (*)(const Shapes&, const float*, float, const void*, const int32_t*, int64_t, int64_t,
                         const WorkItem&, float*, float*, float*, float*, float*, float*, float*);

template <int kD, typename E>
ChunkFn select_for_d(int64_t G) {
  switch (G) {
    case 1: return &attend_chunk<kD, 1, E>;
    case 2: return &attend_chunk<kD, 2, E>;
    case 3: return &attend_chunk<kD, 3, E>;
    case 4: return &attend_chunk<kD, 4, E>;
    case 6: return &attend_chunk<kD, 6, E>;
    case 8: return &attend_chunk<kD, 8, E>;
    default: return &attend_chunk<kD, 0, E>;
  }
}

template <typename E>
ChunkFn select_for_elems(int64_t D, int64_t G) {
  if (D == 64) return select_for_d<64, E>(G);
  if (D == 128) return select_for_d<128, E>(G);
  return &attend_chunk<0, 0, E>;
}

// Null when this build has no kernel for the pool's dtype (fp16 without F16C).
ChunkFn select_kernel(torch::ScalarType pool_dtype, KvQuant quant, int64_t D, int64_t G) {
  switch (quant) {
    case KvQuant::q8_0: return select_for_elems<QuantRows<KvQuant::q8_0>>(D, G);
    case KvQuant::q4_0: return select_for_elems<QuantRows<KvQuant::q4_0>>(D, G);
    case KvQuant::q4_1: return select_for_elems<QuantRows<KvQuant::q4_1>>(D, G);
    case KvQuant::none: break;
  }
  switch (pool_dtype) {
    case torch::kFloat32: return select_for_elems<F32Elems>(D, G);
    case torch::kBFloat16: return select_for_elems<Bf16Elems>(D, G);
#ifdef KVSERVE_PAGED_F16C
    case torch::kFloat16: return select_for_elems<F16Elems>(D, G);
#endif
    default: return nullptr;
  }
}

// Tokens per split-K chunk are at least this many blocks, so the merge stays negligible.
constexpr int64_t kMinChunkBlocks = 16;
// Below this many (block, KV head) tiles in a call, one thread does all of them.
constexpr int64_t kMinParallelBlocks = 64;

// q of any float dtype is read as fp32 (exact) and the result returned in q's dtype.
torch::Tensor paged_attention_cpu_avx2(const Shapes& s, ChunkFn fn, const torch::Tensor& q, const torch::Tensor& pool,
                                       const torch::Tensor& table_in, const torch::Tensor& lengths_in, double scale,
                                       int64_t window) {
  const torch::Tensor table = table_in.to(torch::kCPU).contiguous();
  const torch::Tensor lengths = lengths_in.to(torch::kCPU).contiguous();
  const torch::Tensor qc = q.to(torch::kFloat32).contiguous();
  const int32_t* tab = table.data_ptr<int32_t>();
  const int32_t* lens = lengths.data_ptr<int32_t>();
  check_lengths(s, lens);
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t nb = (lens[b] + s.bs - 1) / s.bs;
    for (int64_t j = 0; j < nb; ++j) {
      KV_CHECK(tab[b * s.max_blocks + j] >= 0 && tab[b * s.max_blocks + j] < s.N,
               "paged attention: block id " << tab[b * s.max_blocks + j] << " out of range");
    }
  }

  const int64_t nthreads = std::max<int64_t>(1, at::get_num_threads());
  int64_t total_blocks = 0;
  // A windowed row reads only the blocks from its window's first slot on.
  auto first_slot = [&](int64_t b) -> int64_t { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; };
  for (int64_t b = 0; b < s.B; ++b) total_blocks += ((lens[b] + s.bs - 1) / s.bs - first_slot(b) / s.bs) * s.KV;
  const int64_t chunk = std::max<int64_t>(kMinChunkBlocks, (total_blocks + 4 * nthreads - 1) / (4 * nthreads));

  std::vector<WorkItem> items;
  std::vector<int64_t> first_item(static_cast<size_t>(s.B * s.KV) + 1, 0);
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t nb = (lens[b] + s.bs - 1) / s.bs;
    for (int64_t h = 0; h < s.KV; ++h) {
      first_item[b * s.KV + h] = static_cast<int64_t>(items.size());
      for (int64_t c = first_slot(b) / s.bs; c < nb; c += chunk) {
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(c),
                         static_cast<int32_t>(std::min(nb, c + chunk))});
      }
    }
  }
  first_item[s.B * s.KV] = static_cast<int64_t>(items.size());
  // Longest first, handed out dynamically: batches with very different lengths still balance.
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    return items[x].blk_end - items[x].blk_begin > items[y].blk_end - items[y].blk_begin;
  });

  const int64_t G = s.G, D = s.D;
  std::vector<float> part_acc(items.size() * G * D), part_m(items.size() * G), part_l(items.size() * G);
  const float qscale = static_cast<float>(scale * 1.4426950408889634);  // fold log2(e): softmax via exp2
  const float* qp = qc.data_ptr<float>();
  const void* pp = pool.data_ptr();
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Waking the other threads costs tens of microseconds: small caches (a compressed layer) run here.
  const int64_t workers = total_blocks < kMinParallelBlocks ? 1 : std::min(nthreads, std::max<int64_t>(n_items, 1));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> qs(G * D), sc(G * s.bs), kbuf(s.bs * D), vbuf(s.bs * D);
    for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const int64_t i = order[k];
      const WorkItem& w = items[i];
      fn(s, qp, qscale, pp, tab + w.b * s.max_blocks, first_slot(w.b), lens[w.b], w, part_acc.data() + i * G * D,
         part_m.data() + i * G, part_l.data() + i * G, qs.data(), sc.data(), kbuf.data(), vbuf.data());
    }
  });

  torch::Tensor out = torch::empty({s.B, s.H, D}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  // The merge reads a few floats per chunk: one thread (a parallel region would cost more).
  for (int64_t bh = 0; bh < s.B * s.KV; ++bh) {
    const int64_t i0 = first_item[bh], i1 = first_item[bh + 1];
    for (int64_t g = 0; g < G; ++g) {
      float* o = op + (bh * G + g) * D;
      if (i0 == i1) {  // empty layer: nothing to attend to
        std::fill(o, o + D, 0.0f);
        continue;
      }
      float M = -std::numeric_limits<float>::infinity();
      for (int64_t i = i0; i < i1; ++i) M = std::max(M, part_m[i * G + g]);
      float L = 0.0f;
      std::fill(o, o + D, 0.0f);
      for (int64_t i = i0; i < i1; ++i) {
        const float w = std::exp2(part_m[i * G + g] - M);
        L += w * part_l[i * G + g];
        const float* a = part_acc.data() + (i * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = 1.0f / L;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      if (s.rotated) kv_quant_rotate_row(o, D);
    }
  }
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}
#endif  // KVSERVE_PAGED_AVX2

}  // namespace

int64_t paged_attention_parallel_width() {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) { seen.fetch_add(1); });
  return seen.load();
}

#ifdef KVSERVE_PAGED_AVX2
namespace {

// Runs of a speculative verify step: rows b..b+r-1 with one table row and lengths L, L+1, ..., L+r-1
// (one sequence's last token and its drafts). Empty when no run is longer than one row.
std::vector<std::pair<int64_t, int64_t>> causal_runs(const Shapes& s, const torch::Tensor& table,
                                                     const torch::Tensor& lengths) {
  const int32_t* tab = table.data_ptr<int32_t>();
  const int32_t* lens = lengths.data_ptr<int32_t>();
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows)
  bool longer = false;
  for (int64_t b = 0; b < s.B; ++b) {
    if (!runs.empty() && b > 0 && lens[b] == lens[b - 1] + 1 && lens[b - 1] > 0) {
      const int64_t nb = (lens[b] + s.bs - 1) / s.bs;
      if (std::equal(tab + b * s.max_blocks, tab + b * s.max_blocks + nb, tab + (b - 1) * s.max_blocks)) {
        ++runs.back().second;
        longer = true;
        continue;
      }
    }
    runs.push_back({b, 1});
  }
  if (!longer) runs.clear();
  return runs;
}

// A verify step's rows, run by run: each run of r rows becomes one kernel row of r * G query heads
// (KV head major, then row, then head), over the run's longest length with the causal tail masked,
// so each K/V block is read once for the run instead of once per row.
torch::Tensor paged_attention_runs(const Shapes& s, const std::vector<std::pair<int64_t, int64_t>>& runs,
                                   torch::ScalarType pool_dtype, KvQuant quant, const torch::Tensor& q,
                                   const torch::Tensor& pool, const torch::Tensor& table, const torch::Tensor& lengths,
                                   double scale) {
  torch::Tensor out = torch::empty({s.B, s.H, s.D}, torch::kFloat32);
  const torch::Tensor qf = q.to(torch::kFloat32);
  std::map<int64_t, std::vector<int64_t>> by_rows;  // run length -> runs' first rows
  for (const auto& [b, r] : runs) by_rows[r].push_back(b);
  for (const auto& [r, firsts] : by_rows) {
    const int64_t n = static_cast<int64_t>(firsts.size());
    std::vector<int64_t> rows;  // every row of these runs, run-major
    std::vector<int64_t> last;  // each run's last row
    for (int64_t b : firsts) {
      for (int64_t j = 0; j < r; ++j) rows.push_back(b + j);
      last.push_back(b + r - 1);
    }
    const torch::Tensor ri = torch::tensor(rows), li = torch::tensor(last);
    // [n, r, KV, G, D] -> [n, KV, r, G, D] -> [n, KV * r * G, D]
    const torch::Tensor qr = qf.index_select(0, ri).view({n, r, s.KV, s.G, s.D}).transpose(1, 2).reshape({n, s.KV * r * s.G, s.D});
    Shapes rs = s;
    rs.B = n;
    rs.H = s.KV * r * s.G;
    rs.G = r * s.G;
    rs.row_heads = s.G;
    const ChunkFn fn = select_kernel(pool_dtype, quant, s.D, rs.G);
    const torch::Tensor o = paged_attention_cpu_avx2(rs, fn, qr, pool, table.index_select(0, li),
                                                     lengths.index_select(0, li), scale, 0);
    out.index_copy_(0, ri, o.view({n, s.KV, r, s.G, s.D}).transpose(1, 2).reshape({n * r, s.H, s.D}));
  }
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}

}  // namespace
#endif

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& block_table,
                              const torch::Tensor& lengths, double scale, int64_t window, KvQuant quant, bool rotated) {
  Shapes s = check_args(q, pool, block_table, lengths, quant);
  s.rotated = rotated;
  KV_CHECK(window >= 0, "paged attention: window must be >= 0, got " << window);
  scale = resolve_scale(scale, s.D);
#ifdef KVSERVE_PAGED_AVX2
  if (pool.device().is_cpu() && q.device().is_cpu() && q.is_floating_point() && pool.is_contiguous() &&
      s.D % 8 == 0 && s.bs % 8 == 0) {
    if (const ChunkFn fn = select_kernel(pool.scalar_type(), quant, s.D, s.G)) {
      if (window == 0) {
        const torch::Tensor table = block_table.to(torch::kCPU).contiguous();
        const torch::Tensor lens = lengths.to(torch::kCPU).contiguous();
        check_lengths(s, lens.data_ptr<int32_t>());
        const auto runs = causal_runs(s, table, lens);
        if (!runs.empty()) return paged_attention_runs(s, runs, pool.scalar_type(), quant, q, pool, table, lens, scale);
        return paged_attention_cpu_avx2(s, fn, q, pool, table, lens, scale, window);
      }
      return paged_attention_cpu_avx2(s, fn, q, pool, block_table, lengths, scale, window);
    }
  }
#endif
  return paged_attention_gather(q, pool, block_table, lengths, scale, window, quant, rotated);
}

torch::Tensor paged_attention_gather(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& block_table,
                                     const torch::Tensor& lengths, double scale, int64_t window, KvQuant quant,
                                     bool rotated) {
  if (rotated) {
    return kv_quant_rotate(paged_attention_gather(kv_quant_rotate(q), pool, block_table, lengths, scale, window, quant));
  }
  const Shapes s = check_args(q, pool, block_table, lengths, quant);
  scale = resolve_scale(scale, s.D);
  {
    const torch::Tensor lens_host = lengths.to(torch::kCPU).contiguous();
    check_lengths(s, lens_host.data_ptr<int32_t>());
  }
  const auto dev = pool.device();
  if (s.max_blocks == 0) return torch::zeros_like(q);
  const torch::Tensor idx = block_table.to(dev, torch::kLong).reshape({-1});
  const torch::Tensor lens = lengths.to(dev, torch::kLong);
  const int64_t S = s.max_blocks * s.bs;
  // [B*maxb, 2, KV, bs, D] → K, V as [B, KV, S, D]
  torch::Tensor picked = pool.index_select(0, idx);
  if (quant != KvQuant::none) picked = kv_quant_decode(picked, quant, s.D);
  const torch::Tensor blocks = picked.view({s.B, s.max_blocks, 2, s.KV, s.bs, s.D});
  const torch::Tensor k = blocks.select(2, 0).permute({0, 2, 1, 3, 4}).reshape({s.B, s.KV, S, s.D});
  const torch::Tensor v = blocks.select(2, 1).permute({0, 2, 1, 3, 4}).reshape({s.B, s.KV, S, s.D});
  // A 16-bit pool under an fp32 q is widened, never q narrowed: the math runs in the wider dtype.
  const torch::ScalarType ct = torch::promote_types(q.scalar_type(), blocks.scalar_type());
  const torch::Tensor qg = q.to(dev, ct).view({s.B, s.KV, s.G, s.D});
  torch::Tensor scores = torch::matmul(qg, k.to(ct).transpose(-1, -2)).to(torch::kFloat32).mul_(scale);  // [B, KV, G, S]
  // Stale slots may hold NaN/inf: replace, don't add, so nothing leaks through the mask.
  const torch::Tensor slot = torch::arange(S, lens.options()).view({1, S});
  torch::Tensor invalid = slot >= lens.view({s.B, 1});
  if (window > 0) invalid = invalid | (slot < (lens - window).view({s.B, 1}));
  scores.masked_fill_(invalid.view({s.B, 1, 1, S}), -std::numeric_limits<float>::infinity());
  torch::Tensor probs = torch::softmax(scores, -1).nan_to_num_(0.0);  // empty rows → 0
  const torch::Tensor vz = v.to(ct).masked_fill(invalid.view({s.B, 1, S, 1}), 0);
  torch::Tensor out = torch::matmul(probs.to(ct), vz);  // [B, KV, G, D]
  return out.reshape({s.B, s.H, s.D}).to(q.device(), q.scalar_type());
}

torch::Tensor paged_attention_reference(const torch::Tensor& q, const torch::Tensor& pool,
                                        const torch::Tensor& block_table, const torch::Tensor& lengths,
                                        double scale, int64_t window, KvQuant quant, bool rotated) {
  if (rotated) {
    return kv_quant_rotate(
        paged_attention_reference(kv_quant_rotate(q), pool, block_table, lengths, scale, window, quant));
  }
  const Shapes s = check_args(q, pool, block_table, lengths, quant);
  scale = resolve_scale(scale, s.D);
  const torch::Tensor table = block_table.to(torch::kCPU, torch::kLong);
  const torch::Tensor lens = lengths.to(torch::kCPU, torch::kLong);
  torch::Tensor out = torch::zeros({s.B, s.H, s.D}, q.options().dtype(torch::kFloat64));
  for (int64_t b = 0; b < s.B; ++b) {
    const int64_t len = lens[b].item<int64_t>();
    if (len == 0) continue;
    const int64_t nb = (len + s.bs - 1) / s.bs;
    torch::Tensor picked = pool.index_select(0, table[b].narrow(0, 0, nb).to(pool.device()));
    if (quant != KvQuant::none) picked = kv_quant_decode(picked, quant, s.D);
    const torch::Tensor blocks = picked.to(torch::kFloat64);
    const torch::Tensor k = blocks.select(1, 0).permute({1, 0, 2, 3}).reshape({s.KV, nb * s.bs, s.D}).narrow(1, 0, len);
    const torch::Tensor v = blocks.select(1, 1).permute({1, 0, 2, 3}).reshape({s.KV, nb * s.bs, s.D}).narrow(1, 0, len);
    const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const torch::Tensor qb = q[b].to(torch::kFloat64).view({s.KV, s.G, s.D});
    const torch::Tensor p = torch::softmax(torch::matmul(qb, k.narrow(1, lo, len - lo).transpose(1, 2)) * scale, -1);
    out[b].copy_(torch::matmul(p, v.narrow(1, lo, len - lo)).reshape({s.H, s.D}).to(out.device()));
  }
  return out.to(q.scalar_type());
}

}  // namespace kvserve
