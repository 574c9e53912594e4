#pragma once
// SamplingParams: how one request picks its tokens and when it stops (OpenAI + vLLM fields).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kvserve {

struct StructuredGrammar;  // backend/sampling/grammar_compiler.h

struct SamplingParams {
  double temperature = 1.0;  // 0 = greedy
  double top_p = 1.0;
  int64_t top_k = 0;         // 0 = off
  double min_p = 0.0;
  double repetition_penalty = 1.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  std::optional<uint64_t> seed;
  int64_t max_tokens = 16;
  int64_t min_tokens = 0;
  std::vector<std::string> stop;          // stop strings (not included in the output)
  std::vector<int64_t> stop_token_ids;    // in addition to the model's EOS ids
  bool ignore_eos = false;
  bool include_stop_str_in_output = false;
  int64_t logprobs = -1;                  // -1: none; n >= 0: chosen token's logprob + top-n
  bool skip_special_tokens = true;
  // Logit edits (backend/sampling/logits_processors.h), applied before penalties and sampling; token ids
  // are checked against the vocabulary at the HTTP edge.
  std::vector<std::pair<int64_t, double>> logit_bias;  // token id -> added to its logit
  std::vector<int64_t> allowed_token_ids;              // non-empty: every other token is masked
  std::vector<std::vector<int64_t>> bad_words_ids;     // a word's tokens: its last one is masked after the others
  int64_t prompt_logprobs = -1;  // -1: none; k >= 0: each prompt token's logprob (after the first) + top-k
  // Structured output: the compiled grammar every token must follow (null = unconstrained).
  std::shared_ptr<const StructuredGrammar> grammar;
};

}  // namespace kvserve
