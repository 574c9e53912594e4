#pragma once
// Parsing and validation of OpenAI request bodies, apart from the transport. Every problem is an
// ApiError(400) whose `param` names the offending field; fields the server does not support or
// know are refused by the table in http/request_fields.h.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/sampling/sampling_params.h"
#include "backend/sampling/structured_output_spec.h"
#include "http/api_error.h"
#include "http/tool_calls.h"

namespace kvserve::http {

// One prompt of /v1/completions: text, or token ids given directly.
struct PromptInput {
  std::string text;
  std::vector<int64_t> token_ids;
  bool is_tokens = false;
};

enum class Endpoint { kCompletions, kChatCompletions };

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // empty = not given
  // /v1/completions
  std::vector<PromptInput> prompts;
  bool echo = false;
  // kv_context: text (or token ids) that goes before every prompt as its context: a policy with
  // `compress: context` (kvzip) compresses it alone and caches it for the next request with it.
  std::optional<PromptInput> kv_context;
  // /v1/chat/completions: messages as given (validated shape), for the chat template.
  nlohmann::json messages = nlohmann::json::array();
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  nlohmann::json chat_template_kwargs = nlohmann::json::object();
  // The last message holding a `cache_control` marker (itself or one of its content parts): the
  // context ends after it. Unset: before the last user message.
  std::optional<size_t> context_end_message;
  // both
  SamplingParams sampling;
  std::optional<int64_t> max_tokens;  // as given (sampling.max_tokens keeps its default otherwise)
  int64_t n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  // stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far.
  bool continuous_usage = false;
  // Logprobs: chat uses logprobs (bool) + top_logprobs; completions use logprobs (int).
  bool want_logprobs = false;
  int64_t top_logprobs = 0;
  std::string user;
  std::string kv_policy;  // empty = not given
  std::optional<bool> reuse_compressed;  // prefix_reuse: "compressed" = true, "exact" = false
  bool speculative = true;               // false: no speculative decoding for this request
  bool return_token_ids = false;         // vLLM's: the prompt's and each choice's token ids (also streamed)
  std::vector<std::string> bad_words;       // tokenized into sampling.bad_words_ids by the service
  std::optional<bool> add_special_tokens;   // as given (completions default true, chat false)
  // response_format / guided_* / structured_outputs (http/structured_output_request.h).
  StructuredOutputSpec structured;
  // /v1/chat/completions: tools, tool_choice, parallel_tool_calls (http/tool_calls.h).
  ToolsRequest tools;
  // Fields the endpoint does not know, ignored as vLLM ignores them (named in X-KV-Ignored-Fields).
  std::vector<std::string> ignored_fields;
};

// Limits the parser enforces (beyond types).
struct ParserLimits {
  int64_t max_n = 16;
  int64_t max_tokens = 1 << 20;
  int64_t max_stop = 16;
  int64_t max_logprobs = 20;
  int64_t max_prompts = 64;
  int64_t max_bad_words = 128;     // vLLM's per-request limit
  int64_t max_logit_bias = 1024;
  // server.strict_fields: refuse unknown fields with a 400 instead of ignoring them.
  bool strict_fields = false;
};

// Parses JSON text, reporting syntax errors, invalid UTF-8 and number overflow as ApiError(400)
// (naming the last field seen when there is one). A body must be a JSON object.
nlohmann::json parse_json_body(std::string_view body);

ParsedRequest parse_completion_request(std::string_view body, const ParserLimits& limits = {});
ParsedRequest parse_chat_request(std::string_view body, const ParserLimits& limits = {});
// Same, from an already parsed object.
ParsedRequest parse_completion_json(nlohmann::json body, const ParserLimits& limits = {});
ParsedRequest parse_chat_json(nlohmann::json body, const ParserLimits& limits = {});

}  // namespace kvserve::http
