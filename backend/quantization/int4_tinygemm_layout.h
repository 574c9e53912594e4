#pragma once
// Where tinygemm keeps a 4-bit code: at::_convert_weight_to_int4pack turns codes [N, K] (two a byte,
// the even column in the high nibble) into int32 words [N / 8, K / (16 tiles), 32 lanes, tiles / 2],
// laid out for the m16n8k16 tensor-core B operand. One word holds 8 codes of one row. Shared by the
// CUDA dequantize kernel (backend/cuda/int4_dequant.cu) and the gtest that checks it inverts the
// packing on the host.
#include <cstdint>

#if defined(__CUDACC__)
#define KVSERVE_HOST_DEVICE __host__ __device__
#else
#define KVSERVE_HOST_DEVICE
#endif

namespace kvserve::int4_layout {

// Row and column of nibble `i` (0..7, from the least significant) of word `word` of a packed weight
// with `tiles` inner k tiles (2, 4 or 8) and K columns.
struct Where {
  int64_t row, col;
};
KVSERVE_HOST_DEVICE inline Where locate(int64_t word, int i, int64_t K, int tiles) {
  const int64_t per_lane = tiles / 2;                // words a lane holds per k super-tile
  const int64_t k_super = K / (tiles * 16);          // k super-tiles per row tile
  const int64_t j = word % per_lane;                 // which pair of inner k tiles
  const int64_t lane = (word / per_lane) % 32;
  const int64_t k_outer = (word / (per_lane * 32)) % k_super;
  const int64_t n_tile = word / (per_lane * 32 * k_super);
  // The lane's four source bytes: two in each k tile of the pair, 4 bytes (8 columns) apart.
  const int64_t base = (k_outer * tiles + 2 * j) * 8 + lane % 4;
  const int b = i % 4;                               // nibbles 0-3: high halves of bytes 0-3; 4-7: low halves
  const int64_t byte = base + (b % 2) * 4 + (b / 2) * 8;
  return {n_tile * 8 + lane / 4, 2 * byte + (i < 4 ? 0 : 1)};
}

}  // namespace kvserve::int4_layout
