#pragma once
// The AVX-512 VNNI pair kernels of the quantized tiles (Q4_1 weights x Q8_1 activations; Q8_0, Q4_0
// and Q5_0 x Q8_0; Q4_K, Q5_K and Q6_K x Q8_K): one 512-bit register holds the 8 accumulator lanes of two activation rows, so each weight
// block is multiplied with two rows of x per instruction. Declarations only: pair_tiles_avx512.cpp is
// compiled for AVX-512 and must share no inline code with the baseline build (an inline function
// compiled there could replace the baseline copy at link time). Packing lives in pair_tiles.h.
#include <cstdint>

namespace kvserve::pair_tiles {

// A kernel takes x's rows in passes of kPassPairs pairs (rows 2p and 2p + 1), packed as:
//   quants  [pairs][blocks][64] bytes, 64-byte aligned: block l's 32 quants of row 2p, then row 2p + 1's;
//   d_lanes [pairs][blocks][16] floats, 64-byte aligned: row 2p's x.d in lanes 0-7, row 2p + 1's in 8-15;
//   s_rows  [passes][blocks][8] floats: the x.s of the pass's rows (Q8_1's, for Q4_1; lanes past the
//           pass's last row unused; null for the others);
//   offsets [pairs][blocks][16] int32, 64-byte aligned: for Q4_0 (c = 8) and Q5_0 (c = 16), -c times
//           the sum of each lane's 4 x bytes, row 2p's lanes 0-7, row 2p + 1's 8-15 (null for the others).
// y[(2p + i) * ldy + r] = dot(W row r, x row 2p + i) for r in [r0, r1), p < pairs, i < 2, each
// equal bit for bit to ggml's AVX2 vec_dot of the types (the same integer lane sums, float products
// and order).
constexpr int64_t kPassPairs = 4;
using PairsFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* quants,
                         const float* d_lanes, const float* s_rows, const int32_t* offsets, int64_t pairs,
                         int64_t blocks, float* y, int64_t ldy);

// Q4_K weights x Q8_K activations (256-value super-blocks), packed per (pair, super-block):
//   quants   [pairs][blocks][8][64] bytes, 64-byte aligned: sub-block k's 32 quants of row 2p, then row 2p + 1's;
//   d_lanes  [pairs][blocks][16] floats, 64-byte aligned: x.d of row 2p in lanes 0-7, row 2p + 1's in 8-15;
//   d4_lanes [pairs][blocks][8] floats: x.d of row 2p in lanes 0-3, row 2p + 1's in 4-7;
//   bsums    [pairs][blocks][16] int16: Q8_K's sums of 16 quants added two by two (ggml's hadd):
//            row 2p's 8, then row 2p + 1's.
using KPairsFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* quants,
                          const float* d_lanes, const float* d4_lanes, const int16_t* bsums, int64_t pairs,
                          int64_t blocks, float* y, int64_t ldy);

// Q6_K weights x Q8_K activations: quants and d_lanes as for Q4_K; d4_lanes unused (null); bsums
// [pairs][blocks][32] int16: Q8_K's 16 sums of 16 quants of row 2p, then row 2p + 1's.

// Null unless this CPU has AVX-512 F, BW, VL and VNNI (and the build is x86-64).
PairsFn q4_1_kernel();
PairsFn q8_0_kernel();
PairsFn q4_0_kernel();  // Q4_0 x Q8_0
PairsFn q5_0_kernel();  // Q5_0 x Q8_0
KPairsFn q4_k_kernel();
KPairsFn q5_k_kernel();  // Q5_K: as Q4_K (d4_lanes unused)
KPairsFn q6_k_kernel();

// A Q4_K / Q5_K super-block's 12 bytes of 6-bit sub-block scales and mins (at wb + 4) as ggml
// unpacks them: out[0..7] the 8 scales, out[8..15] the 8 mins (k_quant_tiles.cpp, baseline code).
void k_scales_and_mins(const uint8_t* wb, uint8_t* out);

}  // namespace kvserve::pair_tiles
