#pragma once
// PolicyConfig: a named KV-compression policy = budget allocator + token scorer + parameters.
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvserve {

// How per-layer budgets are distributed across layers.
// kGlobal: one top-k over every (layer, KV head, position) of the prompt (KVzip's selection, kvpress's
// KVzipPress with layerwise=False); needs every layer's scores before selecting (scorer reconstruction).
enum class AllocatorKind { kFull, kUniform, kPyramid, kDynamic, kGlobal };
// How tokens are ranked inside a layer (higher score = kept first).
// kReconstruction: KVzip (Kim et al., 2025): the most attention an entry receives while the model, given
// the prompt's cache, is fed a repeat prompt and the prompt again (backend/scoring/kvzip_scorer.h); query-agnostic.
// kPredicted: KVzap (arXiv 2601.07891): a small per-layer model predicts KVzip+'s log scores from
// the hidden states entering each layer's attention (backend/scoring/kvzap_predictor.h); query-agnostic, no
// extra pass.
enum class ScorerKind {
  kNone,
  kWindowAttention,
  kAccumulatedAttention,
  kSinkRecent,
  kKeyNorm,
  kRandom,
  kReconstruction,
  kPredicted
};
// 1-D pooling of window-attention scores along the sequence.
enum class PoolingKind { kMax, kAvg };
// Whose arithmetic to follow where the references differ (docs/architecture.md, "The methods' arithmetic").
enum class Semantics { kPaper, kKvpress };
// DynamicKV: whose selection rules (docs/eval/dynamickv.md). kPaper: Algorithm 1 as written, scores
// per KV head. kAuthors: the authors' code: scores per query head (each KV head stores the union of
// its query heads' choices), re-budgeted at every m-th layer only (the last L mod m layers keep bs).
enum class DynamicVariant { kPaper, kAuthors };
// DynamicKV: how each layer's scores are scaled before the cross-layer top-k. kLayer: a layer's
// scores sum to 1; kHead: each head's (ranking row's) sum to 1; kMax: each head's best is 1; kKth:
// each head's (norm_rank * base)-th best is 1 (base = B - window): every head is sure of about that
// many tokens and the rest of the total goes to the tokens strongest against their own head's
// reference (norm_rank 1 gives every layer the same budget: SnapKV's allocation).
enum class ScoreNorm { kNone, kLayer, kHead, kMax, kKth };
// How a layer's budget is shared among its KV heads: kUniform, every head keeps the layer's count;
// kAdaptive, AdaKV (Feng et al., 2024): one top-k over heads x positions of the layer, each head
// keeping at least alpha of its even share (docs/architecture.md, "Head-wise KV lengths").
enum class HeadBudgets { kUniform, kAdaptive };
// DynamicKV: a schedule the dynamic budgets are mixed with (kPyramid: PyramidKV's, beta).
enum class BudgetPrior { kNone, kPyramid };

// DynamicKV's options beyond r_max/update_interval; the defaults are the exact paper variant.
struct DynamicOptions {
  DynamicVariant variant = DynamicVariant::kPaper;
  ScoreNorm norm = ScoreNorm::kNone;
  double norm_rank = 1.0;     // ScoreNorm::kKth: the rank scaled to 1, as a fraction of B - window
  double min_ratio = 0.0;     // every layer keeps at least min_ratio * (B - window) scored tokens
  BudgetPrior prior = BudgetPrior::kNone;
  double prior_weight = 0.5;  // weight of the dynamic budgets against the prior's
  // True for Algorithm 1 exactly as the paper writes it.
  bool is_paper() const {
    return variant == DynamicVariant::kPaper && norm == ScoreNorm::kNone && min_ratio == 0.0 && prior == BudgetPrior::kNone;
  }
};

// All parameters of one policy; build it with make_policy_config so that it is validated.
struct PolicyConfig {
  std::string name = "full";
  AllocatorKind allocator = AllocatorKind::kFull;
  ScorerKind scorer = ScorerKind::kNone;
  // Average kept tokens per layer, window included (0 = unset). Exactly one of budget / budget_ratio
  // is set for a compressing policy.
  int64_t budget = 0;
  // Fraction of the prompt kept, 0 < r < 1 (0 = unset).
  double budget_ratio = 0.0;
  // KV bytes a sequence may keep, the whole model's (every global layer, K and V, every KV head) in
  // the KV cache's dtype (0 = unset). Where a KV memory meets the model it becomes `budget` tokens
  // per layer (resolve_budget_bytes): the same bytes keep ~1.9x the tokens at int8 and ~3.6x at
  // int4 as at float16, so a deployment trades bits for tokens by its cache.kv_cache_dtype alone.
  int64_t budget_bytes = 0;
  // The KV cache dtype this policy's sequences store K/V in ("" = the cache's, cache.kv_cache_dtype).
  // Sequences of several precisions then share one storage (cache_manager/mixed_kv_memory.h), and
  // budget_bytes is resolved in this dtype: the policy itself trades bits for tokens.
  std::string kv_dtype;
  // kv_dtype "ladder" (policies/kv_dtype_ladder.h): the narrower rungs' policies in order, each with
  // the least fraction of a prompt it must keep to be chosen. Empty for any other policy.
  std::vector<std::pair<std::string, double>> kv_rungs;
  // kv_dtype "ladder" with YAML `kv_ladder: "int8:0.3,int4"`: the rungs below the cache's dtype as
  // the deployment orders them, each a KV dtype and the least fraction of a prompt it must keep to
  // be chosen (the last rung takes the rest: 0). Empty: the ladder the eval chose for the scorer.
  std::vector<std::pair<std::string, double>> kv_ladder;
  int64_t window = 8;        // observation window / recent tokens always kept
  int64_t kernel = 7;        // pooling kernel (odd)
  PoolingKind pooling = PoolingKind::kMax;
  int64_t beta = 20;         // PyramidKV top-layer divisor
  int64_t r_max = 10;        // DynamicKV candidate multiplier
  int64_t update_interval = 4;  // DynamicKV: re-budget after every m-th layer
  DynamicOptions dynamic;       // DynamicKV: variant, score normalisation, per-layer minimum, prior
  int64_t sink = 4;          // StreamingLLM sink tokens
  std::vector<int64_t> skip_layers;  // layers never compressed (key_norm paper default {0,1})
  // The model's sliding-window (local) layers, ascending: set from the model where the KV memory is
  // made (make_kv_memory, the engine's scheduler), never from YAML. Their window is their budget:
  // they keep every position (the ring drops what the window left) and the allocators spread the
  // budget over the other layers only.
  std::vector<int64_t> local_layers;
  Semantics semantics = Semantics::kPaper;
  int64_t decode_budget = 0;       // decode-time eviction threshold per (seq, layer); 0 = off
  int64_t decode_evict_chunk = 16;  // tokens evicted at once when decode_budget is exceeded
  uint64_t seed = 0;               // random scorer seed
  // Whether a request may continue from the compressed KV its conversation's previous turn left
  // (prefix_reuse: compressed; docs/architecture.md, "Conversation reuse"). Off by default: the
  // earlier turns stay compressed for the question they were asked with.
  bool reuse_compressed = false;
  HeadBudgets head_budgets = HeadBudgets::kUniform;
  double alpha = 0.2;  // HeadBudgets::kAdaptive: each head's guaranteed share of its even share (kvpress's default)
  // ScorerKind::kReconstruction: context tokens reconstructed per pass (paper 2000, kvpress 2048).
  int64_t chunk_size = 2000;
  // `compress: context`: a request's context (what comes before its question: a chat's messages
  // before the last user message, a completion's `kv_context`) is compressed on its own and the rest
  // of the prompt appended whole, so the compressed context is a pure function of its tokens and is
  // cached as such (docs/architecture.md, "Compressed contexts"). Only for query-agnostic scorers;
  // the default for kvzip. `compress: prompt` compresses the whole prompt, question included.
  bool compress_context = false;
  // ScorerKind::kPredicted: the predictor's directory (kvpress's KVzapModel format: config.json +
  // model.safetensors); "" = `<model dir>/kvzap`.
  std::string predictor;

  // True when the policy never drops anything.
  bool is_full() const { return allocator == AllocatorKind::kFull || scorer == ScorerKind::kNone; }
  // KV heads of a layer may keep different numbers of tokens (the pool needs head-wise blocks).
  bool head_adaptive() const { return !is_full() && head_budgets == HeadBudgets::kAdaptive; }
  // The selection waits for every layer's scores, given after the whole prompt's prefill
  // (KvMemory::select_by_scores): a reconstruction pass's (kvzip) or the predictor's, recorded
  // layer by layer (kvzap); not chosen from each layer's own queries and keys as it runs.
  bool scores_after_prefill() const {
    return !is_full() && (scorer == ScorerKind::kReconstruction || scorer == ScorerKind::kPredicted);
  }
  // Window scores averaged (kvpress, DynamicKV paper eq. 1) instead of summed (PyramidKV/SnapKV authors).
  bool window_mean() const { return semantics == Semantics::kKvpress || allocator == AllocatorKind::kDynamic; }
  // The kept set depends on the tokens scored alone, never on a question after them: reconstruction,
  // key norms, sinks and recent tokens.
  bool query_agnostic() const {
    return scorer == ScorerKind::kReconstruction || scorer == ScorerKind::kPredicted || scorer == ScorerKind::kKeyNorm ||
           scorer == ScorerKind::kSinkRecent;
  }
  // Whether `layer` is exempt from compression (skip_layers or a local layer).
  bool skips_layer(int64_t layer) const;
  bool is_local_layer(int64_t layer) const;
  // The layers of a num_layers model that are not local, ascending: those the budgets are spread over.
  std::vector<int64_t> global_layers(int64_t num_layers) const;
  // budget_bytes as tokens per layer: token_layer_bytes = one token of one layer, every KV head of
  // the model, K and V, in the cache's dtype; the bytes are spread over the global layers of a
  // num_layers model. No-op without budget_bytes; throws naming budget_bytes when the bytes hold
  // no more than the window.
  void resolve_budget_bytes(int64_t token_layer_bytes, int64_t num_layers, const std::string& kv_dtype);
  // The average per-layer budget (window included) for a prompt of `prompt_len` tokens, as the
  // paper semantics count it: `budget`, or max(1, int(ratio * prompt_len)).
  int64_t budget_tokens(int64_t prompt_len) const;
};

// The policy names make_policy_config knows: full, snapkv, pyramidkv, dynamickv, streamingllm, h2o,
// knorm, random, kvzip, kvzap.
const std::vector<std::string>& policy_names();

// A named policy with its authors' defaults, overridden by `params` (key=value strings). Throws
// KvError naming the key and the bad value; an unknown key lists the valid keys.
PolicyConfig make_policy_config(const std::string& name, const std::map<std::string, std::string>& params = {});

// Checks cross-field consistency (called by make_policy_config; call again after editing fields).
void validate_policy_config(const PolicyConfig& cfg);

nlohmann::json to_json(const PolicyConfig& cfg);

std::string to_string(AllocatorKind k);
std::string to_string(ScorerKind k);
std::string to_string(PoolingKind k);
std::string to_string(Semantics k);
std::string to_string(DynamicVariant k);
std::string to_string(ScoreNorm k);
std::string to_string(BudgetPrior k);
std::string to_string(HeadBudgets k);

}  // namespace kvserve
