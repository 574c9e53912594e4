#pragma once
// Engine request and output types shared by the CLI, the HTTP server and the scheduler.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/sampling/sampling_params.h"

namespace kvserve {

// What a client asks the engine to do: a tokenized prompt, sampling, and the KV policy to use.
struct GenerationRequest {
  std::string request_id;
  std::vector<int64_t> prompt_ids;
  SamplingParams sampling;
  std::string kv_policy;  // a named policy from the config; empty = the engine's default
  // prefix_reuse: true = "compressed" (continue the conversation's parked compressed KV), false =
  // "exact"; unset = the policy's setting.
  std::optional<bool> reuse_compressed;
  // The prompt's first context_len tokens are its context (a chat's messages before the last user
  // message, a completion's kv_context): a policy with `compress: context` compresses them alone
  // and caches the result for the next request with the same context. 0 = none.
  int64_t context_len = 0;
  // false: this request decodes without speculation (the engine's speculative_config otherwise).
  bool speculative = true;
  // >= 0: at most this many draft tokens a step (0 = none), below the engine's num_speculative_tokens
  // (a rollout rule's `speculative:`); -1 = the engine's.
  int64_t max_draft_tokens = -1;
};

struct TokenLogprob {
  int64_t token_id = 0;
  std::string token;  // decoded text of this single token
  double logprob = 0.0;
  int64_t rank = 0;   // 1-based rank in its distribution (prompt_logprobs); 0 = not computed
};

// Emitted by the engine as a request progresses; the last event has finished = true.
struct GenerationEvent {
  std::string text_delta;                 // new complete UTF-8 text since the previous event
  std::vector<int64_t> token_ids;         // tokens generated in this step
  std::vector<TokenLogprob> chosen;       // per token, when logprobs were requested
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  // prompt_logprobs, on the first token's event: per prompt position from the second on (the first
  // has no logprob), the prompt token's logprob and the top-k of that position.
  std::vector<TokenLogprob> prompt_chosen;
  std::vector<std::vector<TokenLogprob>> prompt_top;
  bool finished = false;
  std::string finish_reason;              // "stop" | "length" | "abort" | "error" | "grammar_dead_end"
  std::string error;                      // when finish_reason == "error"
  bool request_error = false;             // the request itself can never be served here (HTTP 400, not 500)
  bool unavailable = false;               // the engine failed for good (a rank died): HTTP 503, not 500
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t kept_kv_tokens = 0;             // KV tokens the policy kept after prefill (all layers)
  // Tokens kept per (layer, KV head) after prefill: least, mean, most (head-wise budgets spread them).
  int64_t kept_head_min = 0, kept_head_max = 0;
  double kept_head_mean = 0.0;
  int64_t full_kv_tokens = 0;             // what full KV would have held
  // The KV cache dtype the request's K/V were stored in (its policy's kv_dtype, its ladder rung's,
  // else the cache's: "float16", "int8", ...) and one token's K and V of one layer in it (all KV
  // heads, scales included), so kept_kv_tokens x this is the KV bytes kept.
  std::string kv_cache_dtype;
  int64_t kv_token_layer_bytes = 0;
  int64_t cached_tokens = 0;              // prompt tokens served from the prefix cache
};

using EventCallback = std::function<void(const GenerationEvent&)>;

}  // namespace kvserve
