#pragma once
// Several activation rows times K-quant weights at once (Q2_K ... Q6_K: llama.cpp's Q2_K, Q3_K_M,
// Q4_K_M and Q5_K_M files, Gemma 3's among them), for which ggml has no tiled kernel: each 256-value
// super-block's low bits, high bits and sub-block scales are unpacked once for up to four rows of x,
// where a vec_dot per (weight row, x row) unpacks them once a row. Every output repeats ggml's AVX2
// vec_dot_q2_K_q8_K ... q6_K arithmetic in the same order, so it equals the one-row dot product bit
// for bit.
#include <cstdint>

namespace kvserve {

// Whether this build has the kernels (x86 with AVX2 and FMA).
bool k_quant_tiles_available();

// y[m * ldy + r] = dot(W row r, x row m) for r in [r0, r1), m < M. W: rows of `blocks` Q2_K (Q3_K,
// Q4_K, Q5_K, Q6_K) super-blocks, row_bytes apart; x: M rows of `blocks` Q8_K blocks (ggml's activation format
// for the K-quants), x_row_bytes apart.
void q2_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy);
void q3_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy);
void q4_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy);
void q5_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy);
void q6_k_tiled_dot(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy);

}  // namespace kvserve
