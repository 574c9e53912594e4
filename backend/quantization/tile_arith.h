#pragma once
// Arithmetic the quantized tiles (q4_1_tiles.cpp, k_quant_tiles.cpp) share with ggml's AVX2 dot
// products: reading a block's fp16 scale, and the horizontal sum of 8 floats in ggml's order, so
// that a tile's output equals the one-row vec_dot bit for bit. x86 with AVX2, FMA and F16C only.
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

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
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
