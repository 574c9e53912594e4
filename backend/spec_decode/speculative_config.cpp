#include "backend/spec_decode/speculative_config.h"

#include <nlohmann/json.hpp>

#include "common/check.h"

namespace kvserve {

void SpeculativeConfig::validate(const std::string& where) const {
  KV_CHECK(method.empty() || method == "none" || method == "ngram" || method == "self" || method == "draft_model",
           where << ": method '" << method << "' is not served (ngram, self, draft_model, or none)");
  if (method != "ngram" && method != "self" && method != "draft_model") return;
  KV_CHECK(method != "ngram" || (model.empty() && quantization.empty()),
           where << ": model and quantization name a draft model: they need method 'draft_model' or 'self'");
  KV_CHECK(num_speculative_tokens >= 1 && num_speculative_tokens <= 64,
           where << ": num_speculative_tokens must be in [1, 64], got " << num_speculative_tokens);
  KV_CHECK(disable_by_batch_size >= 0, where << ": disable_by_batch_size must be >= 0, got " << disable_by_batch_size);
  if (method == "self") {
    KV_CHECK(draft_sink_tokens >= 0, where << ": draft_sink_tokens must be >= 0, got " << draft_sink_tokens);
    KV_CHECK(draft_window_tokens >= 1, where << ": draft_window_tokens must be >= 1, got " << draft_window_tokens);
    KV_CHECK(draft_min_context_tokens >= -1,
             where << ": draft_min_context_tokens must be >= 0 (or -1: 4096, 0 with a draft model), got "
                   << draft_min_context_tokens);
    KV_CHECK(draft_policy.empty() || draft_budget >= 1,
             where << ": draft_budget must be >= 1 token per layer, got " << draft_budget);
    KV_CHECK(draft_refresh_tokens >= 0, where << ": draft_refresh_tokens must be >= 0, got " << draft_refresh_tokens);
    KV_CHECK(draft_sampling == "greedy" || draft_sampling == "sample",
             where << ": draft_sampling must be greedy or sample, got '" << draft_sampling << "'");
    return;
  }
  if (method == "draft_model") {
    KV_CHECK(!model.empty() || (!quantization.empty() && quantization != "none"),
             where << ": method 'draft_model' needs a model (a checkpoint or GGUF file with the served model's "
                      "tokenizer) or a quantization of the served model (int8, int4, a ggml type)");
    KV_CHECK(draft_policy.empty(), where << ": draft_policy '" << draft_policy
                                         << "' needs method 'self' (a draft model reads the whole KV)");
    KV_CHECK(draft_sampling == "greedy" || draft_sampling == "sample",
             where << ": draft_sampling must be greedy or sample, got '" << draft_sampling << "'");
    return;
  }
  KV_CHECK(draft_sampling == "greedy", where << ": draft_sampling '" << draft_sampling
                                             << "' needs method 'self' or 'draft_model' (prompt lookup drafts one token)");
  KV_CHECK(draft_policy.empty(), where << ": draft_policy '" << draft_policy << "' needs method 'self'");
  KV_CHECK(prompt_lookup_min >= 1, where << ": prompt_lookup_min must be >= 1, got " << prompt_lookup_min);
  KV_CHECK(prompt_lookup_max >= prompt_lookup_min,
           where << ": prompt_lookup_max (" << prompt_lookup_max << ") is below prompt_lookup_min (" << prompt_lookup_min
                 << ")");
  KV_CHECK(prompt_lookup_max <= 64, where << ": prompt_lookup_max must be <= 64, got " << prompt_lookup_max);
}

SpeculativeConfig parse_speculative_config_json(const std::string& text, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    KV_FAIL(where << ": not JSON (" << e.what() << ")");
  }
  KV_CHECK(j.is_object(), where << ": expected a JSON object such as {\"method\": \"ngram\", \"num_speculative_tokens\": 5}");
  SpeculativeConfig c;
  bool min_set = false, max_set = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& k = it.key();
    auto integer = [&]() {
      KV_CHECK(it->is_number_integer(), where << ": " << k << " must be an integer, got " << it->dump());
      return it->get<int64_t>();
    };
    auto text = [&](const char* what) {  // a string, or null for none
      KV_CHECK(it->is_string() || it->is_null(), where << ": " << k << " must be " << what << ", got " << it->dump());
      return it->is_null() ? std::string() : it->get<std::string>();
    };
    if (k == "method") {
      c.method = text("a string");
    } else if (k == "num_speculative_tokens") {
      c.num_speculative_tokens = integer();
    } else if (k == "prompt_lookup_min") {
      c.prompt_lookup_min = integer();
      min_set = true;
    } else if (k == "prompt_lookup_max") {
      c.prompt_lookup_max = integer();
      max_set = true;
    } else if (k == "disable_by_batch_size") {
      c.disable_by_batch_size = integer();
    } else if (k == "auto_disable") {
      KV_CHECK(it->is_boolean(), where << ": auto_disable must be true or false, got " << it->dump());
      c.auto_disable = it->get<bool>();
    } else if (k == "draft_sink_tokens") {
      c.draft_sink_tokens = integer();
    } else if (k == "draft_window_tokens") {
      c.draft_window_tokens = integer();
    } else if (k == "draft_min_context_tokens") {
      c.draft_min_context_tokens = integer();
    } else if (k == "draft_policy") {
      c.draft_policy = text("a policy's name");
    } else if (k == "draft_budget") {
      c.draft_budget = integer();
    } else if (k == "draft_refresh_tokens") {
      c.draft_refresh_tokens = integer();
    } else if (k == "draft_sampling") {
      c.draft_sampling = text("greedy or sample");
      if (c.draft_sampling.empty()) c.draft_sampling = "greedy";
    } else if (k == "model") {
      c.model = text("a path");
    } else if (k == "quantization") {
      c.quantization = text("int8, int4 or a ggml type");
    } else {
      KV_FAIL(where << ": unknown key '" << k
                    << "' (method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, disable_by_batch_size, auto_disable, "
                       "draft_sink_tokens, draft_window_tokens, draft_min_context_tokens, draft_policy, draft_budget, "
                       "draft_refresh_tokens, draft_sampling, model, quantization)");
    }
  }
  // As vLLM: one bound given alone sets both.
  if (min_set && !max_set) c.prompt_lookup_max = std::max(c.prompt_lookup_max, c.prompt_lookup_min);
  if (max_set && !min_set) c.prompt_lookup_min = std::min(c.prompt_lookup_min, c.prompt_lookup_max);
  c.validate(where);
  return c;
}

std::string speculative_config_json(const SpeculativeConfig& c) {
  if (!c.enabled()) return "null";
  nlohmann::json j = {{"method", c.method},
                      {"num_speculative_tokens", c.num_speculative_tokens},
                      {"disable_by_batch_size", c.disable_by_batch_size},
                      {"auto_disable", c.auto_disable}};
  if (c.self_draft()) {
    j["draft_sink_tokens"] = c.draft_sink_tokens;
    j["draft_window_tokens"] = c.draft_window_tokens;
    j["draft_min_context_tokens"] = c.min_context_tokens();
    j["draft_sampling"] = c.draft_sampling;
    if (c.loads_draft_model()) {
      j["model"] = c.model;
      j["quantization"] = c.quantization;
    }
    if (!c.draft_policy.empty()) {
      j["draft_policy"] = c.draft_policy;
      j["draft_budget"] = c.draft_budget;
      j["draft_refresh_tokens"] = c.draft_refresh_tokens;
    }
  } else if (c.model_draft()) {
    j["model"] = c.model;
    j["quantization"] = c.quantization;
    j["draft_sampling"] = c.draft_sampling;
  } else {
    j["prompt_lookup_min"] = c.prompt_lookup_min;
    j["prompt_lookup_max"] = c.prompt_lookup_max;
  }
  return j.dump();
}

}  // namespace kvserve
