#pragma once
// Dense (linear) layers: y = x·Wᵀ + b, with a CPU kernel for decode-sized batches.
#include <torch/torch.h>

#include <string>

namespace kvserve {

// Rows up to which dense() takes the small-batch kernel on CPU: decode batches. Longer inputs
// (prefill) amortise MKL's packing of W over many rows and go to torch::linear.
constexpr int64_t kSmallBatchMaxRows = 16;

// Which library multiplies fp32 CPU inputs of more than kSmallBatchMaxRows rows (prefill).
// kMkl is torch::linear, the same sgemm as transformers, so logits stay bitwise equal to it. kOneDnn
// is oneDNN's inner product: ~2x MKL's GFLOP/s on AMD CPUs (where MKL takes a generic path), but a
// different summation order, so logits move by fp32 rounding (docs/benchmarks.md gives figures).
enum class CpuGemm { kMkl, kOneDnn };

// "mkl" / "onednn" (the YAML and CLI names); throws naming the accepted values.
CpuGemm cpu_gemm_from_name(const std::string& name);

// y = x Wᵀ (+ b) for x [M, K], W [N, K], b [N] or undefined. fp32 CPU inputs with
// M <= kSmallBatchMaxRows, or of any M inside a DecodeScope, run small_batch_dense; longer fp32 CPU
// inputs go to `gemm`; everything else is torch::linear. Why: with few rows, MKL's sgemm copies and re-packs all of W on every call
// (over half of a batch-8 decode step in perf), so W crosses the memory bus three times instead of
// once.
torch::Tensor dense(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {},
                    CpuGemm gemm = CpuGemm::kMkl);

// oneDNN's fp32 inner product on CPU (x [.., K], W [N, K] dense, as stored); what dense() runs for
// kOneDnn.
torch::Tensor onednn_dense(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {});

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
