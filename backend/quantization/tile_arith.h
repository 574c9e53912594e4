#pragma once
// Arithmetic the quantized tiles (q4_1_tiles.cpp, k_quant_tiles.cpp, gemv_tiles.cpp) share with
// ggml's AVX2 dot products: reading a block's fp16 scales, unpacking nibbles, integer lane sums, and
// the horizontal sum of 8 floats in ggml's order, so that a tile's output equals the one-row
// vec_dot bit for bit. x86 with AVX2, FMA and F16C only.
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kvserve::tile {

// How far ahead of the block being read a weight row is prefetched. A decode step streams every
// weight from DRAM once, and without software prefetch the tiles wait on memory: on a 2-vCPU Xeon
// VM the default model's layers ran at 7 GB/s from DRAM against 13 GB/s a core from L2. 8 KiB
// ahead measured best there (0.5-16 KiB tried), 1.5x the one-row vec_dot loop.
constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch_ahead(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0); }

// prefetch_ahead for a block of `bytes` (a K-quant super-block spans 3-4 cache lines, and a block
// need not start on a line): every line from p + kPrefetchBytes to its last byte.
inline void prefetch_block_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) prefetch_ahead(p + off);
  prefetch_ahead(p + bytes - 1);
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}

// The first `n` (1 or 2) fp16 values at p as [v0, v1 or 0, 0, 0]: a block's scale, or its scale
// and min, in one conversion.
inline __m128 halves_at(const uint8_t* p, size_t n) {
  uint32_t bits = 0;
  std::memcpy(&bits, p, n * sizeof(uint16_t));
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
}

// The 32 4-bit values of a Q4_0 / Q4_1 block's 16 bytes as bytes 0..15, in order (value j in the
// low nibble of byte j, value j + 16 in its high nibble).
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(lo, 4), lo);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Sums of 4 neighbouring products of unsigned bytes u and signed bytes s as 8 int32 lanes (exact:
// every pair sum fits in int16 for the ranges the tiles use), the lanes of ggml's dot products.
inline __m256i lane_sums(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// ggml's hsum_float_8: high half plus low half, then pairs, then the last two.
inline float sum8(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

}  // namespace kvserve::tile

#endif
