#include "backend/model/block_ops.h"

#include <cmath>

#include "backend/kernels/fused_ops.h"

namespace kvserve::block_ops {

torch::Tensor norm_weight(const torch::Tensor& w, BlockSpec::Norm norm) {
  return norm == BlockSpec::Norm::kRmsOnePlus ? w.to(torch::kFloat32) + 1.0 : w;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, BlockSpec::Norm norm, double eps) {
  if (norm == BlockSpec::Norm::kRms) return fused::rms_norm(x, w, eps);
  auto xf = x.to(torch::kFloat32);
  auto var = xf.pow(2).mean(-1, true);
  return (xf * torch::rsqrt(var + eps) * w).to(x.scalar_type());
}

torch::Tensor gated_activation(const torch::Tensor& gu, int64_t inter, BlockSpec::Activation act) {
  if (act == BlockSpec::Activation::kSilu) return fused::silu_mul(gu, inter);
  return torch::gelu(gu.narrow(-1, 0, inter), "tanh") * gu.narrow(-1, inter, inter);
}

torch::Tensor scale_embeddings(const torch::Tensor& x, int64_t hidden_size) {
  // transformers keeps the factor as an fp32 tensor and casts it to the weights' dtype: a bf16 model
  // multiplies by sqrt(hidden_size) rounded to bf16.
  const float f = static_cast<float>(std::sqrt(static_cast<double>(hidden_size)));
  return x * torch::scalar_tensor(f, torch::kFloat32).to(x.scalar_type()).to(x.device());
}

double query_factor(const ModelConfig& c) {
  if (c.query_pre_attn_scalar <= 0) return 1.0;
  return std::sqrt(static_cast<double>(c.head_dim) / c.query_pre_attn_scalar);
}

ModelConfig local_rope_config(const ModelConfig& c) {
  ModelConfig l = c;
  l.rope_theta = c.local_rope_theta;
  l.rope_scaling = c.local_rope_scaling;
  return l;
}

}  // namespace kvserve::block_ops
