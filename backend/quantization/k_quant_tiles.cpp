#include "backend/quantization/k_quant_tiles.h"

#include "backend/quantization/pair_tiles.h"
#include "backend/quantization/pair_tiles_kernel.h"
#include "backend/quantization/tile_arith.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#endif

#include "common/check.h"
#include "ggml.h"

namespace kvserve {

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)

namespace {

using tile::half_at;
using tile::sum8;

// ggml's block layouts (ggml-common.h), 256 values a super-block:
// Q4_K = fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles;
// Q5_K = the same with 32 bytes of fifth bits (bit plane j for values 32j..32j+31) before the nibbles;
// Q6_K = 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 sub-block scales, fp16 d;
// Q2_K = 16 bytes of 4-bit sub-block scales (low) and mins (high), 64 bytes of 2-bit values, fp16 d, fp16 dmin;
// Q3_K = 32 bytes of high bits (bit plane j for values 32j..32j+31), 64 bytes of low 2-bit values,
//        12 bytes of 6-bit sub-block scales (offset by 32), fp16 d;
// Q8_K = float d, 256 int8 values, 16 int16 sums of 16 values each.
constexpr int64_t kQ2_KBytes = 84;
constexpr int64_t kQ3_KBytes = 110;
constexpr int64_t kQ4_KBytes = 144;
constexpr int64_t kQ5_KBytes = 176;
constexpr int64_t kQ6_KBytes = 210;
constexpr int64_t kQ8_KBytes = 292;
constexpr int64_t kQ8_KSums = 260;


float float_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

__m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }


// Byte pair (2i, 2i + 1) of a 16-bit lane vector, broadcast: sub-block i's scale as 16-bit lanes.
__m256i pair_shuffle(int i) {
  const char a = static_cast<char>(2 * i), b = static_cast<char>(2 * i + 1);
  return _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b);
}

// Byte 2i in the low 8 lanes and 2i + 1 in the high 8: two 16-value sub-blocks' int8 scales.
__m128i half_shuffle(int i) {
  const char a = static_cast<char>(2 * i), b = static_cast<char>(2 * i + 1);
  return _mm_setr_epi8(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
}

// 16-bit lane 2i of a 128-bit half in the low half and lane 2i + 1 in the high half, broadcast: the
// scales of two 16-value sub-blocks (Q2_K / Q3_K: the 32 values of one register span two of them).
__m256i split_shuffle(int i) {
  const char a = static_cast<char>(4 * i), b = static_cast<char>(4 * i + 1), c = static_cast<char>(4 * i + 2),
             e = static_cast<char>(4 * i + 3);
  return _mm256_setr_epi8(a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, c, e, c, e, c, e, c, e, c, e, c, e, c, e, c, e);
}

// 16 int8 sub-block scales as 16-bit lanes, the first 8 (values 0..127) in both halves of one
// register and the last 8 (values 128..255) in both halves of the other.
struct SplitScales {
  __m256i low, high;
};
SplitScales split_scales(const __m128i& scales8) {
  const __m256i all = _mm256_cvtepi8_epi16(scales8);
  const __m128i l = _mm256_extracti128_si256(all, 0), h = _mm256_extracti128_si256(all, 1);
  return {_mm256_set_m128i(l, l), _mm256_set_m128i(h, h)};
}

// Four registers of 32 weights (unsigned bytes; register k holds the values of sub-blocks 2k, 2k + 1
// of this half super-block) times each x row's 128 values at byte `at`, scaled per 16-value
// sub-block (`scales`: that half's), added to the row's integer sums; `minus`, when given, holds
// per register a term subtracted from the 16-bit products first (Q3_K's high bits). ggml's Q2_K /
// Q3_K inner step: the same maddubs pairs, so the same 16-bit saturation, and then exact integer sums.
template <int N, bool kMinus>
void add_half_super_block(const __m256i* q, const __m256i* minus, const __m256i& scales, const uint8_t* const* xrows,
                          int64_t at, __m256i* sumi) {
  const __m256i s0 = _mm256_shuffle_epi8(scales, split_shuffle(0)), s1 = _mm256_shuffle_epi8(scales, split_shuffle(1));
  const __m256i s2 = _mm256_shuffle_epi8(scales, split_shuffle(2)), s3 = _mm256_shuffle_epi8(scales, split_shuffle(3));
  const __m256i sc[4] = {s0, s1, s2, s3};
  for (int j = 0; j < N; ++j) {
    const uint8_t* q8 = xrows[j] + at;
    __m256i p[4];
    for (int k = 0; k < 4; ++k) {
      const __m256i x8 = load256(q8 + 32 * k);
      __m256i p16 = _mm256_maddubs_epi16(q[k], x8);
      if constexpr (kMinus) p16 = _mm256_sub_epi16(p16, _mm256_maddubs_epi16(minus[k], x8));
      p[k] = _mm256_madd_epi16(sc[k], p16);
    }
    sumi[j] = _mm256_add_epi32(sumi[j], _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])));
  }
}

// One Q2_K weight row against N consecutive x rows (N <= 4): per super-block the mins' term first,
// then the scaled sub-blocks, both into one float accumulator as ggml adds them.
template <int N>
void q2_k_row(const uint8_t* wrow, const uint8_t* const* xrows, int64_t blocks, float* const* out) {
  const __m256i m3 = _mm256_set1_epi8(3);
  const __m128i m4 = _mm_set1_epi8(0xF);
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ2_KBytes;
    tile::prefetch_block_ahead(wb, kQ2_KBytes);
    const float wd = half_at(wb + 80);
    const float wmin = half_at(wb + 82);
    const __m128i mins_and_scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
    const __m256i mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16(mins_and_scales, 4), m4));
    const SplitScales scales = split_scales(_mm_and_si128(mins_and_scales, m4));
    float d[N];
    __m256i sumi[N];
    for (int j = 0; j < N; ++j) {
      const uint8_t* xb = xrows[j] + l * kQ8_KBytes;
      const float xd = float_at(xb);
      d[j] = xd * wd;
      const float dmin = -xd * wmin;
      const __m256i prod = _mm256_madd_epi16(mins, load256(xb + kQ8_KSums));
      acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), acc[j]);
      sumi[j] = _mm256_setzero_si256();
    }
    for (int s = 0; s < 2; ++s) {
      const __m256i bits = load256(wb + 16 + 32 * s);
      const __m256i q[4] = {_mm256_and_si256(bits, m3), _mm256_and_si256(_mm256_srli_epi16(bits, 2), m3),
                            _mm256_and_si256(_mm256_srli_epi16(bits, 4), m3),
                            _mm256_and_si256(_mm256_srli_epi16(bits, 6), m3)};
      add_half_super_block<N, false>(q, nullptr, s == 0 ? scales.low : scales.high, xrows, l * kQ8_KBytes + 4 + 128 * s,
                                     sumi);
    }
    for (int j = 0; j < N; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
  }
  for (int j = 0; j < N; ++j) *out[j] = sum8(acc[j]);
}

// One Q3_K weight row against N consecutive x rows (N <= 4): a value is its two low bits minus 4
// where its high bit is clear, taken as ggml does, as two unsigned products subtracted.
template <int N>
void q3_k_row(const uint8_t* wrow, const uint8_t* const* xrows, int64_t blocks, float* const* out) {
  constexpr uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
  const __m256i m3 = _mm256_set1_epi8(3);
  const __m256i mone = _mm256_set1_epi8(1);
  const __m128i m32 = _mm_set1_epi8(32);
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ3_KBytes;
    tile::prefetch_block_ahead(wb, kQ3_KBytes);
    const float wd = half_at(wb + 108);
    uint32_t aux[3];
    std::memcpy(aux, wb + 96, 12);
    const __m128i scales128 = _mm_sub_epi8(
        _mm_set_epi32(static_cast<int>(((aux[1] >> 4) & kmask2) | (((aux[2] >> 6) & kmask1) << 4)),
                      static_cast<int>(((aux[0] >> 4) & kmask2) | (((aux[2] >> 4) & kmask1) << 4)),
                      static_cast<int>((aux[1] & kmask2) | (((aux[2] >> 2) & kmask1) << 4)),
                      static_cast<int>((aux[0] & kmask2) | ((aux[2] & kmask1) << 4))),
        m32);
    const SplitScales scales = split_scales(scales128);
    const __m256i hbits = load256(wb);
    float d[N];
    __m256i sumi[N];
    for (int j = 0; j < N; ++j) {
      d[j] = float_at(xrows[j] + l * kQ8_KBytes) * wd;
      sumi[j] = _mm256_setzero_si256();
    }
    int bit = 0;
    for (int s = 0; s < 2; ++s) {
      const __m256i bits = load256(wb + 32 + 32 * s);
      __m256i q[4], minus[4];
      for (int k = 0; k < 4; ++k, ++bit) {
        q[k] = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), m3);
        // 4 where the high bit is clear, 0 where it is set.
        const __m256i clear = _mm256_andnot_si256(hbits, _mm256_slli_epi16(mone, bit));
        minus[k] = _mm256_slli_epi16(_mm256_srli_epi16(clear, bit), 2);
      }
      add_half_super_block<N, true>(q, minus, s == 0 ? scales.low : scales.high, xrows, l * kQ8_KBytes + 4 + 128 * s,
                                    sumi);
    }
    for (int j = 0; j < N; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
  }
  for (int j = 0; j < N; ++j) *out[j] = sum8(acc[j]);
}

// A Q4_K / Q5_K super-block's 6-bit sub-block scales and mins (12 bytes at wb + 4), unpacked as
// ggml does: the 8 mins as 16-bit lanes, and the 8 scales as 16-bit lanes in both halves.
struct KScales {
  __m128i mins;
  __m256i scales;
};
KScales unpack_k_scales(const uint8_t* wb) {
  alignas(16) uint8_t sm[16];
  pair_tiles::k_scales_and_mins(wb, sm);
  const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(sm)));
  const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
  return {_mm256_extracti128_si256(mins_and_scales, 1), _mm256_set_m128i(sc128, sc128)};
}

// The mins' products with an x block's sums of 16 (4 int32 lanes, ggml's pairing of the sums).
__m128i mins_times_sums(const __m128i& mins, const uint8_t* xb) {
  const __m256i q8sums = load256(xb + kQ8_KSums);
  const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
  return _mm_madd_epi16(mins, q8s);
}

// Two 32-value sub-blocks of weights (lo, hi: unsigned values as bytes) times each x row's 64 values
// at byte `at` of its blocks, scaled per sub-block, added to that row's integer sums (ggml's Q4_K /
// Q5_K inner step).
template <int N>
void add_sub_block_pair(const __m256i& lo, const __m256i& hi, const __m256i& scale_lo, const __m256i& scale_hi,
                        const uint8_t* const* xrows, int64_t at, __m256i* sumi) {
  for (int j = 0; j < N; ++j) {
    const uint8_t* q8 = xrows[j] + at;
    const __m256i p_lo = _mm256_madd_epi16(scale_lo, _mm256_maddubs_epi16(lo, load256(q8)));
    const __m256i p_hi = _mm256_madd_epi16(scale_hi, _mm256_maddubs_epi16(hi, load256(q8 + 32)));
    sumi[j] = _mm256_add_epi32(sumi[j], _mm256_add_epi32(p_lo, p_hi));
  }
}

// One Q4_K weight row against N consecutive x rows (N <= 4).
template <int N>
void q4_k_row(const uint8_t* wrow, const uint8_t* const* xrows, int64_t blocks, float* const* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  __m256 acc[N];
  __m128 acc_m[N];
  for (int j = 0; j < N; ++j) {
    acc[j] = _mm256_setzero_ps();
    acc_m[j] = _mm_setzero_ps();
  }
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ4_KBytes;
    tile::prefetch_block_ahead(wb, kQ4_KBytes);
    const float wd = half_at(wb);
    const float wmin = half_at(wb + 2);
    const auto [mins, scales] = unpack_k_scales(wb);
    float d[N];
    __m256i sumi[N];
    for (int j = 0; j < N; ++j) {
      const uint8_t* xb = xrows[j] + l * kQ8_KBytes;
      const float xd = float_at(xb);
      d[j] = xd * wd;
      const float dmin = -xd * wmin;
      // ggml's order: the mins' term of the super-block first, then the scaled sub-blocks.
      acc_m[j] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(mins_times_sums(mins, xb)), acc_m[j]);
      sumi[j] = _mm256_setzero_si256();
    }
    for (int s = 0; s < 4; ++s) {
      const __m256i scale_l = _mm256_shuffle_epi8(scales, pair_shuffle(2 * s));
      const __m256i scale_h = _mm256_shuffle_epi8(scales, pair_shuffle(2 * s + 1));
      const __m256i q4bits = load256(wb + 16 + 32 * s);
      const __m256i q4l = _mm256_and_si256(q4bits, m4);
      const __m256i q4h = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
      add_sub_block_pair<N>(q4l, q4h, scale_l, scale_h, xrows, l * kQ8_KBytes + 4 + 64 * s, sumi);
    }
    for (int j = 0; j < N; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
  }
  for (int j = 0; j < N; ++j) {
    __m128 m = _mm_add_ps(acc_m[j], _mm_movehl_ps(acc_m[j], acc_m[j]));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    *out[j] = sum8(acc[j]) + _mm_cvtss_f32(m);
  }
}

// One Q5_K weight row against N consecutive x rows (N <= 4): Q4_K's layout with a fifth bit per
// value (32 bytes of bit planes before the nibbles) and the mins' term summed as a scalar.
template <int N>
void q5_k_row(const uint8_t* wrow, const uint8_t* const* xrows, int64_t blocks, float* const* out) {
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const __m128i mzero = _mm_setzero_si128();
  const __m256i mone = _mm256_set1_epi8(1);
  __m256 acc[N];
  float summs[N];
  for (int j = 0; j < N; ++j) {
    acc[j] = _mm256_setzero_ps();
    summs[j] = 0.0f;
  }
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ5_KBytes;
    tile::prefetch_block_ahead(wb, kQ5_KBytes);
    const float wd = half_at(wb);
    const float wmin = half_at(wb + 2);
    const auto [mins, scales] = unpack_k_scales(wb);
    const __m256i hbits = load256(wb + 16);
    float d[N];
    __m256i sumi[N];
    for (int j = 0; j < N; ++j) {
      const uint8_t* xb = xrows[j] + l * kQ8_KBytes;
      const float xd = float_at(xb);
      d[j] = xd * wd;
      const float dmin = -xd * wmin;
      const __m128i hsum = _mm_hadd_epi32(_mm_hadd_epi32(mins_times_sums(mins, xb), mzero), mzero);
      summs[j] += dmin * static_cast<float>(_mm_extract_epi32(hsum, 0));
      sumi[j] = _mm256_setzero_si256();
    }
    __m256i hmask = mone;
    int bit = 0;
    for (int s = 0; s < 4; ++s) {
      const __m256i scale_0 = _mm256_shuffle_epi8(scales, pair_shuffle(2 * s));
      const __m256i scale_1 = _mm256_shuffle_epi8(scales, pair_shuffle(2 * s + 1));
      const __m256i q5bits = load256(wb + 48 + 32 * s);
      const __m256i q5h_0 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
      const __m256i q5_0 = _mm256_add_epi8(_mm256_and_si256(q5bits, m4), q5h_0);
      hmask = _mm256_slli_epi16(hmask, 1);
      const __m256i q5h_1 = _mm256_slli_epi16(_mm256_srli_epi16(_mm256_and_si256(hbits, hmask), bit++), 4);
      const __m256i q5_1 = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16(q5bits, 4), m4), q5h_1);
      hmask = _mm256_slli_epi16(hmask, 1);
      add_sub_block_pair<N>(q5_0, q5_1, scale_0, scale_1, xrows, l * kQ8_KBytes + 4 + 64 * s, sumi);
    }
    for (int j = 0; j < N; ++j) acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
  }
  for (int j = 0; j < N; ++j) *out[j] = sum8(acc[j]) + summs[j];
}

// One Q6_K weight row against N consecutive x rows (N <= 4).
template <int N>
void q6_k_row(const uint8_t* wrow, const uint8_t* const* xrows, int64_t blocks, float* const* out) {
  const __m256i m3 = _mm256_set1_epi8(3);
  const __m256i m15 = _mm256_set1_epi8(15);
  __m256 acc[N];
  for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ6_KBytes;
    tile::prefetch_block_ahead(wb, kQ6_KBytes);
    const uint8_t* ql = wb;
    const uint8_t* qh = wb + 128;
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 192));
    const float wd = half_at(wb + 208);
    const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
    float d[N];
    __m256i sumi[N], sub[N];
    for (int j = 0; j < N; ++j) {
      const uint8_t* xb = xrows[j] + l * kQ8_KBytes;
      d[j] = float_at(xb) * wd;
      sub[j] = _mm256_slli_epi32(_mm256_madd_epi16(load256(xb + kQ8_KSums), scales_16), 5);
      sumi[j] = _mm256_setzero_si256();
    }
    for (int s = 0; s < 2; ++s) {
      const __m256i bits1 = load256(ql + 64 * s);
      const __m256i bits2 = load256(ql + 64 * s + 32);
      const __m256i bitsH = load256(qh + 32 * s);
      const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(bitsH, m3), 4);
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(12)), 2);
      const __m256i h2 = _mm256_and_si256(bitsH, _mm256_set1_epi8(48));
      const __m256i h3 = _mm256_srli_epi16(_mm256_and_si256(bitsH, _mm256_set1_epi8(-64)), 2);
      const __m256i q0 = _mm256_or_si256(_mm256_and_si256(bits1, m15), h0);
      const __m256i q1 = _mm256_or_si256(_mm256_and_si256(bits2, m15), h1);
      const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits1, 4), m15), h2);
      const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits2, 4), m15), h3);
      const __m256i sc0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, half_shuffle(4 * s + 0)));
      const __m256i sc1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, half_shuffle(4 * s + 1)));
      const __m256i sc2 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, half_shuffle(4 * s + 2)));
      const __m256i sc3 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, half_shuffle(4 * s + 3)));
      for (int j = 0; j < N; ++j) {
        const uint8_t* q8 = xrows[j] + l * kQ8_KBytes + 4 + 128 * s;
        const __m256i p0 = _mm256_madd_epi16(sc0, _mm256_maddubs_epi16(q0, load256(q8)));
        const __m256i p1 = _mm256_madd_epi16(sc1, _mm256_maddubs_epi16(q1, load256(q8 + 32)));
        const __m256i p2 = _mm256_madd_epi16(sc2, _mm256_maddubs_epi16(q2, load256(q8 + 64)));
        const __m256i p3 = _mm256_madd_epi16(sc3, _mm256_maddubs_epi16(q3, load256(q8 + 96)));
        sumi[j] = _mm256_add_epi32(sumi[j], _mm256_add_epi32(p0, p1));
        sumi[j] = _mm256_add_epi32(sumi[j], _mm256_add_epi32(p2, p3));
      }
    }
    for (int j = 0; j < N; ++j)
      acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[j], sub[j])), acc[j]);
  }
  for (int j = 0; j < N; ++j) *out[j] = sum8(acc[j]);
}

using RowKernel = void (*)(const uint8_t*, const uint8_t* const*, int64_t, float* const*);

// Rows [r0, r1) of W, each against x's rows four at a time.
void tiled(const RowKernel* kernels, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
           int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wrow = w + r * row_bytes;
    for (int64_t i0 = 0; i0 < M; i0 += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, M - i0));
      const uint8_t* xr[4];
      float* out[4];
      for (int j = 0; j < n; ++j) {
        xr[j] = x + (i0 + j) * x_row_bytes;
        out[j] = y + (i0 + j) * ldy + r;
      }
      kernels[n - 1](wrow, xr, blocks, out);
    }
  }
}

constexpr RowKernel kQ2_K[4] = {q2_k_row<1>, q2_k_row<2>, q2_k_row<3>, q2_k_row<4>};
constexpr RowKernel kQ3_K[4] = {q3_k_row<1>, q3_k_row<2>, q3_k_row<3>, q3_k_row<4>};
constexpr RowKernel kQ4_K[4] = {q4_k_row<1>, q4_k_row<2>, q4_k_row<3>, q4_k_row<4>};
constexpr RowKernel kQ5_K[4] = {q5_k_row<1>, q5_k_row<2>, q5_k_row<3>, q5_k_row<4>};
constexpr RowKernel kQ6_K[4] = {q6_k_row<1>, q6_k_row<2>, q6_k_row<3>, q6_k_row<4>};

}  // namespace

bool k_quant_tiles_available() { return true; }

namespace pair_tiles {
void k_scales_and_mins(const uint8_t* wb, uint8_t* out) {
  constexpr uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
  uint32_t utmp[4];
  std::memcpy(utmp, wb + 4, 12);
  utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
  const uint32_t uaux = utmp[1] & kmask1;
  utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
  utmp[2] = uaux;
  utmp[0] &= kmask1;
  std::memcpy(out, utmp, 16);
}
}  // namespace pair_tiles

void q2_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  tiled(kQ2_K, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy);
}

void q3_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  tiled(kQ3_K, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy);
}

void q4_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  // Rows in pairs through AVX-512 VNNI where the CPU has it (pair_tiles.h); an odd last row stays here.
  if (pair_tiles_take(GGML_TYPE_Q4_K, GGML_TYPE_Q8_K, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy)) return;
  tiled(kQ4_K, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy);
}

void q5_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  if (pair_tiles_take(GGML_TYPE_Q5_K, GGML_TYPE_Q8_K, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy)) return;
  tiled(kQ5_K, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy);
}

void q6_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  if (pair_tiles_take(GGML_TYPE_Q6_K, GGML_TYPE_Q8_K, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy)) return;
  tiled(kQ6_K, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy);
}

#else

bool k_quant_tiles_available() { return false; }

void q2_k_tiled_dot(const uint8_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                    int64_t) {
  KV_FAIL("internal: the K-quant tiles need AVX2 and FMA");
}

void q3_k_tiled_dot(const uint8_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                    int64_t) {
  KV_FAIL("internal: the K-quant tiles need AVX2 and FMA");
}

void q4_k_tiled_dot(const uint8_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                    int64_t) {
  KV_FAIL("internal: the K-quant tiles need AVX2 and FMA");
}

void q5_k_tiled_dot(const uint8_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                    int64_t) {
  KV_FAIL("internal: the K-quant tiles need AVX2 and FMA");
}

void q6_k_tiled_dot(const uint8_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                    int64_t) {
  KV_FAIL("internal: the K-quant tiles need AVX2 and FMA");
}

#endif

}  // namespace kvserve
