#include "backend/quantization/q4_1_tiles.h"

#include "backend/quantization/pair_tiles.h"
#include "backend/quantization/tile_arith.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>
#endif

#include "common/check.h"
#include "ggml.h"

namespace kvserve {

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)

namespace {

using tile::half_at;
using tile::lane_sums;
using tile::sum8;
using tile::unpack_nibbles;

// ggml's block layouts (ggml-common.h): Q4_1 = fp16 scale d, fp16 min m, 16 bytes of nibbles (value
// j in the low nibble of byte j, value j + 16 in its high nibble); Q8_1 = fp16 d, fp16 s (d times
// the sum of the 32 values), 32 signed bytes.
constexpr int64_t kQ4_1Bytes = 20;
constexpr int64_t kQ8_1Bytes = 36;

// The block's lane sums as 8 floats (exact integers).
__m256 dot_lanes(__m256i w, __m256i x) { return _mm256_cvtepi32_ps(lane_sums(w, x)); }

// An x block's [d, s, 0, 0] (a struct: a vector of bare __m128 drops its alignment attribute).
struct XScales {
  __m128 ds;
};

// One weight row against N consecutive x rows (N <= 4): the accumulators stay in registers.
// xds[j][l].ds = [d, s, 0, 0] of x row j's block l.
template <int N>
void row_times_rows(const uint8_t* wrow, const uint8_t* const* xrows, const XScales* const* xds, int64_t blocks,
                    float* const* out) {
  __m256 acc[N];
  __m128 mins[N];  // lane 1: the blocks' min terms summed in block order, as ggml adds them
  for (int j = 0; j < N; ++j) {
    acc[j] = _mm256_setzero_ps();
    mins[j] = _mm_setzero_ps();
  }
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* wb = wrow + l * kQ4_1Bytes;
    tile::prefetch_ahead(wb);
    const __m128 dm = tile::halves_at(wb, 2);  // [d, m, 0, 0]
    const __m256i q = unpack_nibbles(wb + 4);
    for (int j = 0; j < N; ++j) {
      // ggml's order: the min's term first, then the scaled lanes. Both lanes of the product are
      // ggml's own float products (d * x.d, and m * x.s, exact in fp32).
      const __m128 scales = _mm_mul_ps(dm, xds[j][l].ds);
      mins[j] = _mm_add_ps(mins[j], scales);
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xrows[j] + l * kQ8_1Bytes + 4));
      acc[j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), dot_lanes(q, xq), acc[j]);
    }
  }
  for (int j = 0; j < N; ++j) *out[j] = sum8(acc[j]) + _mm_cvtss_f32(_mm_movehdup_ps(mins[j]));
}

}  // namespace

bool q4_1_tiles_available() { return true; }

void q4_1_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  // Rows in pairs through AVX-512 VNNI where the CPU has it (pair_tiles.h); an odd last row stays here.
  if (pair_tiles_take(GGML_TYPE_Q4_1, GGML_TYPE_Q8_1, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy)) return;
  // x's scales as floats once, not once per weight row.
  std::vector<XScales> ds(static_cast<size_t>(M * blocks));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t l = 0; l < blocks; ++l) {
      const uint8_t* b = x + i * x_row_bytes + l * kQ8_1Bytes;
      ds[static_cast<size_t>(i * blocks + l)].ds = _mm_setr_ps(half_at(b), half_at(b + 2), 0.0f, 0.0f);
    }
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* wrow = w + r * row_bytes;
    for (int64_t i0 = 0; i0 < M; i0 += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, M - i0));
      const uint8_t* xr[4];
      const XScales* xds[4];
      float* out[4];
      for (int j = 0; j < n; ++j) {
        xr[j] = x + (i0 + j) * x_row_bytes;
        xds[j] = ds.data() + (i0 + j) * blocks;
        out[j] = y + (i0 + j) * ldy + r;
      }
      switch (n) {
        case 4: row_times_rows<4>(wrow, xr, xds, blocks, out); break;
        case 3: row_times_rows<3>(wrow, xr, xds, blocks, out); break;
        case 2: row_times_rows<2>(wrow, xr, xds, blocks, out); break;
        default: row_times_rows<1>(wrow, xr, xds, blocks, out); break;
      }
    }
  }
}

#else

bool q4_1_tiles_available() { return false; }

void q4_1_tiled_dot(const uint8_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                    int64_t) {
  KV_FAIL("internal: the Q4_1 tiles need AVX2 and FMA");
}

#endif

}  // namespace kvserve
