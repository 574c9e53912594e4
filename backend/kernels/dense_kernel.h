#pragma once
// The small-batch dense kernel on raw fp32 rows, once per instruction set (chosen at run time).
#include <cstdint>

namespace kvserve::dense_kernel {

// y[m, n] = x[m]·w[n] (+ bias[n]) for every m < M and n in [n0, n1); x [M, K], w [N, K], y [M, N],
// all row-major and dense. Each output is one dot product in an order fixed by K alone.
using RowsFn = void (*)(const float* x, int64_t M, int64_t K, const float* w, const float* bias, float* y, int64_t N,
                        int64_t n0, int64_t n1);

// AVX2 + FMA (the build's baseline on x86-64); null where the build has neither.
RowsFn rows_avx2();
// AVX-512F (twice the lanes and registers); null unless the build compiled it and this CPU runs it.
RowsFn rows_avx512();

}  // namespace kvserve::dense_kernel
