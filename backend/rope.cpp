#include "backend/rope.h"

#include <cmath>

namespace kvserve {

Rope::Rope(const ModelConfig& c, torch::Device device) : head_dim_(c.head_dim) {
  // Same op sequence as transformers' rope init so the fp32 tables match bit for bit.
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  auto exponent = torch::arange(0, c.head_dim, 2, torch::TensorOptions().dtype(torch::kInt64)).to(torch::kFloat32) /
                  static_cast<double>(c.head_dim);
  torch::Tensor inv = 1.0 / torch::pow(c.rope_theta, exponent);
  const auto& s = c.rope_scaling;
  if (s.kind == RopeScaling::Kind::kLinear) {
    inv = inv / s.factor;
  } else if (s.kind == RopeScaling::Kind::kLlama3) {
    const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
    const double low_wavelen = old_ctx / s.low_freq_factor;
    const double high_wavelen = old_ctx / s.high_freq_factor;
    auto wavelen = 2 * M_PI / inv;
    auto llama = torch::where(wavelen > low_wavelen, inv / s.factor, inv);
    auto smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    auto smoothed = (1 - smooth) * llama / s.factor + smooth * llama;
    auto medium = torch::logical_not(wavelen < high_wavelen).logical_and(torch::logical_not(wavelen > low_wavelen));
    inv = torch::where(medium, smoothed, llama);
  }
  inv_freq_ = inv.to(f32).to(device);
  ensure(std::min<int64_t>(c.max_position_embeddings, 4096));
}

void Rope::ensure(int64_t max_pos) {
  if (max_pos <= capacity_) return;
  const int64_t cap = std::max(max_pos, capacity_ * 2);
  auto pos = torch::arange(cap, inv_freq_.options());
  auto freqs = torch::outer(pos, inv_freq_);  // [cap, D/2]
  auto emb = torch::cat({freqs, freqs}, -1);
  cos_ = emb.cos();
  sin_ = emb.sin();
  capacity_ = cap;
}

RopeAngles Rope::angles(const torch::Tensor& positions, int64_t end, torch::ScalarType dtype) {
  ensure(end);
  return lookup(positions, dtype);
}

RopeAngles Rope::lookup(const torch::Tensor& positions, torch::ScalarType dtype) const {
  return {cos_.index_select(0, positions).to(dtype).unsqueeze(1), sin_.index_select(0, positions).to(dtype).unsqueeze(1)};
}

torch::Tensor Rope::apply(const torch::Tensor& x, const RopeAngles& a) {
  const int64_t half = x.size(-1) / 2;
  auto x1 = x.narrow(-1, 0, half);
  auto x2 = x.narrow(-1, half, half);
  auto rotated = torch::cat({-x2, x1}, -1);
  return x * a.cos + rotated * a.sin;
}

}  // namespace kvserve
