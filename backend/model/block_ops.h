#pragma once
// The variants a family's BlockSpec chooses among (backend/model/model_config.h), as the decoder
// skeleton applies them: norms, the gated MLP's activation, embedding scale, the attention scale
// and the local layers' RoPE.
#include <torch/torch.h>

#include "backend/model/model_config.h"

namespace kvserve::block_ops {

// A norm weight as the norm uses it: w for kRms; 1 + w in fp32 for kRmsOnePlus (kept fp32 so that a
// bf16 model still scales in fp32, as transformers does for Gemma).
torch::Tensor norm_weight(const torch::Tensor& w, BlockSpec::Norm norm);
// RMSNorm of x over its last dimension with a weight from norm_weight.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, BlockSpec::Norm norm, double eps);
// gu [rows, 2 * inter] = gate | up → act(gate) * up [rows, inter].
torch::Tensor gated_activation(const torch::Tensor& gu, int64_t inter, BlockSpec::Activation act);
// Embedding rows times sqrt(hidden_size) (an fp32 scalar cast to the rows' dtype, as transformers).
torch::Tensor scale_embeddings(const torch::Tensor& x, int64_t hidden_size);
// What q is multiplied by after RoPE so that the attention kernels' 1/sqrt(head_dim) gives
// query_pre_attn_scalar^-0.5 (1 when it is unset or equals head_dim, as in Gemma 3 270M).
double query_factor(const ModelConfig& c);
// The config the local layers' RoPE tables are built from: their base and scaling.
ModelConfig local_rope_config(const ModelConfig& c);

}  // namespace kvserve::block_ops
