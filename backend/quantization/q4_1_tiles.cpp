#include "backend/quantization/q4_1_tiles.h"

#include "backend/quantization/q4_1_pairs_kernel.h"
#include "backend/quantization/tile_arith.h"
#include "common/env_int.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>
#endif

#include "common/check.h"

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

// AVX-512 VNNI's pair kernel where the CPU has it; KVSERVE_Q4_1_PAIRS=0 keeps the AVX2 tiles (A/B).
q4_1_pairs::PairsFn pairs_kernel() {
  static const q4_1_pairs::PairsFn fn = env_int("KVSERVE_Q4_1_PAIRS", 1) != 0 ? q4_1_pairs::kernel() : nullptr;
  return fn;
}

// x's rows in pairs as the pair kernel reads them (q4_1_pairs_kernel.h), in one 64-byte-aligned
// buffer (a 64-byte load that straddles two cache lines costs two).
struct PackedPairs {
  const uint8_t* quants;
  const float* d_lanes;
  const float* s_rows;
};
PackedPairs pack_pairs(const uint8_t* x, int64_t x_row_bytes, int64_t pairs, int64_t blocks, std::vector<uint8_t>& buf) {
  using q4_1_pairs::kPassPairs;
  const int64_t passes = (pairs + kPassPairs - 1) / kPassPairs;
  const int64_t q_bytes = pairs * blocks * 64, d_bytes = pairs * blocks * 64, s_bytes = passes * blocks * 32;
  buf.resize(static_cast<size_t>(q_bytes + d_bytes + s_bytes + 64));
  uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  uint8_t* quants = base;
  auto* d_lanes = reinterpret_cast<float*>(base + q_bytes);
  auto* s_rows = reinterpret_cast<float*>(base + q_bytes + d_bytes);
  std::fill(s_rows, s_rows + passes * blocks * 8, 0.0f);
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t l = 0; l < blocks; ++l) {
      const uint8_t* a = x + (2 * p) * x_row_bytes + l * kQ8_1Bytes;
      const uint8_t* b = a + x_row_bytes;
      uint8_t* q = quants + (p * blocks + l) * 64;
      std::memcpy(q, a + 4, 32);
      std::memcpy(q + 32, b + 4, 32);
      float* d = d_lanes + (p * blocks + l) * 16;
      std::fill(d, d + 8, half_at(a));
      std::fill(d + 8, d + 16, half_at(b));
      float* s = s_rows + ((p / kPassPairs) * blocks + l) * 8 + 2 * (p % kPassPairs);
      s[0] = half_at(a + 2);
      s[1] = half_at(b + 2);
    }
  return {quants, d_lanes, s_rows};
}

}  // namespace

bool q4_1_tiles_available() { return true; }

void q4_1_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  if (const auto kernel = pairs_kernel(); kernel && M >= 2) {
    // Rows in pairs through AVX-512; an odd last row takes the AVX2 tile below.
    thread_local std::vector<uint8_t> buf;
    const int64_t pairs = M / 2;
    const PackedPairs packed = pack_pairs(x, x_row_bytes, pairs, blocks, buf);
    kernel(w, row_bytes, r0, r1, packed.quants, packed.d_lanes, packed.s_rows, pairs, blocks, y, ldy);
    if (M % 2 == 0) return;
    x += (M - 1) * x_row_bytes;
    y += (M - 1) * ldy;
    M = 1;
  }
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
