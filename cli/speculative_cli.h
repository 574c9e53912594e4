#pragma once
// --speculative-config: vLLM's flag (a JSON object) for serve and generate, and the YAML section
// (speculative_config) as the engine's SpeculativeConfig.
#include <CLI/CLI.hpp>

#include <string>

#include "backend/spec_decode/speculative_config.h"
#include "configs/server_config.h"

namespace kvserve::cli {

inline CLI::Option* add_speculative_option(CLI::App* cmd, std::string& json) {
  return cmd->add_option("--speculative-config", json,
                         "speculative decoding as a JSON object, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                         "5, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' (prompt lookup), or {\"method\": \"self\", "
                         "\"num_speculative_tokens\": 4} (the model drafts over its KV's first draft_sink_tokens "
                         "(16) and last draft_window_tokens (496), for sequences of at least draft_min_context_tokens (4096), "
                         "and with draft_policy (a policy's name) the blocks holding what it keeps of the prompt with "
                         "draft_budget (512) tokens per layer, chosen again every draft_refresh_tokens (64); \"quantization\": \"int8\" (or \"model\", a "
                         "checkpoint of the same KV layout) drafts with those weights through the view, from any length unless "
                         "draft_min_context_tokens is given; \"draft_sampling\": \"sample\" draws a "
                         "sampling request's drafts from the draft distribution instead of taking its argmax), or {\"method\": "
                         "\"draft_model\", \"num_speculative_tokens\": 4, \"quantization\": \"int4\"} (a quantized copy of the model, "
                         "or \"model\": a checkpoint or GGUF file with the same tokenizer, drafts; one of the served model's KV layout "
                         "reads its cache, another keeps its own); optional "
                         "disable_by_batch_size, and auto_disable (default true: speculation pauses while its steps emit fewer "
                         "tokens per second than plain ones)");
}

inline SpeculativeConfig speculative_config(const config::SpeculativeSection& s) {
  SpeculativeConfig c;
  c.method = s.method == "none" ? "" : s.method;
  c.num_speculative_tokens = s.num_speculative_tokens;
  c.prompt_lookup_min = s.prompt_lookup_min;
  c.prompt_lookup_max = s.prompt_lookup_max;
  c.disable_by_batch_size = s.disable_by_batch_size;
  c.auto_disable = s.auto_disable;
  c.draft_sink_tokens = s.draft_sink_tokens;
  c.draft_window_tokens = s.draft_window_tokens;
  c.draft_min_context_tokens = s.draft_min_context_tokens;
  c.draft_policy = s.draft_policy;
  c.draft_budget = s.draft_budget;
  c.draft_refresh_tokens = s.draft_refresh_tokens;
  c.draft_sampling = s.draft_sampling;
  c.model = s.model;
  c.quantization = s.quantization;
  return c;
}

inline config::SpeculativeSection speculative_section(const SpeculativeConfig& c) {
  return {c.method.empty() ? "none" : c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max,
          c.disable_by_batch_size, c.auto_disable, c.draft_sink_tokens, c.draft_window_tokens, c.draft_min_context_tokens,
          c.draft_policy, c.draft_budget, c.draft_refresh_tokens, c.draft_sampling, c.model, c.quantization};
}

}  // namespace kvserve::cli
