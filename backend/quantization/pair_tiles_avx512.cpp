// The quantized tiles' pair kernels (pair_tiles_kernel.h), compiled with AVX-512 F/BW/VL/VNNI
// (backend/CMakeLists.txt). It includes nothing but intrinsics and its own declarations.
//
// ggml's AVX2 vec_dot_q4_1_q8_1 and vec_dot_q8_0_q8_0 keep 8 float lanes per output: per block, lane
// k gets fma(d * x.d, float(sum of the 4 products of bytes 4k..4k+3), acc); Q4_1 also adds the block's
// m * x.s to a scalar; the result is hsum_float_8(acc) (+ that scalar). Here one 512-bit register
// holds the 8 lanes of two rows of x: VNNI's dpbusd makes both rows' lane sums from the weight block
// (copied into both halves) in one instruction, and every lane sees ggml's operations in ggml's
// order, so each output equals the one-row dot product bit for bit.
#include "backend/quantization/pair_tiles_kernel.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>

// GCC 12's AVX-512 headers make "undefined" vectors by self-assignment, which -Wmaybe-uninitialized
// flags wherever an extract inlines; no value here is read uninitialised.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvserve::pair_tiles {
namespace {

constexpr int64_t kPrefetchBytes = 8192;  // as tile_arith.h's prefetch_ahead (the weights stream from DRAM)

// ggml's hsum_float_8 of 8 lanes.
inline float sum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

inline __m512i both_halves(__m256i v) { return _mm512_inserti64x4(_mm512_castsi256_si512(v), v, 1); }

// The upper 8 lanes of an accumulator (a pair's second row; the first row's are its cast to 256 bits).
inline __m256 high_lanes(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

// 16 bytes of nibbles (value j low in byte j, j + 16 high) as the 32 values, one a byte.
inline __m256i nibbles(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// A Q6_K super-block's scales for chunk c (values 32c..32c+31) as ggml's madd takes them: 8 int16
// copies of scale 2c, then 8 of scale 2c + 1, in both halves.
inline __m512i chunk_scales(__m128i scales, int c) {
  const char a = static_cast<char>(2 * c), b = static_cast<char>(2 * c + 1);
  return both_halves(_mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b))));
}

// A block's fp16 d (at wb) in every lane.
inline __m512 half_d(const uint8_t* wb) {
  uint16_t d_bits;
  __builtin_memcpy(&d_bits, wb, sizeof d_bits);
  return _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d_bits)));
}

// A block's two leading fp16 values as [d, m, 0, 0] (Q4_1's d and m; a K-quant's d and dmin).
inline __m128 half_pair(const uint8_t* wb) {
  uint32_t bits;
  __builtin_memcpy(&bits, wb, sizeof bits);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
}

// A K-quant super-block's lines, kPrefetchBytes ahead (its last line too: blocks straddle lines).
inline void prefetch_super_block(const uint8_t* wb, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + off), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + bytes - 1), _MM_HINT_T0);
}

// A Q4_K / Q5_K super-block's 6-bit scales and mins as ggml unpacks them (sm: 8 scales, 8 mins) and
// its mins as 16-bit lanes in both 128-bit halves (one per row of a pair).
struct KScalesMins {
  alignas(16) uint8_t sm[16];
  __m256i mins;
  explicit KScalesMins(const uint8_t* wb) {
    k_scales_and_mins(wb, sm);
    const __m128i mins16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8)));
    mins = _mm256_set_m128i(mins16, mins16);
  }
};

// Q4_1: fp16 d, fp16 m, 16 bytes of nibbles (value j in the low nibble of byte j, j + 16 in its high
// nibble); unsigned values, so dpbusd takes them as they are.
struct Q4_1 {
  static constexpr int64_t kBytes = 20;
  static constexpr bool kMins = true;
  __m512 d, m;
  __m512i u;  // the block's 32 values in both halves
  explicit Q4_1(const uint8_t* wb) {
    const __m128 dm = half_pair(wb);  // [d, m, 0, 0]
    d = _mm512_broadcastss_ps(dm);
    m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
    u = both_halves(nibbles(wb + 4));
  }
  __m512i lane_sums(__m512i xq, const int32_t*) const { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xq); }
};

// Q8_0: fp16 d, 32 signed bytes. dpbusd wants one unsigned side: |w| against x with w's signs, as
// ggml's mul_sum_i8_pairs_float does (x's bytes lie in [-127, 127], so negating one cannot overflow).
struct Q8_0 {
  static constexpr int64_t kBytes = 34;
  static constexpr bool kMins = false;
  __m512 d, m;
  __m512i u;           // |w| in both halves
  __mmask64 negative;  // w's sign bits
  explicit Q8_0(const uint8_t* wb) {
    d = half_d(wb);
    m = _mm512_setzero_ps();
    const __m512i w = both_halves(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 2)));
    u = _mm512_abs_epi8(w);
    negative = _mm512_movepi8_mask(w);
  }
  __m512i lane_sums(__m512i xq, const int32_t*) const {
    const __m512i signed_x = _mm512_mask_sub_epi8(xq, negative, _mm512_setzero_si512(), xq);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, signed_x);
  }
};

// Q4_0 (fp16 d, 16 bytes of nibbles: value j low in byte j, j + 16 high; w = q - 8) and Q5_0 (fp16
// d, 4 bytes of fifth bits, bit j for value j, then the nibbles; w = q - 16) against Q8_0: dpbusd
// takes the unsigned q as it is, starting from the x block's offset lanes (-8 or -16 times the sum
// of each lane's 4 x bytes, packed with x), so every lane is ggml's sum of (q - c) * x exactly.
template <bool kFifthBit>
struct OffsetBlock {
  static constexpr int64_t kBytes = kFifthBit ? 22 : 18;
  static constexpr bool kMins = false;
  __m512 d, m;
  __m512i u;  // q in both halves
  explicit OffsetBlock(const uint8_t* wb) {
    d = half_d(wb);
    m = _mm512_setzero_ps();
    __m256i q = nibbles(wb + (kFifthBit ? 6 : 2));
    if constexpr (kFifthBit) {
      uint32_t qh;
      __builtin_memcpy(&qh, wb + 2, sizeof qh);
      q = _mm256_or_si256(q, _mm256_maskz_mov_epi8(static_cast<__mmask32>(qh), _mm256_set1_epi8(0x10)));
    }
    u = both_halves(q);
  }
  __m512i lane_sums(__m512i xq, const int32_t* offsets) const {
    return _mm512_dpbusd_epi32(_mm512_load_si512(offsets), u, xq);
  }
};

// One weight row against P pairs of x rows (the pointers at the pass's first pair, block 0).
template <int P, typename B>
inline void row_times_pairs(const uint8_t* wrow, const uint8_t* quants, const float* d_lanes, const float* s_rows,
                            const int32_t* offsets, int64_t blocks, float* y, int64_t ldy) {
  __m512 acc[P];
  for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
  __m256 mins = _mm256_setzero_ps();  // lane j: x row j of the pass's min terms, summed in block order
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * B::kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes), _MM_HINT_T0);
    const B w(wb);
    if constexpr (B::kMins) {
      // ggml's order: each block's min term (m * x.s, exact in fp32) into its sum, then the scaled lanes.
      mins = _mm256_add_ps(mins, _mm256_mul_ps(_mm512_castps512_ps256(w.m), _mm256_loadu_ps(s_rows + l * 8)));
    }
    for (int p = 0; p < P; ++p) {
      const int64_t pb = p * blocks + l;
      const __m512 lanes =
          _mm512_cvtepi32_ps(w.lane_sums(_mm512_load_si512(quants + pb * 64), offsets ? offsets + pb * 16 : nullptr));
      acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(w.d, _mm512_load_ps(d_lanes + pb * 16)), lanes, acc[p]);
    }
  }
  alignas(32) float m[8];
  _mm256_store_ps(m, mins);
  for (int p = 0; p < P; ++p) {
    const __m256 a0 = _mm512_castps512_ps256(acc[p]);
    const __m256 a1 = high_lanes(acc[p]);
    if constexpr (B::kMins) {
      y[(2 * p) * ldy] = sum8(a0) + m[2 * p];
      y[(2 * p + 1) * ldy] = sum8(a1) + m[2 * p + 1];
    } else {
      y[(2 * p) * ldy] = sum8(a0);
      y[(2 * p + 1) * ldy] = sum8(a1);
    }
  }
}

template <typename B>
void pairs(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* quants, const float* d_lanes,
           const float* s_rows, const int32_t* offsets, int64_t pairs, int64_t blocks, float* y, int64_t ldy) {
  // Up to 4 pairs a pass (8 accumulators; a weight block is prepared once a pass). The pass's x
  // (~25 KB at 1,536 columns) stays in L1 while the weight rows go by; the rows are read again for
  // the next pass, from L2, rather than all of x for every row.
  for (int64_t p0 = 0; p0 < pairs; p0 += kPassPairs) {
    const int64_t n = pairs - p0 < kPassPairs ? pairs - p0 : kPassPairs;
    const uint8_t* qp = quants + p0 * blocks * 64;
    const float* dp = d_lanes + p0 * blocks * 16;
    const float* sp = B::kMins ? s_rows + (p0 / kPassPairs) * blocks * 8 : nullptr;
    const int32_t* op = offsets ? offsets + p0 * blocks * 16 : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wrow = w + r * row_bytes;
      float* yp = y + (2 * p0) * ldy + r;
      switch (n) {
        case 4: row_times_pairs<4, B>(wrow, qp, dp, sp, op, blocks, yp, ldy); break;
        case 3: row_times_pairs<3, B>(wrow, qp, dp, sp, op, blocks, yp, ldy); break;
        case 2: row_times_pairs<2, B>(wrow, qp, dp, sp, op, blocks, yp, ldy); break;
        default: row_times_pairs<1, B>(wrow, qp, dp, sp, op, blocks, yp, ldy); break;
      }
    }
  }
}

// ggml's AVX2 vec_dot_q4_K_q8_K per super-block: lanes of 8 int32 sums of the sub-blocks' products
// times their 6-bit scales (exact integers, so dpwssd's order cannot change them), then
// acc = fma(x.d * d, float(sums), acc); and, in a 4-lane accumulator of its own,
// fma(-x.d * dmin, float(the mins times Q8_K's paired sums), acc_m). The result is
// hsum_float_8(acc) + the 4 lanes of acc_m summed as ggml does.
constexpr int64_t kQ4_KBytes = 144;

inline float sum4(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_movehdup_ps(v));
  return _mm_cvtss_f32(v);
}

template <int P>
inline void q4_k_row_times_pairs(const uint8_t* wrow, const uint8_t* quants, const float* d_lanes, const float* d4_lanes,
                                 const int16_t* bsums, int64_t blocks, float* y, int64_t ldy) {
  __m512 acc[P];
  __m256 acc_m[P];  // lanes 0-3: row 2p's mins accumulator, 4-7: row 2p + 1's
  for (int p = 0; p < P; ++p) {
    acc[p] = _mm512_setzero_ps();
    acc_m[p] = _mm256_setzero_ps();
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ4_KBytes;
    prefetch_super_block(wb, kQ4_KBytes);
    const __m128 dm = half_pair(wb);  // [d, dmin, 0, 0]
    const __m512 d = _mm512_broadcastss_ps(dm);
    const __m256 neg_dmin = _mm256_broadcastss_ps(_mm_xor_ps(_mm_movehdup_ps(dm), _mm_set1_ps(-0.0f)));
    const KScalesMins k(wb);
    const uint8_t* sm = k.sm;
    const __m256i mins = k.mins;
    __m512i sumi[P];
    for (int p = 0; p < P; ++p) {
      const int64_t pb = p * blocks + l;
      // ggml's order: the super-block's mins term first (-x.d * dmin, a product of x.d and -dmin).
      const __m256i prod = _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums + pb * 16)));
      acc_m[p] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(d4_lanes + pb * 8), neg_dmin), _mm256_cvtepi32_ps(prod),
                                 acc_m[p]);
      sumi[p] = _mm512_setzero_si512();
    }
    for (int s = 0; s < 4; ++s) {
      const __m512i scale_l = _mm512_set1_epi16(static_cast<int16_t>(sm[2 * s]));
      const __m512i scale_h = _mm512_set1_epi16(static_cast<int16_t>(sm[2 * s + 1]));
      const __m256i q4bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 16 + 32 * s));
      const __m512i q4l = both_halves(_mm256_and_si256(q4bits, low4));
      const __m512i q4h = both_halves(_mm256_and_si256(_mm256_srli_epi16(q4bits, 4), low4));
      for (int p = 0; p < P; ++p) {
        const uint8_t* xq = quants + ((p * blocks + l) * 8 + 2 * s) * 64;
        sumi[p] = _mm512_dpwssd_epi32(sumi[p], scale_l, _mm512_maddubs_epi16(q4l, _mm512_load_si512(xq)));
        sumi[p] = _mm512_dpwssd_epi32(sumi[p], scale_h, _mm512_maddubs_epi16(q4h, _mm512_load_si512(xq + 64)));
      }
    }
    for (int p = 0; p < P; ++p) {
      const __m512 xd = _mm512_load_ps(d_lanes + (p * blocks + l) * 16);
      acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(xd, d), _mm512_cvtepi32_ps(sumi[p]), acc[p]);
    }
  }
  for (int p = 0; p < P; ++p) {
    const __m256 a0 = _mm512_castps512_ps256(acc[p]);
    const __m256 a1 = high_lanes(acc[p]);
    y[(2 * p) * ldy] = sum8(a0) + sum4(_mm256_castps256_ps128(acc_m[p]));
    y[(2 * p + 1) * ldy] = sum8(a1) + sum4(_mm256_extractf128_ps(acc_m[p], 1));
  }
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// ggml's AVX2 vec_dot_q5_K_q8_K per super-block: Q4_K's sub-block sums with a fifth bit per value
// (32 bytes of bit planes at wb + 16, the nibbles at wb + 48), and the mins' term as a scalar per
// row: summs += (-x.d * dmin) * float(the 4 int32 products summed), added to hsum_float_8(acc) at
// the end.
constexpr int64_t kQ5_KBytes = 176;

template <int P>
inline void q5_k_row_times_pairs(const uint8_t* wrow, const uint8_t* quants, const float* d_lanes, const int16_t* bsums,
                                 int64_t blocks, float* y, int64_t ldy) {
  __m512 acc[P];
  float summs[2 * P];
  for (int p = 0; p < P; ++p) {
    acc[p] = _mm512_setzero_ps();
    summs[2 * p] = summs[2 * p + 1] = 0.0f;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ5_KBytes;
    prefetch_super_block(wb, kQ5_KBytes);
    const __m128 dm = half_pair(wb);  // [d, dmin, 0, 0]
    const __m512 d = _mm512_broadcastss_ps(dm);
    const float wmin = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    const KScalesMins k(wb);
    const uint8_t* sm = k.sm;
    const __m256i mins = k.mins;
    __m512i sumi[P];
    for (int p = 0; p < P; ++p) {
      const int64_t pb = p * blocks + l;
      // ggml's order: the super-block's mins term first.
      alignas(32) int32_t prod[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(prod),
                         _mm256_madd_epi16(mins, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums + pb * 16))));
      for (int i = 0; i < 2; ++i) {
        const float dmin = -d_lanes[pb * 16 + 8 * i] * wmin;
        const int32_t isum = (prod[4 * i] + prod[4 * i + 1]) + (prod[4 * i + 2] + prod[4 * i + 3]);
        summs[2 * p + i] += dmin * static_cast<float>(isum);
      }
      sumi[p] = _mm512_setzero_si512();
    }
    const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 16));
    for (int s = 0; s < 4; ++s) {
      const __m512i scale_l = _mm512_set1_epi16(static_cast<int16_t>(sm[2 * s]));
      const __m512i scale_h = _mm512_set1_epi16(static_cast<int16_t>(sm[2 * s + 1]));
      const __m256i q5bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 48 + 32 * s));
      const __m256i h_lo = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * s), _mm256_set1_epi8(1)), 4);
      const __m256i h_hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * s + 1), _mm256_set1_epi8(1)), 4);
      const __m512i q5l = both_halves(_mm256_add_epi8(_mm256_and_si256(q5bits, low4), h_lo));
      const __m512i q5h = both_halves(_mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(q5bits, 4), low4), h_hi));
      for (int p = 0; p < P; ++p) {
        const uint8_t* xq = quants + ((p * blocks + l) * 8 + 2 * s) * 64;
        sumi[p] = _mm512_dpwssd_epi32(sumi[p], scale_l, _mm512_maddubs_epi16(q5l, _mm512_load_si512(xq)));
        sumi[p] = _mm512_dpwssd_epi32(sumi[p], scale_h, _mm512_maddubs_epi16(q5h, _mm512_load_si512(xq + 64)));
      }
    }
    for (int p = 0; p < P; ++p) {
      const __m512 xd = _mm512_load_ps(d_lanes + (p * blocks + l) * 16);
      acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(xd, d), _mm512_cvtepi32_ps(sumi[p]), acc[p]);
    }
  }
  for (int p = 0; p < P; ++p) {
    y[(2 * p) * ldy] = sum8(_mm512_castps512_ps256(acc[p])) + summs[2 * p];
    y[(2 * p + 1) * ldy] = sum8(high_lanes(acc[p])) + summs[2 * p + 1];
  }
}

// ggml's AVX2 vec_dot_q6_K_q8_K per super-block: the 6-bit codes q (ql's nibbles with two bits of
// qh above them) times x by maddubs, each 16 values' pair sums times their int8 scale by madd, summed
// into 8 int32 lanes; less 32 times (Q8_K's 16 sums of 16 quants times the scales, madd'ed), shifted
// left by 5; then acc = fma(x.d * d, float(that), acc) and hsum_float_8(acc). Here dpwssd adds each
// chunk's scaled pair sums (exact integers: the same lanes, any order).
constexpr int64_t kQ6_KBytes = 210;

template <int P>
inline void q6_k_row_times_pairs(const uint8_t* wrow, const uint8_t* quants, const float* d_lanes, const int16_t* bsums,
                                 int64_t blocks, float* y, int64_t ldy) {
  __m512 acc[P];
  for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
  const __m256i m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ6_KBytes;
    prefetch_super_block(wb, kQ6_KBytes);
    const __m512 d = half_d(wb + 208);
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 192));
    const __m512i scales_16 = both_halves(_mm256_cvtepi8_epi16(scales));
    __m512i sumi[P];
    for (int p = 0; p < P; ++p) sumi[p] = _mm512_setzero_si512();
    for (int s = 0; s < 2; ++s) {
      const __m256i bits1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * s));
      const __m256i bits2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * s + 32));
      const __m256i bitsH = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 + 32 * s));
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(bitsH, m3), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(12)), 2);
      const __m256i h2 = _mm256_and_si256(bitsH, _mm256_set1_epi8(48));
      const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(-64)), 2);
      const __m512i q[4] = {both_halves(_mm256_or_si256(_mm256_and_si256(bits1, m15), h0)),
                            both_halves(_mm256_or_si256(_mm256_and_si256(bits2, m15), h1)),
                            both_halves(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m15), h2)),
                            both_halves(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m15), h3))};
      for (int j = 0; j < 4; ++j) {
        // Chunk c = 4s + j: values 32c..32c+31, scale 2c for its first 16 and 2c + 1 for the rest.
        const int c = 4 * s + j;
        const __m512i sc = chunk_scales(scales, c);
        for (int p = 0; p < P; ++p) {
          const uint8_t* xq = quants + ((p * blocks + l) * 8 + c) * 64;
          sumi[p] = _mm512_dpwssd_epi32(sumi[p], sc, _mm512_maddubs_epi16(q[j], _mm512_load_si512(xq)));
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      const int64_t pb = p * blocks + l;
      const __m512i sub =
          _mm512_slli_epi32(_mm512_madd_epi16(_mm512_loadu_si512(bsums + pb * 32), scales_16), 5);
      const __m512 xd = _mm512_load_ps(d_lanes + pb * 16);
      acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(xd, d), _mm512_cvtepi32_ps(_mm512_sub_epi32(sumi[p], sub)), acc[p]);
    }
  }
  for (int p = 0; p < P; ++p) {
    y[(2 * p) * ldy] = sum8(_mm512_castps512_ps256(acc[p]));
    y[(2 * p + 1) * ldy] = sum8(high_lanes(acc[p]));
  }
}

// The K-quant kernels' rows as one type each, for k_pairs: K::row<P> multiplies one weight row by P
// pairs of x (the pointers at the pass's first pair); K::kSums: int16 sums per (pair, block).
struct Q4K {
  static constexpr int64_t kSums = 16;
  template <int P>
  static void row(const uint8_t* wrow, const uint8_t* quants, const float* d_lanes, const float* d4_lanes,
                  const int16_t* bsums, int64_t blocks, float* y, int64_t ldy) {
    q4_k_row_times_pairs<P>(wrow, quants, d_lanes, d4_lanes, bsums, blocks, y, ldy);
  }
};
struct Q5K {
  static constexpr int64_t kSums = 16;
  template <int P>
  static void row(const uint8_t* wrow, const uint8_t* quants, const float* d_lanes, const float*, const int16_t* bsums,
                  int64_t blocks, float* y, int64_t ldy) {
    q5_k_row_times_pairs<P>(wrow, quants, d_lanes, bsums, blocks, y, ldy);
  }
};
struct Q6K {
  static constexpr int64_t kSums = 32;
  template <int P>
  static void row(const uint8_t* wrow, const uint8_t* quants, const float* d_lanes, const float*, const int16_t* bsums,
                  int64_t blocks, float* y, int64_t ldy) {
    q6_k_row_times_pairs<P>(wrow, quants, d_lanes, bsums, blocks, y, ldy);
  }
};

// Passes of up to kPassPairs pairs, as pairs() does for the 32-value blocks.
template <typename K>
void k_pairs(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* quants, const float* d_lanes,
             const float* d4_lanes, const int16_t* bsums, int64_t pairs, int64_t blocks, float* y, int64_t ldy) {
  for (int64_t p0 = 0; p0 < pairs; p0 += kPassPairs) {
    const int64_t n = pairs - p0 < kPassPairs ? pairs - p0 : kPassPairs;
    const uint8_t* qp = quants + p0 * blocks * 512;
    const float* dp = d_lanes + p0 * blocks * 16;
    const float* d4 = d4_lanes ? d4_lanes + p0 * blocks * 8 : nullptr;
    const int16_t* bs = bsums + p0 * blocks * K::kSums;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wrow = w + r * row_bytes;
      float* yp = y + (2 * p0) * ldy + r;
      switch (n) {
        case 4: K::template row<4>(wrow, qp, dp, d4, bs, blocks, yp, ldy); break;
        case 3: K::template row<3>(wrow, qp, dp, d4, bs, blocks, yp, ldy); break;
        case 2: K::template row<2>(wrow, qp, dp, d4, bs, blocks, yp, ldy); break;
        default: K::template row<1>(wrow, qp, dp, d4, bs, blocks, yp, ldy); break;
      }
    }
  }
}

}  // namespace

PairsFn q4_1_kernel() { return cpu_has_vnni() ? &pairs<Q4_1> : nullptr; }
PairsFn q8_0_kernel() { return cpu_has_vnni() ? &pairs<Q8_0> : nullptr; }
PairsFn q4_0_kernel() { return cpu_has_vnni() ? &pairs<OffsetBlock<false>> : nullptr; }
PairsFn q5_0_kernel() { return cpu_has_vnni() ? &pairs<OffsetBlock<true>> : nullptr; }
KPairsFn q4_k_kernel() { return cpu_has_vnni() ? &k_pairs<Q4K> : nullptr; }
KPairsFn q5_k_kernel() { return cpu_has_vnni() ? &k_pairs<Q5K> : nullptr; }
KPairsFn q6_k_kernel() { return cpu_has_vnni() ? &k_pairs<Q6K> : nullptr; }

}  // namespace kvserve::pair_tiles

#else

namespace kvserve::pair_tiles {
PairsFn q4_1_kernel() { return nullptr; }
PairsFn q8_0_kernel() { return nullptr; }
PairsFn q4_0_kernel() { return nullptr; }
PairsFn q5_0_kernel() { return nullptr; }
KPairsFn q4_k_kernel() { return nullptr; }
KPairsFn q5_k_kernel() { return nullptr; }
KPairsFn q6_k_kernel() { return nullptr; }
}  // namespace kvserve::pair_tiles

#endif
