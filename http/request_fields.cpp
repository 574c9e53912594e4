// The table of request fields, and the check that refuses what it does not support.
#include "http/request_fields.h"

#include <algorithm>
#include <map>

namespace kvserve::http {

namespace {

constexpr FieldSupport S = FieldSupport::kSupported;
constexpr FieldSupport R = FieldSupport::kRefused;
constexpr FieldSupport U = FieldSupport::kUnknown;

// Structured outputs (http/structured_output_request.h) and tool calls (http/tool_calls.h).
#define KV_GRAMMAR "compiled by xgrammar into per-token masks"

const std::vector<RequestField> kFields = {
    // OpenAI fields.
    {"model", S, S, "", "must name the served model"},
    {"prompt", S, U, "", "text, texts, token ids or lists of token ids"},
    {"messages", U, S, "", "text content parts only"},
    {"echo", S, R, "[false]", "completions: the prompt before the text, also streamed; chat: vLLM's role echo is not supported"},
    {"frequency_penalty", S, S, "", ""},
    {"presence_penalty", S, S, "", ""},
    {"logit_bias", S, S, "", "token-id strings to values in [-100, 100]"},
    {"logprobs", S, S, "", "completions: top-k count; chat: a boolean"},
    {"top_logprobs", U, S, "", ""},
    {"max_tokens", S, S, "", "completions: 0 with echo returns the prompt only"},
    {"max_completion_tokens", U, S, "", "wins over max_tokens"},
    {"n", S, S, "", ""},
    {"best_of", S, U, "", "only equal to n"},
    {"seed", S, S, "", ""},
    {"stop", S, S, "", ""},
    {"stream", S, S, "", ""},
    {"stream_options", S, S, "", "include_usage; continuous_usage_stats (usage in every chunk)"},
    {"suffix", R, U, "", "no fill-in-the-middle"},
    {"temperature", S, S, "", ""},
    {"top_p", S, S, "", ""},
    {"user", S, S, "", "kept for rollout rules and logs"},
    {"response_format", S, S, "", "text, json_object, json_schema (strict): " KV_GRAMMAR},
    {"tools", U, S, "", "passed to the chat template; calls parsed into tool_calls (server.tool_call_parser)"},
    {"tool_choice", U, S, "", "none, auto, required, a named function (required/named: " KV_GRAMMAR ")"},
    {"parallel_tool_calls", U, S, "", ""},
    {"functions", U, R, "[[]]", "deprecated function calling"},
    {"function_call", U, R, "[\"none\"]", "deprecated function calling"},
    {"reasoning_effort", U, R, "", "no reasoning models"},
    {"modalities", U, R, "[[\"text\"]]", "text only"},
    {"audio", U, R, "", "text only"},
    {"prediction", U, R, "", "no predicted outputs"},
    {"store", U, R, "[false]", "nothing is stored"},
    {"metadata", U, R, "", "nothing is stored"},
    {"service_tier", U, R, "", ""},
    {"web_search_options", U, R, "", ""},
    {"verbosity", U, R, "", ""},
    {"prompt_cache_key", U, R, "", ""},
    {"safety_identifier", U, R, "", ""},
    // vLLM's sampling parameters.
    {"use_beam_search", R, R, "[false]", "no beam search"},
    {"top_k", S, S, "", ""},
    {"min_p", S, S, "", ""},
    {"repetition_penalty", S, S, "", ""},
    {"length_penalty", R, R, "[1]", "beam search only"},
    {"stop_token_ids", S, S, "", ""},
    {"include_stop_str_in_output", S, S, "", ""},
    {"ignore_eos", S, S, "", ""},
    {"min_tokens", S, S, "", ""},
    {"skip_special_tokens", S, S, "", ""},
    {"spaces_between_special_tokens", R, R, "[true]", "special tokens are decoded without extra spaces"},
    {"truncate_prompt_tokens", R, R, "", "prompts are not truncated: a prompt that does not fit is a 400"},
    {"prompt_logprobs", S, S, "", "non-streaming; needs the single-process runtime"},
    {"allowed_token_ids", S, S, "", ""},
    {"bad_words", S, S, "", "as vLLM: each word alone and after a space"},
    {"include_reasoning", U, R, "[true]", "no reasoning parser"},
    // vLLM's extra parameters.
    {"add_generation_prompt", U, S, "", ""},
    {"continue_final_message", U, S, "", ""},
    {"add_special_tokens", S, S, "", "completions default true, chat false"},
    {"documents", U, R, "", "no RAG documents in the chat template"},
    {"chat_template", U, R, "", "the model's template only"},
    {"chat_template_kwargs", U, S, "", ""},
    {"mm_processor_kwargs", U, R, "", "text only"},
    {"prompt_embeds", R, U, "", "token ids or text only"},
    {"structured_outputs", S, S, "", KV_GRAMMAR},
    {"guided_json", S, S, "", KV_GRAMMAR},
    {"guided_regex", S, S, "", KV_GRAMMAR},
    {"guided_choice", S, S, "", KV_GRAMMAR},
    {"guided_grammar", S, S, "", KV_GRAMMAR},
    {"guided_decoding_backend", R, R, "[\"xgrammar\", \"auto\"]", "xgrammar only"},
    {"guided_whitespace_pattern", R, R, "", "JSON is generated without free whitespace"},
    {"structural_tag", R, R, "", "no structural tags"},
    {"priority", R, R, "[0]", "first come, first served"},
    {"request_id", R, R, "", "ids come from the server (X-Request-Id echoes the client's header)"},
    {"logits_processors", R, R, "", "no custom logits processors"},
    {"return_tokens_as_token_ids", R, R, "[false]", ""},
    {"return_token_ids", S, S, "", "prompt_token_ids and token_ids, also streamed"},
    {"cache_salt", R, R, "", ""},
    {"kv_transfer_params", R, R, "", "no disaggregated serving"},
    {"vllm_xargs", R, R, "", "no extensions"},
    {"max_repetition_pattern_size", R, R, "[0]", ""},
    {"min_repetition_pattern_size", R, R, "[0]", ""},
    {"repetition_min_count", R, R, "[0]", ""},
    // kvserve's own.
    {"kv_policy", S, S, "", "kvserve: a configured KV policy"},
    {"prefix_reuse", S, S, "", "kvserve: exact, or compressed (continue the conversation's compressed KV)"},
    {"kv_context", S, U, "", "kvserve: the prompts' shared context, compressed once under compress: context"},
    {"speculative", S, S, "", "kvserve: false decodes this request without the server's speculative decoding"},
};

#undef KV_GRAMMAR

const std::map<std::string, const RequestField*>& by_name() {
  static const std::map<std::string, const RequestField*> m = [] {
    std::map<std::string, const RequestField*> out;
    for (const auto& f : kFields) out[f.name] = &f;
    return out;
  }();
  return m;
}

std::string status_text(FieldSupport s, const char* no_ops) {
  switch (s) {
    case FieldSupport::kSupported: return "yes";
    case FieldSupport::kUnknown: return "-";
    case FieldSupport::kRefused: break;
  }
  if (!*no_ops) return "400";
  std::string values;
  for (const auto& v : nlohmann::json::parse(no_ops)) values += (values.empty() ? "`" : ", `") + v.dump() + "`";
  return "400 unless " + values;
}

}  // namespace

const std::vector<RequestField>& request_fields() { return kFields; }

std::vector<std::string> check_request_fields(nlohmann::json& body, Endpoint endpoint, bool strict) {
  const char* route = endpoint == Endpoint::kChatCompletions ? "/v1/chat/completions" : "/v1/completions";
  std::vector<std::string> ignored;
  for (const auto& [key, value] : body.items()) {
    if (value.is_null()) continue;
    auto it = by_name().find(key);
    const FieldSupport s = it == by_name().end() ? FieldSupport::kUnknown
                           : endpoint == Endpoint::kChatCompletions ? it->second->chat
                                                                    : it->second->completions;
    if (s == FieldSupport::kSupported) continue;
    if (it == by_name().end()) {
      if (strict)
        throw ApiError(400, "unknown field '" + key + "' for " + route + " (server.strict_fields: true refuses fields kvserve does not know)", key);
      ignored.push_back(key);
      continue;
    }
    if (s == FieldSupport::kUnknown)
      throw ApiError(400, "'" + key + "' is not a field of " + route + " (it belongs to the other endpoint)", key);
    const RequestField& f = *it->second;
    if (*f.no_ops) {
      const auto no_ops = nlohmann::json::parse(f.no_ops);
      if (std::find(no_ops.begin(), no_ops.end(), value) != no_ops.end()) continue;
    }
    throw ApiError(400, "'" + key + "' is not supported by kvserve" + (*f.note ? std::string(": ") + f.note : std::string()), key);
  }
  for (const auto& key : ignored) body.erase(key);
  return ignored;
}

std::string request_fields_markdown() {
  std::string out = "| field | /v1/completions | /v1/chat/completions | notes |\n|---|---|---|---|\n";
  for (const auto& f : kFields)
    out += std::string("| `") + f.name + "` | " + status_text(f.completions, f.no_ops) + " | " +
           status_text(f.chat, f.no_ops) + " | " + f.note + " |\n";
  return out;
}

}  // namespace kvserve::http
