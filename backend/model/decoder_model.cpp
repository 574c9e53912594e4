#include "backend/model/decoder_model.h"

#include "backend/kernels/chunk_attention.h"
#include "backend/scoring/after_prefill_selection.h"
#include "cache_manager/kv_block_pool.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "backend/model/checkpoint.h"
#include "backend/kernels/decode_scope.h"
#include "backend/model/weight_source.h"
#include "backend/quantization/fp8_weight.h"
#include "backend/quantization/int4_weight.h"
#include "backend/quantization/quantized_weight.h"
#include "backend/quantization/type_fallback.h"
#include "backend/quantization/weight_quantization.h"
#include "ggml.h"
#include "backend/kernels/dense.h"
#include "backend/kernels/fused_ops.h"
#include "backend/model/block_ops.h"
#include "backend/kernels/sliding_window_attention.h"
#include "common/check.h"
#include "common/log.h"
#include "parallel/communicator.h"

namespace kvserve {

std::shared_ptr<DecoderModel> DecoderModel::load(const std::string& model_dir, const LoadOptions& opt) {
  auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<DecoderModel> m(new DecoderModel());
  m->model_dir_ = model_dir;
  m->config_ = read_model_config(model_dir);
  const ModelConfig& c = m->config_;
  try {
    m->device_ = torch::Device(opt.device);
  } catch (const std::exception&) {
    KV_FAIL("invalid device '" << opt.device << "' (use cpu, cuda or cuda:N)");
  }
  if (m->device_.is_cuda()) KV_CHECK(torch::cuda::is_available(), "device " << opt.device << " requested but CUDA is not available");
  m->dtype_ = opt.dtype.empty() ? (m->device_.is_cuda() ? torch::kBFloat16 : torch::kFloat32) : dtype_from_name(opt.dtype);
  m->gemm_ = opt.cpu_gemm;
  const auto source = WeightSource::open(model_dir, c);
  // A GGUF file served on the CPU keeps its KV in float16 unless told otherwise, as llama.cpp does
  // (-ctk/-ctv f16): its weights are already quantized, float16 K/V measure as exact as float32 on
  // the default model, and the cache is half the bytes.
  const bool gguf_on_cpu = source->format() == "gguf" && m->device_.is_cpu() && m->dtype_ == torch::kFloat32;
  const bool kv_auto = opt.kv_cache_dtype.empty() || opt.kv_cache_dtype == "auto";
  m->kv_dtype_ = gguf_on_cpu && kv_auto ? torch::kFloat16 : kv_cache_dtype_from_name(opt.kv_cache_dtype, m->dtype_);
  m->kv_quant_ = kv_cache_quant_from_name(opt.kv_cache_dtype);
  check_kv_quant_head_dim(m->kv_quant_, c.head_dim, "KV cache dtype '" + opt.kv_cache_dtype + "'");
  // The CUDA decode kernels read K/V in q's dtype; a narrower CUDA cache would need them to widen.
  KV_CHECK(!m->device_.is_cuda() || m->kv_dtype_ == m->dtype_,
           "KV cache dtype " << dtype_name(m->kv_dtype_) << " differs from the compute dtype " << dtype_name(m->dtype_)
                             << " on " << opt.device << ": CUDA pools take only the compute dtype (use kv_cache_dtype "
                             << "auto, or set the model dtype to " << dtype_name(m->kv_dtype_) << ")");
  m->layout_ = opt.layout.num_layers_total > 0 ? opt.layout : make_shard_layout(model_shape(c), 1, 0, 1, 0);
  const ShardLayout& s = m->layout_;
  KV_CHECK(s.num_layers_total == c.num_hidden_layers, model_dir << ": shard layout is for " << s.num_layers_total
                                                                << " layers, the model has " << c.num_hidden_layers);
  if (s.tp_size > 1) {
    KV_CHECK(opt.tp_group && opt.tp_group->size() == s.tp_size && opt.tp_group->rank() == s.tp_rank,
             "internal: tensor parallel size " << s.tp_size << " needs its process group");
    m->tp_ = opt.tp_group;
  }

  // On a CUDA device int4 is Int4Weight (tinygemm) and int8 Int8Weight, not ggml blocks (those run
  // on the CPU only).
  const bool int4_cuda = m->device_.is_cuda() && weight_quantization_is_int4(opt.quantization);
  const bool int8_cuda = m->device_.is_cuda() && weight_quantization_is_int8(opt.quantization);
  const int quant_type = int4_cuda || int8_cuda ? -1 : weight_quantization_ggml_type(opt.quantization);
  const bool fp8 = weight_quantization_is_fp8(opt.quantization);
  KV_CHECK((quant_type < 0 && !fp8 && !int4_cuda && !int8_cuda) || source->format() == "safetensors",
           "quantization " << opt.quantization << ": " << model_dir << " is a GGUF file, served in the blocks it ships; "
                           << "quantization applies to float checkpoints");
  KV_CHECK(quant_type < 0 || m->device_.is_cpu(),
           "quantization " << opt.quantization << " on " << opt.device << ": ggml block types run on the CPU only; "
                           << "on CUDA use fp8 (compute capability 8.9+), int8 or int4 (tinygemm, 8.0+)");
  // A GPU the kernel does not run on (or a layout mismatch) fails here, not at the first request.
  try {
    if (int4_cuda) Int4Weight::check_device(m->device_);
    if (int8_cuda) Int8Weight::check_device(m->device_);
  } catch (const std::exception& e) {
    KV_FAIL("quantization " << opt.quantization << " on " << opt.device << ": " << e.what());
  }
  KV_CHECK(quant_type < 0 || m->dtype_ == torch::kFloat32,
           "quantization " << opt.quantization << " needs the float32 compute dtype on the CPU, got " << dtype_name(m->dtype_));
  const int64_t Hd = c.hidden_size, D = c.head_dim, H = c.num_attention_heads, KV = c.num_key_value_heads,
                I = c.intermediate_size, V = c.vocab_size;
  // Each rank reads only its rows (column-parallel, vocab-parallel) or columns (row-parallel).
  auto load = [&](const std::string& name, std::vector<int64_t> shape, std::optional<TensorSlice> slice = std::nullopt) {
    return source->load(name, shape, m->dtype_, m->device_, slice);
  };
  // A linear layer's weight; quantized at load when asked (the fused projections are quantized
  // after they are stacked: rows are quantized independently).
  // fp8: a weight whose dimensions _scaled_mm cannot tile (not multiples of 16) stays dense.
  // int4 on CUDA: one whose rows are not a multiple of 8 or columns of 32 stays dense; int8 on CUDA:
  // one whose columns are not a multiple of 32.
  int64_t fp8_dense = 0, int4_dense = 0, int8_dense = 0;
  // A ggml type whose blocks do not fit a weight's rows: how many weights took which other type
  // (quant_type_for_cols; -1: stayed dense).
  std::map<int, int64_t> fallbacks;
  auto quantized = [&](LinearWeight w, const std::string& what) {
    if (fp8 && !w.quantized() && !w.is_fp8()) {
      if (Fp8Weight::fits(w.rows(), w.cols())) return LinearWeight(Fp8Weight::quantize(w.dense, what));
      ++fp8_dense;
      return w;
    }
    if (int4_cuda && w.dense.defined()) {
      if (Int4Weight::fits(w.rows(), w.cols())) return LinearWeight(Int4Weight::quantize(w.dense, what));
      ++int4_dense;
      return w;
    }
    if (int8_cuda && w.dense.defined()) {
      if (Int8Weight::fits(w.rows(), w.cols())) return LinearWeight(Int8Weight::quantize(w.dense, what));
      ++int8_dense;
      return w;
    }
    if (quant_type < 0 || w.quantized()) return w;
    const int type = quant_type_for_cols(quant_type, w.cols());
    if (type != quant_type) ++fallbacks[type];
    if (type < 0) return w;
    return LinearWeight(QuantizedWeight::quantize(w.dense, type, what));
  };
  auto linear_w = [&](const std::string& name, std::vector<int64_t> shape, std::optional<TensorSlice> slice = std::nullopt) {
    return source->load_linear(name, shape, m->dtype_, m->device_, slice);
  };
  auto rows = [](int64_t start, int64_t len) { return TensorSlice{0, start, len}; };
  auto cols = [](int64_t start, int64_t len) { return TensorSlice{1, start, len}; };
  auto vocab_rows = [&](const std::string& name) {
    LinearWeight w = linear_w(name, {V, Hd}, rows(s.vocab_begin, s.vocab_len));
    if (s.vocab_len < s.vocab_per_rank) {  // the last rank's padding rows produce logits that are dropped
      const auto pad = torch::zeros({s.vocab_per_rank - s.vocab_len, Hd}, torch::TensorOptions().dtype(m->dtype_).device(m->device_));
      w = w.quantized() ? LinearWeight(QuantizedWeight::stack({*w.quant, QuantizedWeight::quantize(pad, GGML_TYPE_Q8_0, name)}))
                        : LinearWeight::stack({w, LinearWeight(pad)});
    }
    return w;
  };
  const bool whole_vocab = s.tp_size == 1;
  torch::NoGradGuard ng;
  // The embedding stays as the file stores it (a lookup reads a few rows) unless it is tied to the
  // LM head; the LM head, a linear layer, is quantized with the others (Q8_0 for every choice: its
  // logits matter most).
  const int lm_head_type = quant_type >= 0 && quant_type != GGML_TYPE_Q8_0 ? GGML_TYPE_Q8_0 : quant_type;
  auto lm_head_quantized = [&](LinearWeight w) {
    if (lm_head_type < 0 || w.quantized()) return w;
    return LinearWeight(QuantizedWeight::quantize(w.dense, lm_head_type, "lm_head"));
  };
  if (s.first_stage()) m->embed_ = whole_vocab ? linear_w("model.embed_tokens.weight", {V, Hd}) : vocab_rows("model.embed_tokens.weight");
  auto norm = [&](const std::string& name, int64_t n) { return block_ops::norm_weight(load(name, {n}), c.block.norm); };
  if (s.last_stage()) {
    m->final_norm_ = norm("model.norm.weight", Hd);
    if (source->contains("lm_head.weight")) {
      m->lm_head_ = lm_head_quantized(whole_vocab ? linear_w("lm_head.weight", {V, Hd}) : vocab_rows("lm_head.weight"));
    } else {
      KV_CHECK(c.tie_word_embeddings, model_dir << ": tensor 'lm_head.weight' is missing and tie_word_embeddings is false");
      m->lm_head_ = lm_head_quantized(m->embed_.defined() ? m->embed_
                                                          : (whole_vocab ? linear_w("model.embed_tokens.weight", {V, Hd})
                                                                         : vocab_rows("model.embed_tokens.weight")));
      // Tied: the lookup reads the LM head's blocks too, one copy of the matrix.
      if (m->embed_.defined()) m->embed_ = m->lm_head_;
    }
  }
  const auto q_rows = rows(s.q_head_begin * D, s.q_heads * D), kv_rows = rows(s.kv_head_begin * D, s.kv_heads * D);
  const auto mlp_rows = rows(s.inter_begin, s.inter_len);
  for (int64_t i = s.layer_begin; i < s.layer_end; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer l;
    l.input_norm = norm(p + "input_layernorm.weight", Hd);
    if (c.block.sandwich_norms) {  // post_attention_layernorm then normalises the attention output; the MLP has its own
      l.attn_out_norm = norm(p + "post_attention_layernorm.weight", Hd);
      l.post_norm = norm(p + "pre_feedforward_layernorm.weight", Hd);
      l.mlp_out_norm = norm(p + "post_feedforward_layernorm.weight", Hd);
    } else {
      l.post_norm = norm(p + "post_attention_layernorm.weight", Hd);
    }
    l.wqkv = quantized(LinearWeight::stack({linear_w(p + "self_attn.q_proj.weight", {H * D, Hd}, q_rows),
                                            linear_w(p + "self_attn.k_proj.weight", {KV * D, Hd}, kv_rows),
                                            linear_w(p + "self_attn.v_proj.weight", {KV * D, Hd}, kv_rows)},
                                           m->dtype_),
                       p + "qkv");
    if (c.attention_bias) {
      l.bqkv = torch::cat({load(p + "self_attn.q_proj.bias", {H * D}, q_rows), load(p + "self_attn.k_proj.bias", {KV * D}, kv_rows),
                           load(p + "self_attn.v_proj.bias", {KV * D}, kv_rows)});
    }
    if (c.block.qk_norm) {  // per head_dim, so every TP rank holds them whole
      l.q_norm = norm(p + "self_attn.q_norm.weight", D);
      l.k_norm = norm(p + "self_attn.k_norm.weight", D);
    }
    l.wo = quantized(linear_w(p + "self_attn.o_proj.weight", {Hd, H * D}, cols(s.q_head_begin * D, s.q_heads * D)),
                     p + "self_attn.o_proj.weight");
    if (c.o_proj_bias) l.bo = load(p + "self_attn.o_proj.bias", {Hd});
    l.wgate_up = quantized(LinearWeight::stack({linear_w(p + "mlp.gate_proj.weight", {I, Hd}, mlp_rows),
                                                linear_w(p + "mlp.up_proj.weight", {I, Hd}, mlp_rows)},
                                               m->dtype_),
                           p + "gate_up");
    l.wdown = quantized(linear_w(p + "mlp.down_proj.weight", {Hd, I}, cols(s.inter_begin, s.inter_len)), p + "mlp.down_proj.weight");
    if (c.mlp_bias) {
      l.bgate_up = torch::cat({load(p + "mlp.gate_proj.bias", {I}, mlp_rows), load(p + "mlp.up_proj.bias", {I}, mlp_rows)});
      l.bdown = load(p + "mlp.down_proj.bias", {Hd});
    }
    m->layers_.push_back(std::move(l));
    const int64_t L = s.num_layers(), done = i + 1 - s.layer_begin;
    if (opt.progress && L >= 4 && done % ((L + 3) / 4) == 0 && done < L) {
      KV_LOG("loading " << model_dir << ": " << done << "/" << L << " layers");
    }
  }
  if (const std::string types = source->dequantized_types(); !types.empty())
    KV_LOG(model_dir << ": its " << types << " linear tensors are dequantized to " << dtype_name(m->dtype_) << " on "
                     << m->device_ << " (kvserve's CUDA kernels keep only Q8_0 blocks as codes), so they take "
                     << c10::elementSize(m->dtype_) * 8 << " bits a weight there; on the CPU they run as they ship");
  for (const auto& [type, n] : fallbacks)
    KV_LOG("quantization " << opt.quantization << ": " << n << " linear weights of " << model_dir
                           << " have rows that are not whole " << quant_type_name(quant_type) << " blocks and are "
                           << (type < 0 ? dtype_name(m->dtype_) : quant_type_name(type))
                           << (type < 0 ? "" : " (llama-quantize's fallback)"));
  if (int4_cuda && int4_dense > 0)
    KV_LOG("quantization int4: " << int4_dense << " linear weights of " << model_dir
                                 << " have rows that are not a multiple of 8 or columns not of 32 and stay " << dtype_name(m->dtype_));
  if (int8_cuda && int8_dense > 0)
    KV_LOG("quantization int8: " << int8_dense << " linear weights of " << model_dir
                                 << " have columns that are not a multiple of 32 and stay " << dtype_name(m->dtype_));
  if (fp8) {
    if (fp8_dense > 0)
      KV_LOG("quantization fp8: " << fp8_dense << " linear weights of " << model_dir
                                  << " have a dimension that is not a multiple of 16 and stay " << dtype_name(m->dtype_));
    if (m->device_.is_cpu()) {
      KV_LOG("quantization fp8 on the CPU runs libtorch's reference fp8 products, slower than float32 (fp8 is for "
             "GPUs of compute capability 8.9+; on the CPU use int8 or int4)");
    } else {
      // A GPU without fp8 products says so now, not at the first request.
      try {
        Fp8Weight::quantize(torch::ones({16, 16}, torch::TensorOptions().device(m->device_)), "probe")
            .matmul(torch::ones({1, 16}, torch::TensorOptions().dtype(m->dtype_).device(m->device_)));
      } catch (const std::exception& e) {
        KV_FAIL("quantization fp8 on " << opt.device << ": this device has no fp8 matrix products (compute capability "
                                       << "8.9+ is needed): " << e.what());
      }
    }
  }
  // Every storage format the linear layers use, in order of first use ("q5_0+q8_0+q4_K+q6_K").
  std::vector<std::string> formats;
  auto note_format = [&](const LinearWeight& w) {
    if (!w.defined()) return;
    std::string f = w.format();
    for (size_t start = 0; start <= f.size();) {
      const size_t end = std::min(f.find('+', start), f.size());
      const std::string one = f.substr(start, end - start);
      if (std::find(formats.begin(), formats.end(), one) == formats.end()) formats.push_back(one);
      start = end + 1;
    }
  };
  for (const Layer& l : m->layers_)
    for (const LinearWeight* w : {&l.wqkv, &l.wo, &l.wgate_up, &l.wdown}) note_format(*w);
  note_format(m->lm_head_);
  note_format(m->embed_);
  for (const std::string& f : formats) m->weight_format_ += (m->weight_format_.empty() ? "" : "+") + f;
  m->rope_ = std::make_unique<Rope>(c, m->device_);
  if (c.has_local_layers()) m->local_rope_ = std::make_unique<Rope>(block_ops::local_rope_config(c), m->device_);
  m->q_factor_ = block_ops::query_factor(c);
  if (opt.progress) {
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    KV_LOG("loaded " << model_dir << " (" << c.architecture << ", " << c.num_hidden_layers << " layers, "
              << source->num_tensors() << " tensors, weights " << m->weight_format_
              << (s.whole() ? "" : "; " + s.describe()) << ") in " << secs << " s");
  }
  return m;
}

int64_t DecoderModel::weight_bytes() const {
  int64_t n = final_norm_.defined() ? static_cast<int64_t>(final_norm_.nbytes()) : 0;
  if (embed_.defined()) n += embed_.bytes();
  if (lm_head_.defined() && !(lm_head_.quant && lm_head_.quant == embed_.quant) && !(lm_head_.int8 && lm_head_.int8 == embed_.int8) &&
      !(lm_head_.dense.defined() && embed_.dense.defined() && lm_head_.dense.is_same(embed_.dense)))
    n += lm_head_.bytes();
  for (const Layer& l : layers_) {
    n += l.wqkv.bytes() + l.wo.bytes() + l.wgate_up.bytes() + l.wdown.bytes();
    for (const torch::Tensor* t : {&l.input_norm, &l.post_norm, &l.attn_out_norm, &l.mlp_out_norm, &l.bqkv, &l.q_norm, &l.k_norm,
                                   &l.bo, &l.bgate_up, &l.bdown})
      if (t->defined()) n += static_cast<int64_t>(t->nbytes());
  }
  return n;
}

int64_t DecoderModel::kv_bytes_per_token() const {
  return 2 * layout_.num_layers() * layout_.kv_heads * KvBlockPool::row_bytes(config_.head_dim, kv_dtype_, kv_quant_);
}

KvMemoryLayout DecoderModel::kv_layout() const { return layout_in(kv_dtype_, kv_quant_); }

KvMemoryLayout DecoderModel::kv_layout(const std::string& kv_cache_dtype) const {
  if (kv_cache_dtype.empty()) return kv_layout();
  const std::string what = "kv_dtype '" + kv_cache_dtype + "'";
  const torch::Dtype dtype = kv_cache_dtype_from_name(kv_cache_dtype, dtype_);
  const KvQuant quant = kv_cache_quant_from_name(kv_cache_dtype);
  check_kv_quant_head_dim(quant, config_.head_dim, what);
  KV_CHECK(!device_.is_cuda() || dtype == dtype_, what << ": CUDA pools take only the compute dtype "
                                                       << dtype_name(dtype_) << " or a quantized format");
  return layout_in(dtype, quant);
}

KvFormats DecoderModel::kv_formats(const std::map<std::string, PolicyConfig>& policies) const {
  KvFormats f;
  f.base = kv_layout();
  for (const auto& [name, cfg] : policies) {
    if (cfg.kv_dtype.empty() || f.by_dtype.count(cfg.kv_dtype)) continue;
    try {
      f.by_dtype.emplace(cfg.kv_dtype, kv_layout(cfg.kv_dtype));
    } catch (const std::exception& e) {
      KV_FAIL("policy '" << name << "': " << e.what());
    }
  }
  return f;
}

KvMemoryLayout DecoderModel::layout_in(torch::Dtype kv, KvQuant quant) const {
  KvMemoryLayout l;
  l.num_layers = layout_.num_layers();
  l.first_layer = layout_.layer_begin;
  l.total_layers = config_.num_hidden_layers;
  l.num_kv_heads = layout_.kv_heads;
  l.head_dim = config_.head_dim;
  l.dtype = kv;
  l.quant = quant;
  l.device = device_;
  l.rounds = kv != dtype_ || quant != KvQuant::none;
  l.model_token_layer_bytes = 2 * config_.num_key_value_heads * KvBlockPool::row_bytes(config_.head_dim, kv, quant);
  if (config_.has_local_layers()) {
    for (int64_t li = layout_.layer_begin; li < layout_.layer_end; ++li) l.layer_windows.push_back(config_.layer_window(li));
    for (int64_t li = 0; li < config_.num_hidden_layers; ++li)
      if (config_.layer_window(li) > 0) l.local_layers.push_back(li);
  }
  // Cached prefix blocks are valid only for K/V computed the same way: the weights (the model
  // directory), the arithmetic (dtypes, GEMM backend), RoPE and this shard's slice of the model.
  std::ostringstream what;
  what << model_dir_ << '|' << config_.architecture << '|' << config_.num_hidden_layers << '|' << config_.hidden_size << '|'
       << config_.num_key_value_heads << '|' << config_.head_dim << '|' << config_.rope_theta << '|'
       << static_cast<int>(config_.rope_scaling.kind) << '|' << config_.rope_scaling.factor << '|'
       << config_.local_rope_theta << '|' << q_factor_ << '|' << dtype_name(dtype_)
       << '|' << kv_cache_dtype_label(kv, quant) << '|' << static_cast<int>(gemm_) << '|' << device_.str() << '|'
       << weight_format_ << '|'
       << layout_.describe();
  l.kv_salt = std::hash<std::string>{}(what.str());
  return l;
}

torch::Tensor DecoderModel::rms_norm(const torch::Tensor& x, const torch::Tensor& w) const {
  return block_ops::rms_norm(x, w, config_.block.norm, config_.rms_norm_eps);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> DecoderModel::rotated_qkv(const Layer& l, const torch::Tensor& qkv,
                                                                                const RopeAngles& angles) const {
  const int64_t N = qkv.size(0), H = layout_.q_heads, KV = layout_.kv_heads, D = config_.head_dim;
  if (!l.q_norm.defined() && q_factor_ == 1.0) return fused::rope_qkv(qkv, angles, H, KV, D);
  auto q = qkv.narrow(1, 0, H * D).view({N, H, D});
  auto k = qkv.narrow(1, H * D, KV * D).view({N, KV, D});
  if (l.q_norm.defined()) {  // BlockSpec::qk_norm: each head normalised over head_dim before its rotation
    q = rms_norm(q, l.q_norm);
    k = rms_norm(k, l.k_norm);
  }
  auto rq = Rope::apply(q, angles);
  // The kernels scale by 1/sqrt(head_dim); a query_pre_attn_scalar goes into q instead, so that
  // every attention path (prefill, chunks, paged decode, the policies' scorers) sees the same logits.
  if (q_factor_ != 1.0) rq = rq * q_factor_;
  return {rq, Rope::apply(k, angles), qkv.narrow(1, (H + KV) * D, KV * D).view({N, KV, D})};
}

torch::Tensor DecoderModel::add_norm(torch::Tensor& x, torch::Tensor& pending, const torch::Tensor& w) const {
  if (!pending.defined()) return rms_norm(x, w);
  const torch::Tensor delta = std::exchange(pending, torch::Tensor());
  if (config_.block.norm != BlockSpec::Norm::kRms) {  // fused::add_rms_norm computes Llama's norm only
    x = x + delta;
    return rms_norm(x, w);
  }
  auto [sum, normed] = fused::add_rms_norm(x, delta, w, config_.rms_norm_eps);
  x = sum;
  return normed;
}

void DecoderModel::check_windows(const KvMemory& kv) const {
  for (int64_t li = layout_.layer_begin; li < layout_.layer_end; ++li) {
    KV_CHECK(kv.layer_window(li) == config_.layer_window(li),
             "internal: the KV memory applies window " << kv.layer_window(li) << " to layer " << li << ", the model "
                                                       << config_.layer_window(li)
                                                       << " (build it from kv_layout(), which carries the windows)");
  }
}

torch::Tensor DecoderModel::out_norm(const torch::Tensor& t, const torch::Tensor& w) const {
  return w.defined() ? rms_norm(t, w) : t;
}

torch::Tensor DecoderModel::row_parallel(const torch::Tensor& x, const LinearWeight& w, const torch::Tensor& b) const {
  return tp_ ? reduce_partial(linear(x, w, {}, gemm_), b) : linear(x, w, b, gemm_);
}

torch::Tensor DecoderModel::reduce_partial(torch::Tensor partial, const torch::Tensor& b) const {
  partial = partial.contiguous();
  tp_->all_reduce_sum(partial);
  return b.defined() ? partial + b : partial;
}

torch::Tensor DecoderModel::mlp(const Layer& l, const torch::Tensor& x) const {
  const int64_t I = layout_.inter_len, T = x.size(0);
  // Long prompts run in row chunks: the [rows, 2I] gate/up activations of a whole prompt would be
  // hundreds of MB, past glibc's mmap threshold (fresh pages, zeroed, on every layer) and far past
  // the caches; per-row results do not depend on the chunking.
  constexpr int64_t kRowChunk = 512;
  // This shard's down projection of some rows (under TP a partial sum, reduced once below).
  auto down = [&](const torch::Tensor& rows) {
    auto gu = linear(rows, l.wgate_up, l.bgate_up, gemm_);
    auto act = block_ops::gated_activation(gu, I, config_.block.activation);
    return tp_ ? linear(act, l.wdown, {}, gemm_) : linear(act, l.wdown, l.bdown, gemm_);
  };
  torch::Tensor out;
  if (T <= kRowChunk) {
    out = down(x);
  } else {
    out = torch::empty({T, l.wdown.rows()}, x.options());
    for (int64_t s = 0; s < T; s += kRowChunk) {
      const int64_t n = std::min(kRowChunk, T - s);
      out.narrow(0, s, n).copy_(down(x.narrow(0, s, n)));
    }
  }
  return tp_ ? reduce_partial(out, l.bdown) : out;
}

const DecoderModel::Layer& DecoderModel::layer(int64_t global) const {
  KV_CHECK(layout_.owns_layer(global), "internal: layer " << global << " is not on this shard (" << layout_.describe() << ")");
  return layers_[static_cast<size_t>(global - layout_.layer_begin)];
}

torch::Tensor DecoderModel::embed(const std::vector<int64_t>& tokens) const {
  KV_CHECK(layout_.first_stage(), "internal: the embedding lives on the first pipeline stage");
  auto ids = torch::tensor(tokens, torch::kInt64);
  KV_CHECK(ids.numel() > 0, "empty token list");
  KV_CHECK(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < config_.vocab_size,
           "token id out of range [0, " << config_.vocab_size << ")");
  return embed_ids(ids.to(device_));
}

torch::Tensor DecoderModel::embed_ids(const torch::Tensor& ids) const {
  auto x = tp_ ? embed_ids_parallel(ids) : embed_.lookup(ids, dtype_);
  // Scaled after the vocab-parallel sum under TP: the same rows.
  return config_.block.scaled_embeddings ? block_ops::scale_embeddings(x, config_.hidden_size) : x;
}

torch::Tensor DecoderModel::embed_ids_parallel(const torch::Tensor& ids) const {
  // Vocab-parallel: each rank looks up the ids in its rows, zeros elsewhere; the sum is the lookup.
  auto local = ids - layout_.vocab_begin;
  auto mine = (local >= 0) & (local < layout_.vocab_len);
  auto x = embed_.lookup(local.clamp(0, layout_.vocab_per_rank - 1), dtype_) * mine.unsqueeze(1).to(dtype_);
  x = x.contiguous();
  tp_->all_reduce_sum(x);
  return x;
}

torch::Tensor DecoderModel::logits(const torch::Tensor& x) const {
  KV_CHECK(layout_.last_stage(), "internal: the LM head lives on the last pipeline stage");
  auto local = linear(rms_norm(x, final_norm_), lm_head_, {}, gemm_).to(torch::kFloat32);
  if (!tp_) return local;
  auto all = tp_->all_gather(local.transpose(0, 1).contiguous());  // [tp * vocab_per_rank, rows]
  return all.narrow(0, 0, config_.vocab_size).transpose(0, 1).contiguous();
}

torch::Tensor DecoderModel::prefill_layers(int64_t seq_id, torch::Tensor x, KvMemory& kv, int64_t start, int64_t prompt_len) {
  const int64_t T = x.size(0);
  return prefill_layers_batch({seq_id}, {T}, std::move(x), kv, {start}, {prompt_len > 0 ? prompt_len : start + T});
}

torch::Tensor DecoderModel::prefill_layers_batch(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& lens,
                                               torch::Tensor x, KvMemory& kv, const std::vector<int64_t>& starts_in,
                                               const std::vector<int64_t>& prompt_lens) {
  torch::NoGradGuard ng;
  const int64_t N = x.size(0), n = static_cast<int64_t>(seq_ids.size());
  KV_CHECK(n > 0 && lens.size() == seq_ids.size(), "internal: prefill of " << n << " sequences with " << lens.size() << " lengths");
  const std::vector<int64_t> starts = starts_in.empty() ? std::vector<int64_t>(seq_ids.size(), 0) : starts_in;
  KV_CHECK(starts.size() == seq_ids.size() && (prompt_lens.empty() || prompt_lens.size() == seq_ids.size()),
           "internal: prefill of " << n << " sequences with " << starts.size() << " starts");
  std::vector<int64_t> offsets;
  std::vector<char> chunk(seq_ids.size());  // goes through store_prefill_chunk
  int64_t rows = 0;
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t T = lens[i];
    KV_CHECK(T > 0, "empty prompt");
    KV_CHECK(starts[i] >= 0, "internal: chunk start " << starts[i]);
    chunk[i] = starts[i] > 0 || (!prompt_lens.empty() && prompt_lens[i] != T);
    offsets.push_back(rows);
    rows += T;
  }
  KV_CHECK(rows == N, "internal: prompts of " << rows << " tokens in total, hidden states of " << N << " rows");
  const int64_t H = layout_.q_heads, KV = layout_.kv_heads, D = config_.head_dim;
  const auto i64 = torch::TensorOptions().dtype(torch::kInt64);
  torch::Tensor positions;
  if (n == 1) {
    positions = torch::arange(starts[0], starts[0] + N, i64.device(device_));
  } else {
    std::vector<int64_t> pos;
    pos.reserve(static_cast<size_t>(N));
    for (size_t i = 0; i < lens.size(); ++i)
      for (int64_t t = 0; t < lens[i]; ++t) pos.push_back(starts[i] + t);
    positions = torch::tensor(pos, i64).to(device_);
  }
  const RopeAngles angles = rope_->prefill_angles(positions, starts, lens, x.scalar_type());
  const RopeAngles local_angles =
      local_rope_ ? local_rope_->prefill_angles(positions, starts, lens, x.scalar_type()) : RopeAngles{};
  check_windows(kv);
  // kvzap: the prompts (run whole here) whose policy predicts its scores from each layer's input.
  std::vector<const PolicyConfig*> predicted(seq_ids.size(), nullptr);
  bool predicts = false;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    const PolicyConfig* p = chunk[i] ? nullptr : kv.prefill_policy(seq_ids[i]);
    if (p && p->scorer == ScorerKind::kPredicted) predicted[i] = p, predicts = true;
  }
  // Each residual add waits in `pending` for the norm after it (add_norm).
  torch::Tensor pending;
  for (int64_t li = layout_.layer_begin; li < layout_.layer_end; ++li) {
    check_cancelled();
    const Layer& l = layer(li);
    const int64_t window = config_.layer_window(li);
    auto h = add_norm(x, pending, l.input_norm);
    if (predicts) record_predicted_scores(li, h, predicted, seq_ids, offsets, lens, kv);
    auto qkv = linear(h, l.wqkv, l.bqkv, gemm_);
    auto [q_all, k_all, v_all] = rotated_qkv(l, qkv, layer_angles(li, angles, local_angles));
    // Attention per prompt: a block-diagonal mask over all rows would compute (sum T)^2 scores
    // instead of sum T^2, and the policies want each sequence's own q/k/v anyway.
    torch::Tensor attn = n == 1 ? torch::Tensor() : torch::empty({N, H * D}, x.options());
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = offsets[static_cast<size_t>(i)], T = lens[static_cast<size_t>(i)];
      auto q = q_all.narrow(0, s, T).transpose(0, 1).contiguous();  // [H, T, D]
      auto k = k_all.narrow(0, s, T).transpose(0, 1).contiguous();
      auto v = v_all.narrow(0, s, T).transpose(0, 1).contiguous();
      const int64_t start = starts[static_cast<size_t>(i)];
      // What later reads of this prompt's K/V will find (KvMemory::as_stored): its own attention reads the same.
      const torch::Tensor ka = kv.as_stored(seq_ids[static_cast<size_t>(i)], k);
      const torch::Tensor va = kv.as_stored(seq_ids[static_cast<size_t>(i)], v);
      torch::Tensor a;
      if (window > 0 && start == 0) {
        a = sliding_window_attention(q, ka, va, 0, 0, window).unsqueeze(0);
      } else if (start == 0) {
        a = at::scaled_dot_product_attention(q.unsqueeze(0), ka.unsqueeze(0), va.unsqueeze(0), {}, 0.0,
                                             /*is_causal=*/true, std::nullopt, /*enable_gqa=*/H != KV);
      } else if (window > 0) {
        // A local layer is never compressed: what it holds are the `held` positions right before the chunk.
        const EarlierKv ctx = kv.prefill_context(seq_ids[static_cast<size_t>(i)], li);
        const int64_t held = ctx.k.size(1);
        KV_CHECK(held <= start, "internal: chunk at " << start << " finds " << held << " earlier positions in layer " << li);
        KV_CHECK(ctx.head_lengths.empty(), "internal: a sliding-window layer " << li << " holds heads of different lengths");
        a = sliding_window_attention(q, torch::cat({ctx.k.to(k.scalar_type()), ka}, 1),
                                     torch::cat({ctx.v.to(v.scalar_type()), va}, 1),
                                     start, start - held, window)
                .unsqueeze(0);
      } else {
        const EarlierKv ctx = kv.prefill_context(seq_ids[static_cast<size_t>(i)], li);
        const int64_t held = ctx.k.size(1);
        KV_CHECK(held <= start, "internal: chunk at " << start << " of sequence " << seq_ids[static_cast<size_t>(i)]
                                                      << " finds " << held << " earlier positions in layer " << li);
        // A resumed conversation or a compressed context holds only the kept positions before the
        // chunk: all visible.
        a = chunk_attention(q, ctx.k.to(k.scalar_type()), ctx.v.to(v.scalar_type()), ka, va, ctx.head_lengths).unsqueeze(0);
      }
      if (chunk[static_cast<size_t>(i)]) {
        kv.store_prefill_chunk(seq_ids[static_cast<size_t>(i)], li, start, q, k, v);
      } else {
        kv.store_prefill(seq_ids[static_cast<size_t>(i)], li, q, k, v);
      }
      auto rows_out = a.squeeze(0).transpose(0, 1).reshape({T, H * D});
      if (n == 1) {
        attn = rows_out;
      } else {
        attn.narrow(0, s, T).copy_(rows_out);
      }
    }
    pending = out_norm(row_parallel(attn, l.wo, l.bo), l.attn_out_norm);
    pending = out_norm(mlp(l, add_norm(x, pending, l.post_norm)), l.mlp_out_norm);
  }
  if (pending.defined()) x = x + pending;
  return x;
}

torch::Tensor DecoderModel::detached_layers(torch::Tensor x, int64_t start, const ContextKv& context,
                                          const LayerQkHook& hook) {
  torch::NoGradGuard ng;
  const int64_t n = x.size(0);
  KV_CHECK(n > 0 && start >= 0, "internal: detached pass of " << n << " tokens at " << start);
  const int64_t H = layout_.q_heads, KV = layout_.kv_heads, D = config_.head_dim;
  const auto positions = torch::arange(start, start + n, torch::TensorOptions().dtype(torch::kInt64).device(device_));
  const RopeAngles angles = rope_->prefill_angles(positions, {start}, {n}, x.scalar_type());
  const RopeAngles local_angles =
      local_rope_ ? local_rope_->prefill_angles(positions, {start}, {n}, x.scalar_type()) : RopeAngles{};
  torch::Tensor pending;  // the residual add deferred into the next norm (add_norm)
  for (int64_t li = layout_.layer_begin; li < layout_.layer_end; ++li) {
    check_cancelled();
    const Layer& l = layer(li);
    const int64_t window = config_.layer_window(li);
    auto qkv = linear(add_norm(x, pending, l.input_norm), l.wqkv, l.bqkv, gemm_);
    auto [q_all, k_all, v_all] = rotated_qkv(l, qkv, layer_angles(li, angles, local_angles));
    auto q = q_all.transpose(0, 1).contiguous();  // [H, n, D]
    auto k = k_all.transpose(0, 1).contiguous();  // [KV, n, D]
    hook(li, q, k);
    if (li + 1 == layout_.num_layers_total) return {};
    auto v = v_all.transpose(0, 1).contiguous();
    auto [pk, pv] = context(li);
    torch::Tensor a;
    if (window > 0) {
      // A local layer sees the last `window` positions: the context's held positions end right
      // before `start`, and no query reaches further back than start - window.
      const int64_t held = std::min<int64_t>(pk.size(1), window);
      a = sliding_window_attention(q, torch::cat({pk.narrow(1, pk.size(1) - held, held).to(k.scalar_type()), k}, 1),
                                   torch::cat({pv.narrow(1, pv.size(1) - held, held).to(v.scalar_type()), v}, 1), start,
                                   start - held, window);
    } else if (pk.size(1) == 0) {
      a = at::scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), {}, 0.0,
                                           /*is_causal=*/true, std::nullopt, /*enable_gqa=*/H != KV)
              .squeeze(0);
    } else {
      a = chunk_attention(q, pk.to(k.scalar_type()), pv.to(v.scalar_type()), k, v);
    }
    pending = out_norm(row_parallel(a.transpose(0, 1).reshape({n, H * D}), l.wo, l.bo), l.attn_out_norm);
    pending = out_norm(mlp(l, add_norm(x, pending, l.post_norm)), l.mlp_out_norm);
  }
  if (pending.defined()) x = x + pending;
  return x;
}

torch::Tensor DecoderModel::decode_layers(const DecodeBatch& batch, torch::Tensor x, KvMemory& kv) {
  torch::NoGradGuard ng;
  const int64_t B = x.size(0);
  KV_CHECK(B > 0 && static_cast<int64_t>(batch.seq_ids.size()) == B && static_cast<int64_t>(batch.positions.size()) == B,
           "decode batch of " << B << " tokens does not match its sequence list");
  // The step's bookkeeping happens here, once: the KV memory takes every layer's blocks and sends its
  // tables over, the RoPE rows are looked up; the layer loop below then never waits for the host.
  check_windows(kv);
  kv.begin_decode(batch);
  const int64_t end = *std::max_element(batch.positions.begin(), batch.positions.end()) + 1;
  const auto pos = torch::tensor(batch.positions, torch::kInt64).to(device_);
  const RopeAngles angles = rope_->angles(pos, end, x.scalar_type());
  const RopeAngles local_angles = local_rope_ ? local_rope_->angles(pos, end, x.scalar_type()) : RopeAngles{};
  return run_decode_layers(batch, std::move(x), angles, local_angles, kv);
}

torch::Tensor DecoderModel::run_decode_layers(const DecodeBatch& batch, torch::Tensor x, const RopeAngles& angles,
                                            const RopeAngles& local_angles, KvMemory& kv) {
  const int64_t B = x.size(0);  // the step's entries, padding included
  const int64_t H = layout_.q_heads, D = config_.head_dim;
  StepProfile* p = profile_;
  const DecodeScope decoding;
  // Each residual add waits in `pending` for the norm after it (add_norm); the last one is added
  // after the loop.
  torch::Tensor pending;
  for (int64_t li = layout_.layer_begin; li < layout_.layer_end; ++li) {
    const Layer& l = layer(li);
    auto h = StepProfile::time(p, StepProfile::kNorm, [&] { return add_norm(x, pending, l.input_norm); });
    auto qkv = StepProfile::time(p, StepProfile::kQkv, [&] { return linear(h, l.wqkv, l.bqkv, gemm_); });
    auto [q, k, v] = StepProfile::time(p, StepProfile::kRope, [&] {
      auto [rq, rk, rv] = rotated_qkv(l, qkv, layer_angles(li, angles, local_angles));
      return std::tuple{rq.contiguous(), rk.contiguous(), rv.contiguous()};
    });
    auto attn = StepProfile::time(p, StepProfile::kAttention, [&] { return kv.decode_attention(li, batch, q, k, v); });  // [B, H, D]
    pending = StepProfile::time(p, StepProfile::kOProj, [&] { return out_norm(row_parallel(attn.reshape({B, H * D}), l.wo, l.bo), l.attn_out_norm); });
    h = StepProfile::time(p, StepProfile::kNorm, [&] { return add_norm(x, pending, l.post_norm); });
    pending = StepProfile::time(p, StepProfile::kMlp, [&] { return out_norm(mlp(l, h), l.mlp_out_norm); });
  }
  if (pending.defined()) x = StepProfile::time(p, StepProfile::kResidual, [&] { return x + pending; });
  return x;
}

const KvzapPredictor& DecoderModel::kvzap_predictor(const PolicyConfig& cfg) {
  const std::string dir = kvzap_predictor_dir(cfg, model_dir_);
  auto it = kvzap_predictors_.find(dir);
  if (it == kvzap_predictors_.end()) {
    const KvzapShape shape{config_.hidden_size, config_.num_key_value_heads, config_.num_hidden_layers};
    it = kvzap_predictors_.emplace(dir, std::make_unique<KvzapPredictor>(dir, shape, dtype_, device_)).first;
  }
  return *it->second;
}

void DecoderModel::record_predicted_scores(int64_t li, const torch::Tensor& h, const std::vector<const PolicyConfig*>& predicted,
                                           const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& offsets,
                                           const std::vector<int64_t>& lens, KvMemory& kv) {
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    if (!predicted[i]) continue;
    // Every KV head of the model is predicted; this shard keeps its own heads' rows.
    auto s = kvzap_predictor(*predicted[i]).scores(li, h.narrow(0, offsets[i], lens[i]));  // [T, all KV]
    s = s.narrow(1, layout_.kv_head_begin, layout_.kv_heads).t().contiguous();
    kv.record_scores(seq_ids[i], li, 0, s);
  }
}

torch::Tensor DecoderModel::prefill(int64_t seq_id, const std::vector<int64_t>& tokens, KvMemory& kv, bool all_logits,
                                  const std::string& policy) {
  return prefill_batch({PrefillInput{seq_id, tokens, policy}}, kv, all_logits);
}

void DecoderModel::check_cancelled() const {
  if (!cancel_check_ || prefilling_.empty() || !cancel_check_(prefilling_)) return;
  throw PrefillCancelled(prefilling_.front());
}

torch::Tensor DecoderModel::prefill_batch(const std::vector<PrefillInput>& seqs_in, KvMemory& kv, bool all_logits) {
  torch::NoGradGuard ng;
  KV_CHECK(layout_.pp_size == 1, "internal: DecoderModel::prefill runs a whole pipeline; use the sharded executor");
  KV_CHECK(!seqs_in.empty(), "internal: empty prefill batch");
  for (const auto& s : seqs_in) {
    KV_CHECK(!s.tokens.empty(), "empty prompt");
    KV_CHECK(s.start >= 0 && s.start + static_cast<int64_t>(s.tokens.size()) <= s.total(),
             "internal: chunk [" << s.start << ", " << s.start + static_cast<int64_t>(s.tokens.size())
                                 << ") outside a prompt of " << s.total() << " tokens");
  }
  // What runs: a prompt whose first blocks the memory holds from its prefix cache starts after them.
  std::vector<PrefillInput> seqs = seqs_in;
  std::vector<int64_t> ids, lens, tokens, starts, totals;
  torch::Tensor x;
  // Which sequences hold KV state that a failure must free: those begun here, and every chunk that
  // continues a prompt (its earlier chunks' KV is useless without this one).
  std::vector<char> owned(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) owned[i] = seqs[i].start > 0;
  prefilling_.clear();
  for (const auto& s : seqs) prefilling_.push_back(s.seq_id);
  struct Clear {
    std::vector<int64_t>& ids;
    ~Clear() { ids.clear(); }
  } clear{prefilling_};
  try {
    for (auto& s : seqs) {
      KV_CHECK(std::all_of(s.tokens.begin(), s.tokens.end(), [&](int64_t t) { return t >= 0 && t < config_.vocab_size; }),
               "token id out of range [0, " << config_.vocab_size << ")");
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      PrefillInput& s = seqs[i];
      if (s.start == 0 && s.context_len > 0) {
        // The context first, on its own: taken compressed from the memory's cache, or prefilled and
        // compressed here; the rest of the prompt then runs below as a chunk after it.
        KV_CHECK(!all_logits, "internal: every position's logits asked of a prompt with a compressed context");
        owned[i] = 1;
        const int64_t c = compress_context(s, kv);
        s.tokens = s.tokens.subspan(static_cast<size_t>(c));
        s.start = c;
        if (s.prompt_len == 0) s.prompt_len = static_cast<int64_t>(seqs_in[i].tokens.size());
        continue;
      }
      if (s.start == 0) {
        kv.begin_prefill(s.seq_id, s.total(), s.policy);
        owned[i] = 1;
      }
      KV_CHECK(!all_logits || s.resume.seq_id < 0, "internal: every position's logits asked of a resumed prompt");
      // Every position's logits are asked for: nothing may come from the cache.
      const int64_t hit = kv.prefill_tokens(s.seq_id, s.start, s.tokens,
                                            s.reuse_prefix && !all_logits ? s.total() : KvMemory::kNoLookup, s.keep_copy,
                                            s.resume);
      if (hit > 0) {
        s.tokens = s.tokens.subspan(static_cast<size_t>(hit));
        s.start = hit;
        if (s.prompt_len == 0) s.prompt_len = static_cast<int64_t>(seqs_in[i].tokens.size());
      }
    }
    for (const auto& s : seqs) {
      ids.push_back(s.seq_id);
      lens.push_back(static_cast<int64_t>(s.tokens.size()));
      starts.push_back(s.start);
      totals.push_back(s.total());
      tokens.insert(tokens.end(), s.tokens.begin(), s.tokens.end());
    }
    x = embed(tokens);  // [sum T, hidden]
    x = prefill_layers_batch(ids, lens, x, kv, starts, totals);
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (!seqs[i].last_chunk()) continue;
      // A reconstruction scorer (kvzip) runs its passes over the whole prompt's K/V, a predicted one
      // (kvzap) has its scores; then the selection.
      if (const PolicyConfig* cfg = kv.pending_selection(ids[i])) {
        KV_CHECK(seqs_in[i].start == 0 && static_cast<int64_t>(seqs_in[i].tokens.size()) == seqs_in[i].total(),
                 "internal: policy '" << cfg->name << "' scores by reconstruction and needs its prompt prefilled whole");
        select_after_prefill(*this, kv, ids[i], seqs_in[i].tokens, *cfg);
      }
      kv.end_prefill(ids[i]);
    }
  } catch (...) {
    // A half-written sequence would hold blocks until the engine releases it a step later, and a
    // retry of the same sequence (one by one after a failed batch) needs it gone.
    for (size_t i = 0; i < seqs.size(); ++i) {
      if (!owned[i]) continue;
      try {
        kv.release(seqs[i].seq_id);
      } catch (const std::exception& e) {
        KV_LOG("releasing sequence " << seqs[i].seq_id << " after a failed prefill: " << e.what());
      }
    }
    throw;
  }
  if (all_logits) return logits(x);
  const int64_t N = x.size(0);
  if (seqs.size() == 1) return logits(x.narrow(0, N - 1, 1));
  std::vector<int64_t> last;
  int64_t end = 0;
  for (int64_t T : lens) last.push_back((end += T) - 1);
  return logits(x.index_select(0, torch::tensor(last, torch::kInt64).to(device_)));
}

int64_t DecoderModel::compress_context(const PrefillInput& s, KvMemory& kv) {
  const int64_t c = s.context_len, n = s.total();
  KV_CHECK(s.start == 0 && c > 0 && c < n && static_cast<int64_t>(s.tokens.size()) == n,
           "internal: a context of " << c << " tokens in a prompt of " << n << " runs with the whole prompt");
  const auto context = s.tokens.first(static_cast<size_t>(c));
  kv.begin_prefill(s.seq_id, c, s.policy);
  // The lookup always runs: a hit takes less than the context's prefill, which admission reserved.
  if (kv.begin_context(s.seq_id, context, n, /*lookup=*/true) == c) return c;
  // Not cached: the context is prefilled as a prompt of its own, so that it keeps what it would
  // keep alone (full-precision prefix-cache blocks may still serve part of it).
  const int64_t hit = kv.prefill_tokens(s.seq_id, 0, context, s.reuse_prefix ? c : KvMemory::kNoLookup, s.keep_copy);
  const auto rest = context.subspan(static_cast<size_t>(hit));
  const int64_t T = static_cast<int64_t>(rest.size());
  prefill_layers_batch({s.seq_id}, {T}, embed(std::vector<int64_t>(rest.begin(), rest.end())), kv, {hit}, {c});
  if (const PolicyConfig* cfg = kv.pending_selection(s.seq_id)) select_after_prefill(*this, kv, s.seq_id, context, *cfg);
  kv.end_prefill(s.seq_id);
  kv.continue_prompt(s.seq_id);
  return c;
}

void DecoderModel::plan_decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, KvMemory& kv,
                             int64_t padded_rows) {
  KV_CHECK(layout_.pp_size == 1, "internal: DecoderModel::decode runs a whole pipeline; use the sharded executor");
  const int64_t B = static_cast<int64_t>(tokens.size());
  KV_CHECK(B > 0 && batch.seq_ids.size() == tokens.size() && batch.positions.size() == tokens.size(),
           "decode batch of " << tokens.size() << " tokens does not match its sequence list");
  for (int64_t t : tokens) KV_CHECK(t >= 0 && t < config_.vocab_size, "token id out of range [0, " << config_.vocab_size << ")");
  check_windows(kv);
  kv.begin_decode(batch, padded_rows);
  rope_->reserve(*std::max_element(batch.positions.begin(), batch.positions.end()) + 1);
  if (local_rope_) local_rope_->reserve(*std::max_element(batch.positions.begin(), batch.positions.end()) + 1);
}

torch::Tensor DecoderModel::decode_planned(const DecodeBatch& batch, const torch::Tensor& ids, const torch::Tensor& positions,
                                         KvMemory& kv) {
  torch::NoGradGuard ng;
  KV_CHECK(ids.dim() == 1 && positions.sizes() == ids.sizes() && ids.size(0) >= static_cast<int64_t>(batch.seq_ids.size()),
           "decode: ids " << ids.sizes() << " and positions " << positions.sizes() << " for a batch of "
                          << batch.seq_ids.size());
  StepProfile* p = profile_;
  const DecodeScope decoding;  // the LM head too
  auto x = StepProfile::time(p, StepProfile::kEmbed, [&] { return embed_ids(ids); });
  x = run_decode_layers(batch, x, rope_->lookup(positions, x.scalar_type()),
                        local_rope_ ? local_rope_->lookup(positions, x.scalar_type()) : RopeAngles{}, kv);
  auto out = StepProfile::time(p, StepProfile::kLogits, [&] { return logits(x); });
  if (p) ++p->steps;
  return out;
}

torch::Tensor DecoderModel::decode(const DecodeBatch& batch, const std::vector<int64_t>& tokens, KvMemory& kv,
                                 int64_t padded_rows) {
  torch::NoGradGuard ng;
  plan_decode(batch, tokens, kv, padded_rows);
  const int64_t B = static_cast<int64_t>(tokens.size()), P = std::max(B, padded_rows);
  std::vector<int64_t> ids = tokens, pos = batch.positions;
  ids.resize(static_cast<size_t>(P), 0);
  pos.resize(static_cast<size_t>(P), 0);
  auto out = decode_planned(batch, torch::tensor(ids, torch::kInt64).to(device_), torch::tensor(pos, torch::kInt64).to(device_), kv);
  return P > B ? out.narrow(0, 0, B) : out;
}

}  // namespace kvserve
