#pragma once
// PolicyConfig: a named KV-compression policy = budget allocator + token scorer + parameters.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvserve {

// How per-layer budgets are distributed across layers.
enum class AllocatorKind { kFull, kUniform, kPyramid, kDynamic };
// How tokens are ranked inside a layer (higher score = kept first).
enum class ScorerKind { kNone, kWindowAttention, kAccumulatedAttention, kSinkRecent, kKeyNorm, kRandom };
// 1-D pooling of window-attention scores along the sequence.
enum class PoolingKind { kMax, kAvg };
// Whose arithmetic to follow where the references differ (docs/architecture.md, "The methods' arithmetic").
enum class Semantics { kPaper, kKvpress };

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
  int64_t window = 8;        // observation window / recent tokens always kept
  int64_t kernel = 7;        // pooling kernel (odd)
  PoolingKind pooling = PoolingKind::kMax;
  int64_t beta = 20;         // PyramidKV top-layer divisor
  int64_t r_max = 10;        // DynamicKV candidate multiplier
  int64_t update_interval = 4;  // DynamicKV: re-budget after every m-th layer
  int64_t sink = 4;          // StreamingLLM sink tokens
  std::vector<int64_t> skip_layers;  // layers never compressed (key_norm paper default {0,1})
  Semantics semantics = Semantics::kPaper;
  int64_t decode_budget = 0;       // decode-time eviction threshold per (seq, layer); 0 = off
  int64_t decode_evict_chunk = 16;  // tokens evicted at once when decode_budget is exceeded
  uint64_t seed = 0;               // random scorer seed

  // True when the policy never drops anything.
  bool is_full() const { return allocator == AllocatorKind::kFull || scorer == ScorerKind::kNone; }
  // Window scores averaged (kvpress, DynamicKV paper eq. 1) instead of summed (PyramidKV/SnapKV authors).
  bool window_mean() const { return semantics == Semantics::kKvpress || allocator == AllocatorKind::kDynamic; }
  // Whether `layer` is exempt from compression.
  bool skips_layer(int64_t layer) const;
  // The average per-layer budget (window included) for a prompt of `prompt_len` tokens, as the
  // paper semantics count it: `budget`, or max(1, int(ratio * prompt_len)).
  int64_t budget_tokens(int64_t prompt_len) const;
};

// The policy names make_policy_config knows: full, snapkv, pyramidkv, dynamickv, streamingllm, h2o,
// knorm, random.
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

}  // namespace kvserve
