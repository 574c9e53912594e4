// The Q4_1 tiles' pair kernel (q4_1_pairs_kernel.h), compiled with AVX-512 F/BW/VL/VNNI
// (backend/CMakeLists.txt). It includes nothing but intrinsics and its own declarations.
//
// ggml's AVX2 vec_dot_q4_1_q8_1 keeps 8 float lanes per output: per block, lane k gets
// fma(d * x.d, float(sum of 4 products of bytes 4k..4k+3), acc), and the block's m * x.s is added to a
// scalar; the result is hsum_float_8(acc) + that scalar. Here one 512-bit register holds the 8 lanes
// of two rows of x: VNNI's dpbusd makes both rows' lane sums from the weight block's unpacked bytes
// (copied into both halves) in one instruction, and every lane sees ggml's operations in ggml's
// order, so each output equals the one-row dot product bit for bit.
#include "backend/quantization/q4_1_pairs_kernel.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>

// GCC 12's AVX-512 headers make "undefined" vectors by self-assignment, which -Wmaybe-uninitialized
// flags wherever an extract inlines; no value here is read uninitialised.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvserve::q4_1_pairs {
namespace {

constexpr int64_t kQ4_1Bytes = 20;       // fp16 d, fp16 m, 16 bytes of nibbles
constexpr int64_t kPrefetchBytes = 8192;  // as tile_arith.h's prefetch_ahead (the weights stream from DRAM)

// ggml's hsum_float_8 of 8 lanes.
inline float sum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// One weight row against P pairs of x rows (the pointers at the pass's first pair, block 0).
template <int P>
inline void row_times_pairs(const uint8_t* wrow, const uint8_t* quants, const float* d_lanes, const float* s_rows,
                            int64_t blocks, float* y, int64_t ldy) {
  __m512 acc[P];
  for (int p = 0; p < P; ++p) acc[p] = _mm512_setzero_ps();
  __m256 mins = _mm256_setzero_ps();  // lane j: x row j of the pass's min terms, summed in block order
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ4_1Bytes;
    _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes), _MM_HINT_T0);
    uint32_t dm_bits;
    __builtin_memcpy(&dm_bits, wb, sizeof dm_bits);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm_bits)));  // [d, m, 0, 0]
    const __m512 d = _mm512_broadcastss_ps(dm);
    // ggml's order: each block's min term (m * x.s, exact in fp32) into its sum, then the scaled lanes.
    mins = _mm256_add_ps(mins, _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)), _mm256_loadu_ps(s_rows + l * 8)));
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 4));
    const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(lo, 4), lo), low4);
    const __m512i qq = _mm512_inserti64x4(_mm512_castsi256_si512(q), q, 1);
    for (int p = 0; p < P; ++p) {
      const int64_t pb = p * blocks + l;
      const __m512i xq = _mm512_load_si512(quants + pb * 64);
      const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qq, xq));
      acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_load_ps(d_lanes + pb * 16)), lanes, acc[p]);
    }
  }
  alignas(32) float m[8];
  _mm256_store_ps(m, mins);
  for (int p = 0; p < P; ++p) {
    const __m256 a0 = _mm512_castps512_ps256(acc[p]);
    const __m256 a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p]), 1));
    y[(2 * p) * ldy] = sum8(a0) + m[2 * p];
    y[(2 * p + 1) * ldy] = sum8(a1) + m[2 * p + 1];
  }
}

void pairs(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* quants, const float* d_lanes,
           const float* s_rows, int64_t pairs, int64_t blocks, float* y, int64_t ldy) {
  // Up to 4 pairs a pass (8 accumulators; a weight block is unpacked once a pass). The pass's x
  // (~25 KB at 1,536 columns) stays in L1 while the weight rows go by; the rows are read again for
  // the next pass, from L2, rather than all of x for every row.
  for (int64_t p0 = 0; p0 < pairs; p0 += kPassPairs) {
    const int64_t n = pairs - p0 < kPassPairs ? pairs - p0 : kPassPairs;
    const uint8_t* qp = quants + p0 * blocks * 64;
    const float* dp = d_lanes + p0 * blocks * 16;
    const float* sp = s_rows + (p0 / kPassPairs) * blocks * 8;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wrow = w + r * row_bytes;
      float* yp = y + (2 * p0) * ldy + r;
      switch (n) {
        case 4: row_times_pairs<4>(wrow, qp, dp, sp, blocks, yp, ldy); break;
        case 3: row_times_pairs<3>(wrow, qp, dp, sp, blocks, yp, ldy); break;
        case 2: row_times_pairs<2>(wrow, qp, dp, sp, blocks, yp, ldy); break;
        default: row_times_pairs<1>(wrow, qp, dp, sp, blocks, yp, ldy); break;
      }
    }
  }
}

}  // namespace

PairsFn kernel() {
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok ? &pairs : nullptr;
}

}  // namespace kvserve::q4_1_pairs

#else

namespace kvserve::q4_1_pairs {
PairsFn kernel() { return nullptr; }
}  // namespace kvserve::q4_1_pairs

#endif
