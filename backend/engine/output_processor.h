#pragma once
// OutputProcessor: turns sampled tokens into a request's events — incremental detokenizing, stop
// tokens and stop strings, max_tokens / context length, logprob texts, the final event.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "backend/sampling/sampler.h"
#include "backend/engine/sequence.h"

namespace kvserve {

class OutputProcessor {
 public:
  OutputProcessor(const Tokenizer& tokenizer, std::vector<int64_t> eos_ids, int64_t max_model_len)
      : tokenizer_(tokenizer), eos_ids_(std::move(eos_ids)), max_model_len_(max_model_len) {}

  const std::vector<int64_t>& eos_ids() const { return eos_ids_; }
  // Appends a freshly sampled token and emits its event. Returns the finish reason ("stop",
  // "length", or "grammar_dead_end" without appending when the grammar allowed no token) when the
  // sequence is done; then call finish() with it.
  std::optional<std::string> on_token(Sequence& s, const SampledToken& t) const;
  // Emits the final event (reason "stop" | "length" | "abort" | "error").
  void finish(Sequence& s, const std::string& reason, const std::string& error = "", bool request_error = false,
              bool unavailable = false) const;

 private:
  const Tokenizer& tokenizer_;
  std::vector<int64_t> eos_ids_;
  int64_t max_model_len_;
};

// Length of the longest suffix of `text` that is a proper prefix of some stop string.
size_t held_suffix(const std::string& text, const std::vector<std::string>& stops);

}  // namespace kvserve
