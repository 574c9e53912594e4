#pragma once
// Rope: rotary position embedding tables (default, linear, llama3, yarn, dynamic NTK and longrope
// scaling) computed as transformers does.
//
// Length-dependent scalings. transformers recomputes dynamic NTK's and longrope's frequencies in
// every forward from that forward's sequence length (its largest position + 1): dynamic NTK
// stretches the base once the length passes max_position_embeddings, longrope switches from its
// short to its long factors once it passes original_max_position_embeddings. The keys already in
// its cache keep the angles they were rotated with. kvserve does the same per sequence:
// - a prefill (or a prefill chunk) rotates all of a prompt's rows with the frequencies of the
//   prompt's end (prefill_angles), as one transformers forward of that prompt does;
// - a decode step rotates a token at position p with the frequencies of length p + 1, as
//   transformers' generate does step by step (the table's row p).
// So a prompt of 100 tokens under dynamic NTK with max_position_embeddings 64 gets transformers'
// logits, and each token decoded after it the angles transformers' generate gives it; keys cached
// earlier are never re-rotated (neither engine does).
#include <torch/torch.h>

#include <vector>

#include "backend/model/model_config.h"

namespace kvserve {

// The cos/sin rows of one forward's positions in the activations' dtype ([N, 1, D] each): looked up
// once per forward and shared by every layer's q and k.
struct RopeAngles {
  torch::Tensor cos, sin;
};

class Rope {
 public:
  Rope(const ModelConfig& config, torch::Device device);
  // Angles of `positions` [N] (int64, on the tables' device), each as the last position of its
  // sequence (a decode step); `end` is a host-known bound above every position, so that growing the
  // tables never reads the positions back from the device.
  RopeAngles angles(const torch::Tensor& positions, int64_t end, torch::ScalarType dtype);
  // Angles of a prefill's rows: positions [N] holds prompt i's lens[i] rows at starts[i], starts[i] + 1,
  // ... in prompt order; a length-dependent scaling rotates each prompt's rows with the frequencies
  // of its end (starts[i] + lens[i]).
  RopeAngles prefill_angles(const torch::Tensor& positions, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& lens, torch::ScalarType dtype);
  // Grows the tables to hold positions below `end` (host work, before a step that only looks up).
  void reserve(int64_t end) { ensure(end); }
  // Angles of positions already below capacity(): no host work, nothing that can grow the tables
  // (what a captured CUDA graph runs; its tables' storage must stay put).
  RopeAngles lookup(const torch::Tensor& positions, torch::ScalarType dtype) const;
  int64_t capacity() const { return capacity_; }
  // Applies RoPE in place-free form to x [N, heads, D] whose rows sit at the angles' positions.
  static torch::Tensor apply(const torch::Tensor& x, const RopeAngles& a);
  // The frequencies [D/2] (fp32, CPU) of a forward whose sequence is `length` long (its largest
  // position + 1); the same for every length unless the scaling is length-dependent.
  torch::Tensor inv_freq(int64_t length) const;
  // The factor cos and sin are multiplied by (yarn's and longrope's attention factor, else 1).
  double attention_scaling() const { return scaling_.attention_factor; }

 private:
  void ensure(int64_t max_pos);
  // cos and sin of freqs [rows, D/2] (fp32), times the attention factor.
  std::pair<torch::Tensor, torch::Tensor> cos_sin(const torch::Tensor& freqs) const;
  int64_t head_dim_;
  double theta_;
  int64_t max_position_embeddings_;
  RopeScaling scaling_;
  torch::Device device_;
  torch::Tensor inv_freq_;   // [D/2] fp32 on the device: the frequencies of lengths up to the threshold
  int64_t threshold_ = 0;    // length-dependent scalings: lengths above this use other frequencies
  torch::Tensor cos_, sin_;  // [capacity, D] fp32, grown on demand; row p = a decode at position p
  int64_t capacity_ = 0;
};

}  // namespace kvserve
