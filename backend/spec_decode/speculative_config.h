#pragma once
// SpeculativeConfig: vLLM's speculative_config for the engine (which proposer drafts, how many
// tokens), parsed from the JSON of --speculative-config or from the YAML's mapping at the edge.
#include <cstdint>
#include <string>

namespace kvserve {

struct SpeculativeConfig {
  // "" / "none": no speculation; "ngram": prompt lookup over the sequence's prompt and output;
  // "self": the model drafts over a compressed view of the sequence's own KV (self_drafter.h);
  // "draft_model": a second model with the same tokenizer drafts: one of the served model's KV layout
  // (a quantized copy of it) over the sequence's own KV, which it reads and never writes for good
  // (backend/spec_decode/draft_model.h), another over a cache of its own (separate_kv_drafter.h).
  std::string method;
  int64_t num_speculative_tokens = 0;  // drafts per step at most (the adaptive γ starts here)
  int64_t prompt_lookup_min = 2;       // the shortest suffix n-gram matched
  int64_t prompt_lookup_max = 4;       // the longest, tried first
  // No drafts while more than this many sequences decode (0: no limit): a large batch's decode is
  // compute-bound, so verifying γ + 1 tokens per sequence costs about γ + 1 plain steps.
  int64_t disable_by_batch_size = 0;
  // Pause speculation while its decode steps emit fewer tokens per second than plain steps of the
  // same batch size (measured: backend/spec_decode/speculation_governor.h); false: speculate always.
  bool auto_disable = true;
  // "self": the draft steps attend to the cache's first draft_sink_tokens and last
  // draft_window_tokens (each rounded up to whole blocks; the window's last block is the open one).
  int64_t draft_sink_tokens = 16;
  int64_t draft_window_tokens = 496;
  // "self": sequences whose context is shorter decode plainly. A draft step with the model's own
  // weights still reads every weight, so it costs nearly a plain step until the KV it skips outweighs
  // them; a quantized copy's steps are cheap at any length. -1: that choice (min_context_tokens()).
  int64_t draft_min_context_tokens = -1;
  // "self": with a policy named here (one of the server's policies: snapkv, pyramidkv, knorm, ...),
  // the view also keeps, per layer, the blocks that hold most of what that policy keeps of a prompt
  // with draft_budget tokens per layer, chosen as the prompt's prefill ends (its own policy keeping
  // it whole); "": sinks and window alone.
  std::string draft_policy;
  int64_t draft_budget = 512;
  // ...and re-run that selection every draft_refresh_tokens decoded tokens over the whole cache,
  // a window scorer with the latest decode queries (0: the prompt's choice stays).
  int64_t draft_refresh_tokens = 64;
  // "self": how a sampling request's drafts are chosen. "greedy": the argmax of the draft logits
  // (a seeded request draws plain decoding's tokens exactly); "sample": drawn from the draft's
  // distribution and kept by speculative sampling (more drafts kept at temperature > 0; every token
  // distributed as plain decoding's, but not the same tokens for a seed). Greedy requests draft
  // argmaxes either way.
  std::string draft_sampling = "greedy";
  // "draft_model" (vLLM's names): the draft's checkpoint or GGUF file ("": the served model's own),
  // and its quantization at load (LoadOptions::quantization: int8, int4, a ggml type; "": as stored).
  // The served model's checkpoint needs a quantization (the same weights would draft what they verify).
  // "self" with either: those weights draft through the view instead of the served model's (a
  // quantized copy: small weights and little KV per draft step); they must share its KV layout.
  std::string model;
  std::string quantization;

  bool enabled() const {
    return (method == "ngram" || method == "self" || method == "draft_model") && num_speculative_tokens > 0;
  }
  bool self_draft() const { return method == "self" && num_speculative_tokens > 0; }
  bool model_draft() const { return method == "draft_model" && num_speculative_tokens > 0; }
  // Weights other than the served model's draft (draft_model, or self with model / quantization).
  bool loads_draft_model() const {
    return model_draft() || (self_draft() && (!model.empty() || (!quantization.empty() && quantization != "none")));
  }
  // draft_min_context_tokens as it applies: its value, or unset 4096 when the model's own weights
  // draft and 0 when a draft model's do.
  int64_t min_context_tokens() const {
    return draft_min_context_tokens >= 0 ? draft_min_context_tokens : loads_draft_model() ? 0 : 4096;
  }
  // The runner makes the drafts at the step (self or a draft model); the scheduler leaves placeholders.
  bool runner_drafts() const { return self_draft() || model_draft(); }
  // Throws naming `where` and the field when a value is out of range or the method is unknown.
  void validate(const std::string& where) const;
};

// Parses a JSON object ({"method": "ngram", "num_speculative_tokens": 5, ...}); errors name `where`
// (e.g. "--speculative-config") and the key.
SpeculativeConfig parse_speculative_config_json(const std::string& json, const std::string& where);

// The config as JSON (what /v1/models and generate --json report).
std::string speculative_config_json(const SpeculativeConfig& c);

}  // namespace kvserve
