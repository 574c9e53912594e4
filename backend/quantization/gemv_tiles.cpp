#include "backend/quantization/gemv_tiles.h"

#include "backend/quantization/tile_arith.h"
#include "common/check.h"
#include "ggml.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstring>
#include <vector>
#endif

namespace kvserve {

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)

namespace {

using tile::half_at;
using tile::lane_sums;
using tile::sum8;
using tile::unpack_nibbles;

// ggml's block layouts (ggml-common.h): Q4_1 = fp16 d, fp16 m, 16 bytes of nibbles (value j in the
// low nibble of byte j, value j + 16 in the high one); Q4_0 = fp16 d and the same nibbles, each value
// offset by 8; Q5_0 = fp16 d, 4 bytes of fifth bits (bit j of the little-endian word for value j),
// then Q4_0's nibbles, each value offset by 16; Q5_1 = fp16 d, fp16 m, the fifth bits, the nibbles
// (Q4_1 with a fifth bit); Q8_0 = fp16 d, 32 signed bytes; Q8_1 = fp16 d, fp16 s (d times the
// values' sum), 32 signed bytes.
enum class Kind { kQ4_1, kQ4_0, kQ5_0, kQ5_1, kQ8_0 };
// The kinds with a min (d * q + m), multiplied against Q8_1 rows.
constexpr bool with_min(Kind k) { return k == Kind::kQ4_1 || k == Kind::kQ5_1; }
constexpr int64_t block_bytes(Kind k) {
  return k == Kind::kQ4_1 ? 20 : k == Kind::kQ4_0 ? 18 : k == Kind::kQ5_0 ? 22 : k == Kind::kQ5_1 ? 24 : 34;
}
constexpr int64_t quants_at(Kind k) {
  return k == Kind::kQ4_1 ? 4 : k == Kind::kQ5_0 ? 6 : k == Kind::kQ5_1 ? 8 : 2;
}
constexpr int64_t x_block_bytes(Kind k) { return with_min(k) ? 36 : 34; }
constexpr int64_t x_quants_at(Kind k) { return with_min(k) ? 4 : 2; }

// The 32 fifth bits of a Q5_0 / Q5_1 block (at p) as bytes: 0xFF where the bit is set.
__m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  // Byte j of the result looks at source byte j / 8 (each 128-bit half shuffles its own copy of the
  // word) and keeps bit j % 8 of it: 0xFF where the fifth bit is set.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// A Q5_0 block's 32 values as signed bytes in [-16, 15]: a nibble whose fifth bit is clear is
// nibble - 16, i.e. the nibble with its byte's top four bits set.
__m256i q5_0_values(const uint8_t* wb) {
  const __m256i clear = _mm256_andnot_si256(fifth_bits(wb + 2), _mm256_set1_epi8(static_cast<char>(0xF0)));
  return _mm256_or_si256(unpack_nibbles(wb + quants_at(Kind::kQ5_0)), clear);
}

// A Q5_1 block's 32 values as unsigned bytes in [0, 31].
__m256i q5_1_values(const uint8_t* wb) {
  const __m256i high = _mm256_and_si256(fifth_bits(wb + 4), _mm256_set1_epi8(0x10));
  return _mm256_or_si256(unpack_nibbles(wb + quants_at(Kind::kQ5_1)), high);
}

// x's per-block values used by every weight row: its quants, its scale and (Q8_1) sum term as
// floats [d, s, 0, 0], and for Q4_0 the lane sums of its quants times 8 (the weights' offset).
struct XBlock {
  __m256i q;
  __m128 ds;
  __m256i offset;
};

// A weight block's fp16 scale (and Q4_1's min after it) times x's [d, s]: [d * x.d, m * x.s, ..].
// Each lane is the one float product ggml's vec_dot computes; one conversion serves both halves.
template <Kind K>
__m128 block_scales(const uint8_t* wb, __m128 xds) {
  return _mm_mul_ps(tile::halves_at(wb, with_min(K) ? 2 : 1), xds);
}

// R weight rows (R <= 4) against x: R accumulators in registers.
template <Kind K, int R>
void rows_times_x(const uint8_t* const* wrows, const std::vector<XBlock>& xb, float* out) {
  __m256 acc[R];
  __m128 mins[R];  // lane 1: the sum of the blocks' min terms, in block order as ggml adds them
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    mins[r] = _mm_setzero_ps();
  }
  const int64_t blocks = static_cast<int64_t>(xb.size());
  for (int64_t l = 0; l < blocks; ++l) {
    const XBlock& x = xb[static_cast<size_t>(l)];
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = wrows[r] + l * block_bytes(K);
      tile::prefetch_ahead(wb);
      const __m128 scales = block_scales<K>(wb, x.ds);
      __m256i lanes;
      if constexpr (with_min(K)) {
        // ggml adds the min's term first; a product of two fp16 values is exact in fp32.
        mins[r] = _mm_add_ps(mins[r], scales);
        lanes = lane_sums(K == Kind::kQ4_1 ? unpack_nibbles(wb + quants_at(K)) : q5_1_values(wb), x.q);
      } else if constexpr (K == Kind::kQ4_0) {
        // (q - 8) . y = q . y - 8 * sum(y), lane by lane, in exact integers.
        lanes = _mm256_sub_epi32(lane_sums(unpack_nibbles(wb + quants_at(K)), x.q), x.offset);
      } else {
        // Signed weights times signed x as ggml pairs them: |w| times x with w's sign.
        const __m256i w = K == Kind::kQ5_0 ? q5_0_values(wb)
                                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + quants_at(K)));
        lanes = lane_sums(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x.q, w));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(scales), _mm256_cvtepi32_ps(lanes), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = with_min(K) ? sum8(acc[r]) + _mm_cvtss_f32(_mm_movehdup_ps(mins[r])) : sum8(acc[r]);
}

template <Kind K>
void rows_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x, int64_t blocks,
              float* y) {
  // x's blocks decoded once for all of this thread's rows.
  std::vector<XBlock> xb(static_cast<size_t>(blocks));
  for (int64_t l = 0; l < blocks; ++l) {
    const uint8_t* b = x + l * x_block_bytes(K);
    XBlock& o = xb[static_cast<size_t>(l)];
    o.q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + x_quants_at(K)));
    o.ds = _mm_setr_ps(half_at(b), with_min(K) ? half_at(b + 2) : 0.0f, 0.0f, 0.0f);
    o.offset = K == Kind::kQ4_0 ? _mm256_slli_epi32(lane_sums(_mm256_set1_epi8(1), o.q), 3) : _mm256_setzero_si256();
  }
  int64_t r = r0;
  const uint8_t* rows[4];
  for (; r + 4 <= r1; r += 4) {
    for (int i = 0; i < 4; ++i) rows[i] = w + (r + i) * row_bytes;
    rows_times_x<K, 4>(rows, xb, y + r);
  }
  for (; r < r1; ++r) {
    rows[0] = w + r * row_bytes;
    rows_times_x<K, 1>(rows, xb, y + r);
  }
}

}  // namespace

bool gemv_tiles_support(int type, int act) {
  return ((type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1) && act == GGML_TYPE_Q8_1) ||
         ((type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q8_0) && act == GGML_TYPE_Q8_0);
}

void gemv_tiled_dot(int type, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t blocks, float* y) {
  switch (type) {
    case GGML_TYPE_Q4_1: return rows_dot<Kind::kQ4_1>(w, row_bytes, r0, r1, x, blocks, y);
    case GGML_TYPE_Q4_0: return rows_dot<Kind::kQ4_0>(w, row_bytes, r0, r1, x, blocks, y);
    case GGML_TYPE_Q5_0: return rows_dot<Kind::kQ5_0>(w, row_bytes, r0, r1, x, blocks, y);
    case GGML_TYPE_Q5_1: return rows_dot<Kind::kQ5_1>(w, row_bytes, r0, r1, x, blocks, y);
    case GGML_TYPE_Q8_0: return rows_dot<Kind::kQ8_0>(w, row_bytes, r0, r1, x, blocks, y);
    default: KV_FAIL("internal: no one-row tiles for ggml type " << type);
  }
}

#else

bool gemv_tiles_support(int, int) { return false; }

void gemv_tiled_dot(int, const uint8_t*, int64_t, int64_t, int64_t, const uint8_t*, int64_t, float*) {
  KV_FAIL("internal: the one-row tiles need AVX2, FMA and F16C");
}

#endif

}  // namespace kvserve
