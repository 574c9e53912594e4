#pragma once
// Sequence: one request inside the engine — its tokens so far and the state the scheduler and the
// output processor keep for it (the scheduler owns it from submit() to its final event).
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/engine/engine_types.h"
#include "text/tokenizer.h"

namespace kvserve {

struct Sequence {
  int64_t id = 0;
  GenerationRequest req;
  EventCallback on_event;
  std::vector<int64_t> output;
  uint64_t seed = 0;  // the sampler's RNG seed (the request's, or one the engine drew)
  std::chrono::steady_clock::time_point arrival;  // submit()

  // Scheduler state.
  bool scheduled = false;      // admitted for prefill at least once (queue time is measured once)
  bool sampler_added = false;  // the runner holds its sampler
  bool in_cache = false;       // holds KV (or will, once the planned prefill runs)
  bool suspect = false;        // was in a decode batch that failed: decodes alone until a step succeeds
  // Chunked prefill: positions of prefill_tokens() planned so far, of prefill_len; the sequence
  // decodes once every chunk ran.
  int64_t prefill_done = 0, prefill_len = 0;
  bool keep_copy = false;  // its prefill may copy full prompt blocks into the prefix cache (reserved)
  // Speculative decoding: the adaptive γ, drafts asked of the proposer next (0 = the config's
  // num_speculative_tokens).
  int64_t spec_k = 0;
  // Back-off: steps left to decode without drafts, and the next pause (doubles while a single draft
  // keeps being rejected, back to the first after a draft accepted whole).
  int64_t spec_pause = 0, spec_backoff = 0;
  // After a verify step: the positions its KV holds (the last token and the accepted drafts past the
  // positions before), of which a stop may emit fewer; 0 after any other step.
  int64_t kv_end = 0;
  bool prefilling() const { return in_cache && prefill_done < prefill_len; }

  // Output state.
  std::unique_ptr<IncrementalDetokenizer> detok;
  std::string held;  // decoded text not yet sent (could be the start of a stop string)
  int64_t kept_kv = 0, full_kv = 0;
  std::string kv_cache_dtype;        // GenerationEvent's, from the policy it runs under
  int64_t kv_token_layer_bytes = 0;
  int64_t kept_head_min = 0, kept_head_max = 0;  // tokens kept per (layer, KV head)
  double kept_head_mean = 0.0;
  int64_t cached_tokens = 0;     // prompt tokens its first prefill took from the prefix cache
  bool prefix_reported = false;

  int64_t next_position() const { return static_cast<int64_t>(req.prompt_ids.size() + output.size()) - 1; }
  // Tokens a (re)prefill runs: the prompt, plus everything generated but the last token, which the
  // next decode step feeds (preemption by recompute).
  std::vector<int64_t> prefill_tokens() const {
    std::vector<int64_t> t = req.prompt_ids;
    if (!output.empty()) t.insert(t.end(), output.begin(), output.end() - 1);
    return t;
  }
  // min_tokens: EOS may not end the sequence yet, so the sampler masks it.
  bool ban_eos() const {
    return static_cast<int64_t>(output.size()) < req.sampling.min_tokens && !req.sampling.ignore_eos;
  }
};

}  // namespace kvserve
