#include "backend/model/rope.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/check.h"

namespace kvserve {

namespace {

const auto kF32 = torch::TensorOptions().dtype(torch::kFloat32);

}  // namespace

Rope::Rope(const ModelConfig& c, torch::Device device)
    : head_dim_(c.head_dim), theta_(c.rope_theta), max_position_embeddings_(c.max_position_embeddings),
      scaling_(c.rope_scaling), device_(device) {
  switch (scaling_.kind) {
    case RopeScaling::Kind::kDynamic: threshold_ = max_position_embeddings_; break;
    case RopeScaling::Kind::kLongRope: threshold_ = scaling_.original_max_position_embeddings; break;
    default: threshold_ = std::numeric_limits<int64_t>::max();
  }
  inv_freq_ = inv_freq(1).to(device);
  ensure(std::min<int64_t>(c.max_position_embeddings, 4096));
}

torch::Tensor Rope::inv_freq(int64_t length) const {
  // The same op sequence as transformers' rope init functions (modeling_rope_utils.py), on fp32
  // CPU tensors, so that the tables match its tables bit for bit.
  const int64_t D = head_dim_;
  const auto& s = scaling_;
  auto exponent = torch::arange(0, D, 2, torch::TensorOptions().dtype(torch::kInt64)).to(torch::kFloat32) /
                  static_cast<double>(D);
  switch (s.kind) {
    case RopeScaling::Kind::kDefault: return 1.0 / torch::pow(theta_, exponent);
    case RopeScaling::Kind::kLinear: return 1.0 / torch::pow(theta_, exponent) / s.factor;
    case RopeScaling::Kind::kLlama3: {
      torch::Tensor inv = 1.0 / torch::pow(theta_, exponent);
      const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
      const double low_wavelen = old_ctx / s.low_freq_factor;
      const double high_wavelen = old_ctx / s.high_freq_factor;
      auto wavelen = 2 * M_PI / inv;
      auto llama = torch::where(wavelen > low_wavelen, inv / s.factor, inv);
      auto smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      auto smoothed = (1 - smooth) * llama / s.factor + smooth * llama;
      auto medium = torch::logical_not(wavelen < high_wavelen).logical_and(torch::logical_not(wavelen > low_wavelen));
      return torch::where(medium, smoothed, llama);
    }
    case RopeScaling::Kind::kYarn: {
      // Dimensions that turn more than beta_fast times over the original context keep their
      // frequency (extrapolation), those turning fewer than beta_slow times are divided by the
      // factor (interpolation), a linear ramp blends the ones between.
      auto pos_freqs = torch::pow(theta_, exponent);
      auto extrapolation = 1.0 / pos_freqs;
      auto interpolation = 1.0 / (s.factor * pos_freqs);
      const double orig = static_cast<double>(s.original_max_position_embeddings);
      auto correction_dim = [&](double rotations) {
        return (static_cast<double>(D) * std::log(orig / (rotations * 2 * M_PI))) / (2 * std::log(theta_));
      };
      double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
      if (s.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(D - 1));
      if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
      auto ramp = torch::clamp((torch::arange(D / 2, kF32) - low) / (high - low), 0, 1);
      auto extrapolation_factor = 1 - ramp;
      return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
    }
    case RopeScaling::Kind::kDynamic: {
      if (length <= max_position_embeddings_) {
        // transformers' init (and every forward that stays within the context) computes the base
        // in Python floats from seq_len = max_position_embeddings: theta itself up to rounding.
        const double mp = static_cast<double>(max_position_embeddings_);
        const double base = theta_ * std::pow((s.factor * mp / mp) - (s.factor - 1),
                                              static_cast<double>(D) / static_cast<double>(D - 2));
        return 1.0 / torch::pow(base, exponent);
      }
      // Past it, transformers computes the base from the sequence length as a 0-dim tensor (fp32).
      auto seq_len = torch::scalar_tensor(length, torch::TensorOptions().dtype(torch::kInt64));
      auto base = ((seq_len * s.factor) / max_position_embeddings_ - (s.factor - 1))
                      .pow(static_cast<double>(D) / static_cast<double>(D - 2)) * theta_;
      return 1.0 / torch::pow(base, exponent);
    }
    case RopeScaling::Kind::kLongRope: {
      const auto& factors = length > s.original_max_position_embeddings ? s.long_factor : s.short_factor;
      auto ext = torch::tensor(factors, torch::TensorOptions().dtype(torch::kFloat64)).to(torch::kFloat32);
      return 1.0 / (ext * torch::pow(theta_, exponent));
    }
  }
  KV_FAIL("internal: unknown rope scaling kind " << static_cast<int>(s.kind));
}

std::pair<torch::Tensor, torch::Tensor> Rope::cos_sin(const torch::Tensor& freqs) const {
  auto emb = torch::cat({freqs, freqs}, -1);
  auto cos = emb.cos(), sin = emb.sin();
  if (scaling_.attention_factor != 1.0) {  // yarn / longrope: transformers scales cos and sin in fp32
    cos = cos * scaling_.attention_factor;
    sin = sin * scaling_.attention_factor;
  }
  return {cos, sin};
}

void Rope::ensure(int64_t max_pos) {
  if (max_pos <= capacity_) return;
  const int64_t cap = std::max(max_pos, capacity_ * 2);
  // Row p is position p as the last token of its forward (a decode step): length p + 1.
  const int64_t plain = std::min(cap, threshold_);
  torch::Tensor freqs = torch::outer(torch::arange(plain, inv_freq_.options()), inv_freq_);  // [rows, D/2]
  if (cap > plain) {
    torch::Tensor inv;  // [cap - plain, D/2] on the CPU
    if (scaling_.kind == RopeScaling::Kind::kLongRope) {
      inv = inv_freq(threshold_ + 1).unsqueeze(0).expand({cap - plain, head_dim_ / 2});
    } else {
      // Dynamic NTK: every row has its own base. Computed row by row with transformers' 0-dim ops
      // (a vectorised pow may round differently); the rows past the context are built once, as the
      // table doubles.
      inv = torch::empty({cap - plain, head_dim_ / 2}, kF32);
      for (int64_t p = plain; p < cap; ++p) inv[p - plain].copy_(inv_freq(p + 1));
    }
    auto pos = torch::arange(plain, cap, kF32).unsqueeze(1);
    freqs = torch::cat({freqs, (pos * inv).to(device_)});
  }
  std::tie(cos_, sin_) = cos_sin(freqs);
  capacity_ = cap;
}

RopeAngles Rope::angles(const torch::Tensor& positions, int64_t end, torch::ScalarType dtype) {
  ensure(end);
  return lookup(positions, dtype);
}

RopeAngles Rope::prefill_angles(const torch::Tensor& positions, const std::vector<int64_t>& starts,
                                const std::vector<int64_t>& lens, torch::ScalarType dtype) {
  KV_CHECK(starts.size() == lens.size() && !lens.empty(), "internal: rope angles of " << lens.size() << " prompts with "
                                                                                       << starts.size() << " starts");
  int64_t end = 0;
  bool own = false;  // some prompt ends past the threshold: its rows need their own frequencies
  for (size_t i = 0; i < lens.size(); ++i) {
    end = std::max(end, starts[i] + lens[i]);
    own = own || starts[i] + lens[i] > threshold_;
  }
  if (!own) return angles(positions, end, dtype);
  // Rows of prompts that stay within the threshold read the table (their lengths' frequencies are
  // the plain ones); a longer prompt's rows all take the frequencies of its end.
  ensure(std::min(end, threshold_));
  std::vector<torch::Tensor> cos, sin;
  int64_t row = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t prompt_end = starts[i] + lens[i];
    auto rows = positions.narrow(0, row, lens[i]);
    row += lens[i];
    if (prompt_end <= threshold_) {
      RopeAngles a = lookup(rows, dtype);
      cos.push_back(a.cos);
      sin.push_back(a.sin);
      continue;
    }
    auto freqs = torch::outer(torch::arange(starts[i], prompt_end, kF32).to(device_), inv_freq(prompt_end).to(device_));
    auto [c, s] = cos_sin(freqs);
    cos.push_back(c.to(dtype).unsqueeze(1));
    sin.push_back(s.to(dtype).unsqueeze(1));
  }
  KV_CHECK(row == positions.size(0), "internal: " << row << " rope rows for " << positions.size(0) << " positions");
  if (cos.size() == 1) return {cos[0], sin[0]};
  return {torch::cat(cos), torch::cat(sin)};
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
