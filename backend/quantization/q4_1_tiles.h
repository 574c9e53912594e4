#pragma once
// Several activation rows times Q4_1 weights at once (the default model's GGUF format), for which
// ggml has no tiled kernel: each weight block is unpacked once for up to four rows of x, where a
// vec_dot per (weight row, x row) unpacks it once a row. Every output repeats ggml's AVX2
// vec_dot_q4_1_q8_1 arithmetic in the same order, so it equals the one-row dot product bit for bit.
#include <cstdint>

namespace kvserve {

// Whether this build has the kernel (x86 with AVX2 and FMA).
bool q4_1_tiles_available();

// y[m * ldy + r] = dot(W row r, x row m) for r in [r0, r1), m < M. W: rows of `blocks` Q4_1 blocks,
// row_bytes apart; x: M rows of `blocks` Q8_1 blocks (ggml's activation format for Q4_1),
// x_row_bytes apart.
void q4_1_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy);

}  // namespace kvserve
