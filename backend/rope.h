#pragma once
// Rope: rotary position embedding tables (default, linear and llama3 scaling) computed as transformers does.
#include <torch/torch.h>

#include "backend/model_config.h"

namespace kvserve {

class Rope {
 public:
  Rope(const ModelConfig& config, torch::Device device);
  // Applies RoPE in place-free form to x [N, heads, D] whose rows sit at `positions` [N] (int64).
  torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& positions);
  const torch::Tensor& inv_freq() const { return inv_freq_; }

 private:
  void ensure(int64_t max_pos);
  int64_t head_dim_;
  torch::Tensor inv_freq_;  // [D/2] fp32
  torch::Tensor cos_, sin_; // [capacity, D] fp32, grown on demand
  int64_t capacity_ = 0;
};

}  // namespace kvserve
