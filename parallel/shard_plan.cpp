#include "parallel/shard_plan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/check.h"
#include "policies/budget_allocator.h"
#include "policies/prefill_selector.h"

namespace kvserve::parallel {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void set_kv_dtype(PlanOptions& o, const std::string& kv) {
  // The quantized KV caches (cache_manager/kv_quant.h): bits per value, scale bytes per 32 values.
  o.kv_quant_bits = o.kv_quant_scale_bytes = 0;
  if (kv == "int8" || kv == "q8_0" || kv == "fp8" || kv == "fp8_e4m3") {
    o.kv_quant_bits = 8, o.kv_quant_scale_bytes = 2;
  } else if (kv == "int4" || kv == "q4_0") {
    o.kv_quant_bits = 4, o.kv_quant_scale_bytes = 2;
  } else if (kv == "q4_1") {
    o.kv_quant_bits = 4, o.kv_quant_scale_bytes = 4;
  }
  if (o.kv_quant_bits > 0) {
    o.kv_dtype_bytes = 1;
  } else if (kv == "bfloat16" || kv == "bf16" || kv == "float16" || kv == "fp16" || kv == "half") {
    o.kv_dtype_bytes = 2;
  } else if (kv == "float32" || kv == "fp32" || kv == "float") {
    o.kv_dtype_bytes = 4;
  } else if (kv == "fp8_e5m2" || kv == "float8") {
    o.kv_dtype_bytes = 1;
  } else {
    KV_FAIL("unknown KV cache dtype '" << kv << "' (bfloat16, float16, float32, fp8, int8, int4, q4_1)");
  }
}

int64_t kv_row_bytes(const PlanOptions& o, int64_t head_dim) {
  return o.kv_quant_bits > 0 ? head_dim * o.kv_quant_bits / 8 + (head_dim + 31) / 32 * o.kv_quant_scale_bytes
                             : head_dim * o.kv_dtype_bytes;
}

int64_t stage_weight_params(const ModelShape& m, int64_t tp, const LayerRange& layers, bool first_stage,
                            bool last_stage) {
  const int64_t h = m.hidden_size, d = m.head_dim;
  // TP rank 0 holds the most where a split is uneven (MLP columns; vocabulary rows are padded).
  const ShardLayout r0 = make_shard_layout(m, tp, 0, 1, 0);
  const int64_t q_heads = r0.q_heads, kv = r0.kv_heads, inter = r0.inter_len;
  int64_t layer = 0;
  layer += h * q_heads * d;            // q_proj (column-parallel)
  layer += 2 * h * kv * d;             // k_proj, v_proj (column-parallel, replicated when KV < tp)
  layer += q_heads * d * h;            // o_proj (row-parallel)
  layer += 3 * h * inter;              // gate, up (column-parallel), down (row-parallel)
  layer += 2 * h;                      // input + post-attention RMSNorm (replicated)
  if (m.attention_bias) layer += (q_heads + 2 * kv) * d;
  if (m.o_proj_bias) layer += h;       // added once after the all-reduce; every rank holds it
  if (m.mlp_bias) layer += 2 * inter + h;
  if (m.qk_norm) layer += 2 * d;       // q_norm, k_norm (replicated)
  int64_t p = layer * layers.size();
  const int64_t vocab_rows = r0.vocab_per_rank;
  if (first_stage) p += vocab_rows * h;          // vocab-parallel embedding
  if (last_stage) {
    p += h;                                      // final norm
    if (!(m.tie_word_embeddings && first_stage)) p += vocab_rows * h;  // LM head (shared when tied on one stage)
  }
  return p;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> policy_kept_tokens(const PolicyConfig& cfg, int64_t context,
                                                                         int64_t num_layers, int64_t num_kv_heads) {
  std::vector<int64_t> peak(num_layers, context);
  if (cfg.is_full()) return {peak, peak};
  PrefillSelector sel(cfg, num_layers, num_kv_heads, context);
  peak = sel.budgets();
  std::vector<int64_t> steady = peak;
  if (sel.is_dynamic()) {
    const auto plan = allocate_layer_budgets(cfg, context, num_layers);
    const int64_t mean = cfg.budget_tokens(context);
    for (int64_t l = 0; l < num_layers; ++l) {
      if (!plan[l].full) steady[l] = std::min(peak[l], mean);
    }
  }
  return {steady, peak};
}

ShardPlan make_shard_plan(const ModelShape& m, const PlanOptions& o, const std::vector<PolicyConfig>& policies) {
  KV_CHECK(m.num_layers > 0 && m.hidden_size > 0 && m.intermediate_size > 0 && m.num_heads > 0 &&
               m.num_kv_heads > 0 && m.head_dim > 0 && m.vocab_size > 0,
           "model shape has a non-positive size");
  KV_CHECK(m.num_heads % m.num_kv_heads == 0,
           m.num_heads << " attention heads are not a multiple of " << m.num_kv_heads << " KV heads");
  validate_parallel_shape(m, o.tp, o.pp);
  KV_CHECK(o.gpu_memory_bytes > 0, "GPU memory must be positive");
  KV_CHECK(o.reserve_fraction >= 0.0 && o.reserve_fraction < 1.0,
           "reserve fraction must be in [0, 1) (got " << o.reserve_fraction << ")");
  KV_CHECK(o.context > 0, "context must be positive (got " << o.context << ")");
  KV_CHECK(o.block_size > 0 && o.weight_dtype_bytes > 0 && o.kv_dtype_bytes > 0, "bad block size or dtype size");

  KV_CHECK(o.layer_windows.empty() || static_cast<int64_t>(o.layer_windows.size()) == m.num_layers,
           o.layer_windows.size() << " layer windows for a model of " << m.num_layers << " layers");
  auto window_of = [&](int64_t l) { return o.layer_windows.empty() ? int64_t{0} : o.layer_windows[static_cast<size_t>(l)]; };
  auto ring_blocks = [&](int64_t w) { return ceil_div(w, o.block_size) + 1; };
  ShardPlan plan;
  plan.model = m;
  plan.options = o;
  plan.gpus = o.tp * o.pp;
  plan.usable_bytes = static_cast<int64_t>(static_cast<double>(o.gpu_memory_bytes) * (1.0 - o.reserve_fraction));
  const auto ranges = pipeline_layer_ranges(m.num_layers, o.pp);
  for (int64_t s = 0; s < o.pp; ++s) {
    StagePlan st;
    st.stage = s;
    st.layers = ranges[s];
    st.has_embedding = s == 0;
    st.has_lm_head = s == o.pp - 1;
    st.weight_params = stage_weight_params(m, o.tp, st.layers, st.has_embedding, st.has_lm_head);
    st.weight_bytes = o.weight_bits > 0
                          ? static_cast<int64_t>(std::ceil(static_cast<double>(st.weight_params) * o.weight_bits / 8))
                          : st.weight_params * o.weight_dtype_bytes;
    st.kv_heads = make_shard_layout(m, o.tp, 0, o.pp, s).kv_heads;
    st.kv_bytes_per_token_layer = 2 * st.kv_heads * kv_row_bytes(o, m.head_dim);
    st.block_bytes = st.kv_bytes_per_token_layer * o.block_size;
    for (int64_t l = st.layers.begin; l < st.layers.end; ++l) {
      if (window_of(l) > 0) {
        ++st.local_layers;
        st.local_blocks_per_seq += ring_blocks(window_of(l));
      }
    }
    st.kv_bytes_per_token = st.kv_bytes_per_token_layer * (st.layers.size() - st.local_layers);
    st.kv_capacity_bytes = plan.usable_bytes - st.weight_bytes;
    if (st.kv_capacity_bytes <= 0) plan.weights_fit = false;
    plan.stages.push_back(st);
  }

  KV_CHECK(o.shared_prefix >= 0 && o.shared_prefix <= o.context,
           "shared prefix of " << o.shared_prefix << " tokens outside the context of " << o.context);
  const int64_t shared_blocks = o.shared_prefix / o.block_size;  // only whole blocks are cached
  for (auto& st : plan.stages) st.prefix_cache_bytes = shared_blocks * (st.layers.end - st.layers.begin) * st.block_bytes;
  // A local layer's ring: its window's blocks and the one the window is leaving (or the whole
  // context when that is shorter). Its prompt passes through whole during the prefill (peak).
  // Compressing policies spend their budget on the global layers (PolicyConfig::local_layers).
  std::vector<int64_t> local_layers;
  for (int64_t l = 0; l < m.num_layers; ++l)
    if (window_of(l) > 0) local_layers.push_back(l);
  for (const auto& cfg : policies) {
    PolicyPlan pp;
    pp.policy = cfg.name;
    pp.kv_dtype = cfg.kv_dtype;
    PlanOptions own = o;
    if (!cfg.kv_dtype.empty()) set_kv_dtype(own, cfg.kv_dtype);
    PolicyConfig c = cfg;
    c.local_layers = local_layers;
    std::tie(pp.kept_per_layer, pp.peak_per_layer) = policy_kept_tokens(c, o.context, m.num_layers, m.num_kv_heads);
    for (int64_t l = 0; l < m.num_layers; ++l) {
      if (window_of(l) > 0) {
        pp.kept_per_layer[static_cast<size_t>(l)] = std::min(o.context, window_of(l));
        pp.peak_per_layer[static_cast<size_t>(l)] = o.context;
      }
    }
    pp.max_seqs = std::numeric_limits<int64_t>::max();
    pp.max_seqs_peak = std::numeric_limits<int64_t>::max();
    for (const auto& st : plan.stages) {
      int64_t steady_blocks = 0, peak_blocks = 0;
      // An uncompressed sequence's shared prefix blocks are the cache's, not its own.
      const int64_t shared = cfg.is_full() ? shared_blocks : 0;
      for (int64_t l = st.layers.begin; l < st.layers.end; ++l) {
        if (window_of(l) > 0) {  // its cached prompt blocks are the cache's after the prefill
          steady_blocks += std::min(ceil_div(o.context, o.block_size), ring_blocks(window_of(l)));
          peak_blocks += ceil_div(pp.peak_per_layer[l], o.block_size) - shared;
          continue;
        }
        steady_blocks += ceil_div(pp.kept_per_layer[l], o.block_size) - shared;
        peak_blocks += ceil_div(pp.peak_per_layer[l], o.block_size) - shared;
      }
      const int64_t block_bytes = cfg.kv_dtype.empty() ? st.block_bytes : 2 * st.kv_heads * kv_row_bytes(own, m.head_dim) * o.block_size;
      const int64_t steady = steady_blocks * block_bytes, peak = peak_blocks * block_bytes;
      pp.kv_bytes_per_seq.push_back(steady);
      pp.kv_bytes_per_seq_peak.push_back(peak);
      const int64_t cap = std::max<int64_t>(0, st.kv_capacity_bytes - st.prefix_cache_bytes);
      const int64_t n = steady > 0 ? cap / steady : 0;
      const int64_t n_peak = peak > 0 ? cap / peak : 0;
      pp.max_seqs_per_stage.push_back(n);
      // Ties go to the stage with less room (the later, heavier stage when capacities differ).
      if (n < pp.max_seqs || (n == pp.max_seqs && st.kv_capacity_bytes < plan.stages[pp.tightest_stage].kv_capacity_bytes)) {
        pp.max_seqs = n;
        pp.tightest_stage = st.stage;
      }
      pp.max_seqs_peak = std::min(pp.max_seqs_peak, n_peak);
    }
    plan.policies.push_back(std::move(pp));
  }
  return plan;
}

nlohmann::json to_json(const ShardPlan& p) {
  nlohmann::json j;
  j["model"] = {{"num_layers", p.model.num_layers},
                {"hidden_size", p.model.hidden_size},
                {"intermediate_size", p.model.intermediate_size},
                {"num_heads", p.model.num_heads},
                {"num_kv_heads", p.model.num_kv_heads},
                {"head_dim", p.model.head_dim},
                {"vocab_size", p.model.vocab_size},
                {"tie_word_embeddings", p.model.tie_word_embeddings}};
  j["tp"] = p.options.tp;
  j["pp"] = p.options.pp;
  j["gpus"] = p.gpus;
  j["gpu_memory_bytes"] = p.options.gpu_memory_bytes;
  j["reserve_fraction"] = p.options.reserve_fraction;
  j["usable_bytes_per_gpu"] = p.usable_bytes;
  j["context"] = p.options.context;
  j["block_size"] = p.options.block_size;
  j["weight_dtype_bytes"] = p.options.weight_dtype_bytes;
  j["weight_bits"] = p.options.weight_bits > 0 ? p.options.weight_bits : 8.0 * static_cast<double>(p.options.weight_dtype_bytes);
  j["kv_dtype_bytes"] = p.options.kv_dtype_bytes;
  j["kv_quant_bits"] = p.options.kv_quant_bits;
  j["kv_quant_scale_bytes"] = p.options.kv_quant_scale_bytes;
  j["shared_prefix"] = p.options.shared_prefix;
  j["weights_fit"] = p.weights_fit;
  j["stages"] = nlohmann::json::array();
  for (const auto& s : p.stages) {
    j["stages"].push_back({{"stage", s.stage},
                           {"layers", {s.layers.begin, s.layers.end}},
                           {"has_embedding", s.has_embedding},
                           {"has_lm_head", s.has_lm_head},
                           {"weight_params_per_gpu", s.weight_params},
                           {"weight_bytes_per_gpu", s.weight_bytes},
                           {"kv_heads_per_gpu", s.kv_heads},
                           {"kv_bytes_per_token", s.kv_bytes_per_token},
                           {"local_layers", s.local_layers},
                           {"local_blocks_per_seq", s.local_blocks_per_seq},
                           {"kv_capacity_bytes", s.kv_capacity_bytes},
                           {"prefix_cache_bytes", s.prefix_cache_bytes}});
  }
  j["policies"] = nlohmann::json::array();
  for (const auto& pp : p.policies) {
    j["policies"].push_back({{"policy", pp.policy},
                             {"kept_per_layer", pp.kept_per_layer},
                             {"peak_per_layer", pp.peak_per_layer},
                             {"kv_bytes_per_seq_per_stage", pp.kv_bytes_per_seq},
                             {"kv_bytes_per_seq_peak_per_stage", pp.kv_bytes_per_seq_peak},
                             {"max_seqs_per_stage", pp.max_seqs_per_stage},
                             {"max_seqs", pp.max_seqs},
                             {"max_seqs_peak", pp.max_seqs_peak},
                             {"tightest_stage", pp.tightest_stage}});
    if (!pp.kv_dtype.empty()) j["policies"].back()["kv_dtype"] = pp.kv_dtype;
  }
  return j;
}

}  // namespace kvserve::parallel
