#pragma once
// One activation row times several weight rows at once (the decode step of one sequence) for the
// block types of the default model, of --quantization and of K-quant files' smaller tensors (Q4_1,
// Q8_0, Q4_0, Q5_0, Q5_1): x's block is loaded once for four weight rows, and the four rows'
// accumulations run side by side, where ggml's vec_dot takes one row at a time and waits on its one
// accumulator. Each output repeats ggml's AVX2 vec_dot arithmetic in the same order (integer lane
// sums, then one FMA a block, then ggml's horizontal sum), so it equals the one-row dot product bit
// for bit.
#include <cstdint>

namespace kvserve {

// Whether this build has the kernels (x86 with AVX2, FMA and F16C) and they take `type` (a ggml
// weight type) against `act` (its activation format): Q4_1, Q5_1 x Q8_1, and Q8_0, Q4_0, Q5_0 x Q8_0.
bool gemv_tiles_support(int type, int act);

// y[r] = dot(W row r, x) for r in [r0, r1). W: rows of `blocks` blocks of `type`, row_bytes apart;
// x: one row of `blocks` blocks of the activation format gemv_tiles_support accepted.
void gemv_tiled_dot(int type, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                    int64_t blocks, float* y);

}  // namespace kvserve
