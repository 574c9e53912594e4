#pragma once
// Dense (linear) layers: y = x·Wᵀ + b, with a CPU kernel for decode-sized batches.
#include <torch/torch.h>

namespace kvserve {

// Rows up to which dense() takes the small-batch kernel on CPU: decode batches. Longer inputs
// (prefill) amortise MKL's packing of W over many rows and go to torch::linear.
constexpr int64_t kSmallBatchMaxRows = 16;

// y = x Wᵀ (+ b) for x [M, K], W [N, K], b [N] or undefined. fp32 CPU inputs with
// M <= kSmallBatchMaxRows run small_batch_dense; everything else is torch::linear. Why: with few
// rows, MKL's sgemm copies and re-packs all of W on every call (over half of a batch-8 decode step
// in perf), so W crosses the memory bus three times instead of once.
torch::Tensor dense(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {});

// The small-batch kernel on its own (fp32 CPU, any M; W and b contiguous): every row of W is read
// from memory once for all rows of x, each output is one dot product in a fixed order, so a row's
// result does not depend on which other rows share the batch. Falls back to torch::linear where
// the build has no AVX2/FMA.
torch::Tensor small_batch_dense(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {});

// Threads a parallel region of the dense kernels really gets: at::parallel_for is an inline
// `#pragma omp parallel`, so without -fopenmp on dense.cpp it is 1 whatever at::get_num_threads()
// says (kept as a test's guard: the kernels once ran on one thread unnoticed).
int64_t dense_parallel_width();

}  // namespace kvserve
