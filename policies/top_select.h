#pragma once
// Deterministic per-head top-n selection: highest score first, ties broken by lower position.
#include <cstdint>

#include <torch/torch.h>

namespace kvserve {

// Positions of the `n` highest scores per row of `scores` [rows, N], ties to the lower position,
// returned sorted ascending as int64 [rows, n] on the scores' device. 0 <= n <= N.
torch::Tensor stable_top_positions(const torch::Tensor& scores, int64_t n);

// Row-wise order of `scores` [rows, N] by (score descending, position ascending): int64 [rows, n]
// holding the first n positions of that order (not re-sorted by position).
torch::Tensor stable_rank_order(const torch::Tensor& scores, int64_t n);

// [rows, count] int64 tensor whose every row is start, start+1, ..., start+count-1.
torch::Tensor position_range(int64_t rows, int64_t start, int64_t count, const torch::Device& device);

}  // namespace kvserve
