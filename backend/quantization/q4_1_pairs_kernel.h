#pragma once
// The Q4_1 tiles' AVX-512 VNNI kernel: one 512-bit register holds the 8 accumulator lanes of two
// activation rows, so each unpacked weight block is multiplied with two rows of x per instruction.
// Declarations only: q4_1_pairs_avx512.cpp is compiled for AVX-512 and must share no inline code
// with the baseline build (an inline function compiled there could replace the baseline copy).
#include <cstdint>

namespace kvserve::q4_1_pairs {

// The kernel takes x's rows in passes of kPassPairs pairs (rows 2p and 2p + 1), packed as:
//   quants  [pairs][blocks][64] bytes, 64-byte aligned: block l's 32 quants of row 2p, then row 2p + 1's;
//   d_lanes [pairs][blocks][16] floats, 64-byte aligned: row 2p's x.d in lanes 0-7, row 2p + 1's in 8-15;
//   s_rows  [passes][blocks][8] floats: the x.s of the pass's rows (lanes past its last row unused).
// y[(2p + i) * ldy + r] = dot(W row r, x row 2p + i) for r in [r0, r1), p < pairs, i < 2, each
// equal bit for bit to ggml's AVX2 vec_dot_q4_1_q8_1 (same lane sums, products and order).
constexpr int64_t kPassPairs = 4;
using PairsFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* quants,
                         const float* d_lanes, const float* s_rows, int64_t pairs, int64_t blocks, float* y,
                         int64_t ldy);

// Null unless this CPU has AVX-512 F, BW, VL and VNNI (and the build is x86-64).
PairsFn kernel();

}  // namespace kvserve::q4_1_pairs
