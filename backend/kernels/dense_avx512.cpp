// The small-batch dense kernel for AVX-512F (dense_tiles.inc over 16-float vectors). This file alone
// is compiled with -mavx512f (backend/CMakeLists.txt), so it includes nothing but intrinsics: an
// inline function from a shared header compiled here could replace the baseline copy at link time.
#include "backend/kernels/dense_kernel.h"

#if defined(__AVX512F__)
#include <immintrin.h>

// GCC 12's AVX-512 headers make "undefined" vectors by self-assignment, which -Wuninitialized flags
// wherever an extract inlines; no value here is read uninitialised.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace kvserve::dense_kernel {
namespace {

struct Vec {
  using T = __m512;
  static constexpr int64_t kLanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(T v) { return _mm512_reduce_add_ps(v); }
};
// 16 accumulators + 4 weight vectors + 1 input vector of 32 registers.
constexpr int kNR = 4, kMR = 4;

#include "backend/kernels/dense_tiles.inc"

}  // namespace

RowsFn rows_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") ? &rows : nullptr;
}

}  // namespace kvserve::dense_kernel

#else

namespace kvserve::dense_kernel {
RowsFn rows_avx512() { return nullptr; }
}  // namespace kvserve::dense_kernel

#endif
