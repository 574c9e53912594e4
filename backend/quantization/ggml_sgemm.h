#pragma once
// llamafile's tiled quantized GEMM (ggml-cpu's llamafile_sgemm, "tinyBLAS") for several rows of
// activations at once: llama.cpp's own kernel for batches of Q8_0 / Q4_0 / Q5_0 / IQ4_NL weights
// against Q8_0 activations, where a loop of vec_dot calls decodes each weight block once per row.
#include <cstdint>

namespace kvserve {

// Whether tiled_quant_matmul() takes weights of this ggml type with these activations (ggml types)
// on this build's CPU.
bool tiled_quant_matmul_supports(int weight_type, int act_type);

// y[m * ldy + r] = dot(W row r, x row m) for r < rows, m < M: W `rows` rows of `k_blocks` blocks
// (row stride w_stride blocks), x M rows in act_type (stride x_stride blocks). The work splits into
// nth parts by output tiles; part ith runs here (no barrier: the parts may run on any threads).
// Each output is accumulated block by block in order, so it does not depend on M or the tiling.
// Returns false when the kernel does not take the shapes (M < 2) or types.
bool tiled_quant_matmul(int weight_type, int act_type, int64_t rows, int64_t M, int64_t k_blocks, const void* w,
                        int64_t w_stride, const void* x, int64_t x_stride, float* y, int64_t ldy, int ith, int nth);

}  // namespace kvserve
