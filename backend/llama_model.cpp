#include "llama_model.h"

#include <chrono>
#include <cmath>
#include <iostream>

#include "checkpoint.h"
#include "kv_check.h"

namespace kvserve {

namespace {
torch::Tensor maybe_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  return b.defined() ? torch::linear(x, w, b) : torch::linear(x, w);
}
}  // namespace

std::shared_ptr<LlamaModel> LlamaModel::load(const std::string& model_dir, const LoadOptions& opt) {
  auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<LlamaModel> m(new LlamaModel());
  m->model_dir_ = model_dir;
  m->config_ = load_model_config(model_dir);
  const ModelConfig& c = m->config_;
  try {
    m->device_ = torch::Device(opt.device);
  } catch (const std::exception&) {
    KV_FAIL("invalid device '" << opt.device << "' (use cpu, cuda or cuda:N)");
  }
  if (m->device_.is_cuda()) KV_CHECK(torch::cuda::is_available(), "device " << opt.device << " requested but CUDA is not available");
  m->dtype_ = opt.dtype.empty() ? (m->device_.is_cuda() ? torch::kBFloat16 : torch::kFloat32) : dtype_from_name(opt.dtype);

  Checkpoint ckpt(model_dir);
  const int64_t Hd = c.hidden_size, D = c.head_dim, H = c.num_attention_heads, KV = c.num_key_value_heads,
                I = c.intermediate_size, V = c.vocab_size;
  auto load = [&](const std::string& name, std::vector<int64_t> shape) {
    return ckpt.load(name, shape, m->dtype_, m->device_);
  };
  torch::NoGradGuard ng;
  m->embed_ = load("model.embed_tokens.weight", {V, Hd});
  m->final_norm_ = load("model.norm.weight", {Hd});
  if (ckpt.contains("lm_head.weight")) {
    m->lm_head_ = load("lm_head.weight", {V, Hd});
  } else {
    KV_CHECK(c.tie_word_embeddings, model_dir << ": tensor 'lm_head.weight' is missing and tie_word_embeddings is false");
    m->lm_head_ = m->embed_;
  }
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer l;
    l.input_norm = load(p + "input_layernorm.weight", {Hd});
    l.post_norm = load(p + "post_attention_layernorm.weight", {Hd});
    l.wqkv = torch::cat({load(p + "self_attn.q_proj.weight", {H * D, Hd}), load(p + "self_attn.k_proj.weight", {KV * D, Hd}),
                         load(p + "self_attn.v_proj.weight", {KV * D, Hd})});
    if (c.attention_bias) {
      l.bqkv = torch::cat({load(p + "self_attn.q_proj.bias", {H * D}), load(p + "self_attn.k_proj.bias", {KV * D}),
                           load(p + "self_attn.v_proj.bias", {KV * D})});
    }
    l.wo = load(p + "self_attn.o_proj.weight", {Hd, H * D});
    if (c.o_proj_bias) l.bo = load(p + "self_attn.o_proj.bias", {Hd});
    l.wgate_up = torch::cat({load(p + "mlp.gate_proj.weight", {I, Hd}), load(p + "mlp.up_proj.weight", {I, Hd})});
    l.wdown = load(p + "mlp.down_proj.weight", {Hd, I});
    if (c.mlp_bias) {
      l.bgate_up = torch::cat({load(p + "mlp.gate_proj.bias", {I}), load(p + "mlp.up_proj.bias", {I})});
      l.bdown = load(p + "mlp.down_proj.bias", {Hd});
    }
    m->layers_.push_back(std::move(l));
    const int64_t L = c.num_hidden_layers;
    if (opt.progress && L >= 4 && (i + 1) % ((L + 3) / 4) == 0 && i + 1 < L) {
      std::cerr << "kvserve: loading " << model_dir << ": " << (i + 1) << "/" << L << " layers\n";
    }
  }
  m->rope_ = std::make_unique<Rope>(c, m->device_);
  if (opt.progress) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cerr << "kvserve: loaded " << model_dir << " (" << c.architecture << ", " << c.num_hidden_layers
              << " layers, " << ckpt.num_tensors() << " tensors) in " << s << " s\n";
  }
  return m;
}

int64_t LlamaModel::kv_bytes_per_token() const {
  return 2 * config_.num_hidden_layers * config_.num_key_value_heads * config_.head_dim *
         static_cast<int64_t>(c10::elementSize(dtype_));
}

torch::Tensor LlamaModel::rms_norm(const torch::Tensor& x, const torch::Tensor& w) const {
  // As transformers: normalise in fp32, cast back, then scale.
  auto xf = x.to(torch::kFloat32);
  auto var = xf.pow(2).mean(-1, true);
  return w * (xf * torch::rsqrt(var + config_.rms_norm_eps)).to(x.scalar_type());
}

torch::Tensor LlamaModel::mlp(const Layer& l, const torch::Tensor& x) const {
  auto gu = maybe_linear(x, l.wgate_up, l.bgate_up);
  const int64_t I = config_.intermediate_size;
  auto act = torch::silu(gu.narrow(-1, 0, I)) * gu.narrow(-1, I, I);
  return maybe_linear(act, l.wdown, l.bdown);
}

torch::Tensor LlamaModel::lm_head(const torch::Tensor& x) const {
  return torch::linear(rms_norm(x, final_norm_), lm_head_).to(torch::kFloat32);
}

torch::Tensor LlamaModel::prefill(int64_t seq_id, const std::vector<int64_t>& tokens, KvMemory& kv, bool all_logits,
                                  const std::string& policy) {
  torch::NoGradGuard ng;
  const ModelConfig& c = config_;
  const int64_t T = static_cast<int64_t>(tokens.size());
  KV_CHECK(T > 0, "empty prompt");
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
  auto ids = torch::tensor(tokens, torch::kInt64);
  KV_CHECK(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < c.vocab_size,
           "token id out of range [0, " << c.vocab_size << ")");
  ids = ids.to(device_);
  auto positions = torch::arange(T, torch::TensorOptions().dtype(torch::kInt64).device(device_));
  auto x = embed_.index_select(0, ids);  // [T, hidden]
  kv.begin_prefill(seq_id, T, policy);
  for (int64_t li = 0; li < c.num_hidden_layers; ++li) {
    const Layer& l = layers_[li];
    auto qkv = maybe_linear(rms_norm(x, l.input_norm), l.wqkv, l.bqkv);
    auto q = rope_->apply(qkv.narrow(1, 0, H * D).view({T, H, D}), positions).transpose(0, 1).contiguous();
    auto k = rope_->apply(qkv.narrow(1, H * D, KV * D).view({T, KV, D}), positions).transpose(0, 1).contiguous();
    auto v = qkv.narrow(1, (H + KV) * D, KV * D).view({T, KV, D}).transpose(0, 1).contiguous();
    auto attn = at::scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), {}, 0.0,
                                                 /*is_causal=*/true, std::nullopt, /*enable_gqa=*/H != KV);
    kv.store_prefill(seq_id, li, q, k, v);
    x = x + maybe_linear(attn.squeeze(0).transpose(0, 1).reshape({T, H * D}), l.wo, l.bo);
    x = x + mlp(l, rms_norm(x, l.post_norm));
  }
  kv.end_prefill(seq_id);
  return lm_head(all_logits ? x : x.narrow(0, T - 1, 1));
}

torch::Tensor LlamaModel::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, KvMemory& kv) {
  torch::NoGradGuard ng;
  const ModelConfig& c = config_;
  const int64_t B = static_cast<int64_t>(tokens.size());
  KV_CHECK(B > 0 && batch.seq_ids.size() == tokens.size() && batch.positions.size() == tokens.size(),
           "decode batch of " << B << " tokens does not match its sequence list");
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
  auto ids = torch::tensor(tokens, torch::kInt64).to(device_);
  auto positions = torch::tensor(batch.positions, torch::kInt64).to(device_);
  auto x = embed_.index_select(0, ids);  // [B, hidden]
  for (int64_t li = 0; li < c.num_hidden_layers; ++li) {
    const Layer& l = layers_[li];
    auto qkv = maybe_linear(rms_norm(x, l.input_norm), l.wqkv, l.bqkv);
    auto q = rope_->apply(qkv.narrow(1, 0, H * D).view({B, H, D}), positions).contiguous();
    auto k = rope_->apply(qkv.narrow(1, H * D, KV * D).view({B, KV, D}), positions).contiguous();
    auto v = qkv.narrow(1, (H + KV) * D, KV * D).view({B, KV, D}).contiguous();
    auto attn = kv.decode_attention(li, batch, q, k, v);  // [B, H, D]
    x = x + maybe_linear(attn.reshape({B, H * D}), l.wo, l.bo);
    x = x + mlp(l, rms_norm(x, l.post_norm));
  }
  return lm_head(x);
}

}  // namespace kvserve
