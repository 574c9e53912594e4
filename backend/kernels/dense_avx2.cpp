// The small-batch dense kernel for AVX2 + FMA (dense_tiles.inc over 8-float vectors).
#include "backend/kernels/dense_kernel.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace kvserve::dense_kernel {
namespace {

struct Vec {
  using T = __m256;
  static constexpr int64_t kLanes = 8;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(T v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
// 8 accumulators + 4 weight vectors + 1 input vector of 16 registers.
constexpr int kNR = 4, kMR = 2;

#include "backend/kernels/dense_tiles.inc"

}  // namespace

RowsFn rows_avx2() { return &rows; }

}  // namespace kvserve::dense_kernel

#else

namespace kvserve::dense_kernel {
RowsFn rows_avx2() { return nullptr; }
}  // namespace kvserve::dense_kernel

#endif
