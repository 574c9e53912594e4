#pragma once
// Gemma 3 (Gemma3ForCausalLM, text): what its decoder block does differently from Llama's, as
// transformers' modeling_gemma3.py computes it. LlamaModel runs the shared skeleton (fused QKV,
// RoPE, paged KV, TP/PP) and calls these where ModelConfig::gemma is set:
//  - embeddings times sqrt(hidden_size), that factor rounded to the model's dtype first;
//  - RMSNorm with (1 + w), normalised and scaled in fp32, cast at the end (Llama casts before
//    scaling), on the input, after attention, before and after the MLP, the final norm, and per
//    q / k head before RoPE;
//  - GeGLU: gelu(gate, tanh approximation) * up;
//  - attention logits scaled by query_pre_attn_scalar^-0.5 instead of head_dim^-0.5;
//  - local (sliding-window) layers with their own RoPE base (ModelConfig::layer_windows,
//    local_rope_theta), global layers with rope_theta and its scaling.
#include <torch/torch.h>

#include "backend/model_config.h"

namespace kvserve::gemma3 {

// The norm weight as the norm uses it: 1 + w in fp32 (kept fp32 so that a bf16 model still scales
// in fp32 as transformers does).
torch::Tensor norm_weight(const torch::Tensor& w);
// x * rsqrt(mean(x^2) + eps) * w1 in fp32, cast to x's dtype; w1 from norm_weight.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w1, double eps);
// gu [rows, 2 * inter] = gate | up → gelu_tanh(gate) * up [rows, inter].
torch::Tensor gelu_tanh_mul(const torch::Tensor& gu, int64_t inter);
// Embedding rows times sqrt(hidden_size) (an fp32 scalar cast to the rows' dtype, as transformers).
torch::Tensor scale_embeddings(const torch::Tensor& x, int64_t hidden_size);
// What q is multiplied by after RoPE so that the attention kernels' 1/sqrt(head_dim) gives
// query_pre_attn_scalar^-0.5 (1 when they agree, as in Gemma 3 270M).
double query_factor(const ModelConfig& c);
// The config the local layers' RoPE tables are built from: the local base, unscaled unless the
// config scales the local layers too.
ModelConfig local_rope_config(const ModelConfig& c);

}  // namespace kvserve::gemma3
