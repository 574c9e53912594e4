#pragma once
// Rope: rotary position embedding tables (default, linear and llama3 scaling) computed as transformers does.
#include <torch/torch.h>

#include "backend/model_config.h"

namespace kvserve {

// The cos/sin rows of one forward's positions in the activations' dtype ([N, 1, D] each): looked up
// once per forward and shared by every layer's q and k.
struct RopeAngles {
  torch::Tensor cos, sin;
};

class Rope {
 public:
  Rope(const ModelConfig& config, torch::Device device);
  // Angles of `positions` [N] (int64, on the tables' device); `end` is a host-known bound above every
  // position, so that growing the tables never reads the positions back from the device.
  RopeAngles angles(const torch::Tensor& positions, int64_t end, torch::ScalarType dtype);
  // Grows the tables to hold positions below `end` (host work, before a step that only looks up).
  void reserve(int64_t end) { ensure(end); }
  // Angles of positions already below capacity(): no host work, nothing that can grow the tables
  // (what a captured CUDA graph runs; its tables' storage must stay put).
  RopeAngles lookup(const torch::Tensor& positions, torch::ScalarType dtype) const;
  int64_t capacity() const { return capacity_; }
  // Applies RoPE in place-free form to x [N, heads, D] whose rows sit at the angles' positions.
  static torch::Tensor apply(const torch::Tensor& x, const RopeAngles& a);
  const torch::Tensor& inv_freq() const { return inv_freq_; }

 private:
  void ensure(int64_t max_pos);
  int64_t head_dim_;
  torch::Tensor inv_freq_;  // [D/2] fp32
  torch::Tensor cos_, sin_; // [capacity, D] fp32, grown on demand
  int64_t capacity_ = 0;
};

}  // namespace kvserve
