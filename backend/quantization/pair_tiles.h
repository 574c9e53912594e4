#pragma once
// Several rows of x times Q4_1, Q8_0, Q4_0, Q5_0, Q4_K, Q5_K or Q6_K weights two rows at a time, on CPUs with AVX-512 VNNI
// (pair_tiles_kernel.h): x is packed once a call, pair by pair, and each weight block is multiplied
// with two rows per instruction. Every output equals ggml's one-row vec_dot bit for bit.
#include <cstdint>

namespace kvserve {

// Whether the pair kernel serves these ggml types (Q4_1 weights with Q8_1 activations, Q8_0, Q4_0
// and Q5_0 with Q8_0, Q4_K, Q5_K and Q6_K with Q8_K) on this CPU. KVSERVE_PAIR_TILES=0 in the environment turns it off (the A/B).
bool pair_tiles_available(int type, int act);

// y[m * ldy + r] = dot(W row r, x row m) for r in [r0, r1) and m below M rounded down to even; returns
// that many rows (the caller takes an odd last row). W: rows of `blocks` blocks of `type`, row_bytes
// apart; x: M rows of `blocks` blocks of its activation type, x_row_bytes apart.
int64_t pair_tiles_dot(int type, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                       int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy);

// For a tiled product's caller: where the pair kernel serves (type, act) and M >= 2, runs it over
// x's first rows (M rounded down to even) and moves x, y and M past them. True when no row is left
// (an odd last row stays for the caller's own tile).
bool pair_tiles_take(int type, int act, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t*& x,
                     int64_t x_row_bytes, int64_t& M, int64_t blocks, float*& y, int64_t ldy);

}  // namespace kvserve
