// /tokenize and /detokenize: the tokenizer and chat template behind the API, without the engine.
#include "http/tokenize_routes.h"

#include <set>

#include "http/api_error.h"

namespace kvserve::http {

using nlohmann::json;

namespace {

// Refuses fields outside `known` (a 400 naming the first), as the generation routes do.
void check_fields(const json& body, const std::set<std::string>& known, const char* route) {
  for (const auto& [key, value] : body.items())
    if (!value.is_null() && !known.count(key))
      throw ApiError(400, "unknown or unsupported field '" + key + "' for " + route, key);
}

bool flag(const json& body, const char* key, bool fallback) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) throw ApiError(400, std::string("'") + key + "' must be a boolean", key);
  return it->get<bool>();
}

HttpResponse json_ok(const json& body) {
  HttpResponse r;
  r.body = dump_json(body);
  return r;
}

}  // namespace

HttpResponse tokenize_route(const HttpRequest& req, const ServingBackend& backend, const ParserLimits& limits) {
  json body = parse_json_body(req.body);
  const bool strs = flag(body, "return_token_strs", false);
  std::vector<int64_t> ids;
  if (body.contains("messages")) {
    check_fields(body, {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                        "return_token_strs", "chat_template_kwargs"},
                 "/tokenize (messages)");
    body.erase("return_token_strs");
    // The chat route's own parsing and template: the same prompt a chat request would get.
    const ParsedRequest chat = parse_chat_json(body, limits);
    ids = backend.encode(backend.render_chat(chat), chat.add_special_tokens.value_or(false));
  } else {
    check_fields(body, {"model", "prompt", "add_special_tokens", "return_token_strs"}, "/tokenize");
    auto p = body.find("prompt");
    if (p == body.end() || p->is_null()) throw ApiError(400, "'prompt' or 'messages' is required", "prompt");
    if (!p->is_string()) throw ApiError(400, "'prompt' must be a string", "prompt");
    ids = backend.encode(p->get<std::string>(), flag(body, "add_special_tokens", true));
  }
  json out = {{"count", ids.size()}, {"max_model_len", backend.max_model_len()}, {"tokens", ids}, {"token_strs", nullptr}};
  if (strs) out["token_strs"] = backend.token_strings(ids);
  return json_ok(out);
}

HttpResponse detokenize_route(const HttpRequest& req, const ServingBackend& backend) {
  const json body = parse_json_body(req.body);
  check_fields(body, {"model", "tokens"}, "/detokenize");
  auto t = body.find("tokens");
  if (t == body.end() || t->is_null()) throw ApiError(400, "'tokens' is required", "tokens");
  if (!t->is_array()) throw ApiError(400, "'tokens' must be an array of token ids", "tokens");
  std::vector<int64_t> ids;
  const int64_t vocab = backend.vocab_size();
  for (size_t i = 0; i < t->size(); ++i) {
    const json& v = (*t)[i];
    const std::string name = "tokens[" + std::to_string(i) + "]";
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= vocab)
      throw ApiError(400, "'" + name + "' must be a token id in [0, " + std::to_string(vocab) + ")", name);
    ids.push_back(v.get<int64_t>());
  }
  return json_ok({{"prompt", backend.decode(ids)}});
}

HttpResponse tokenizer_info_route(const ServingBackend& backend) {
  json info = json::parse(backend.tokenizer_config(), nullptr, /*allow_exceptions=*/false);
  if (!info.is_object()) info = json::object();
  info.erase("added_tokens_decoder");  // vLLM drops it too: every added token, large and unused
  // Special tokens may be written as AddedToken objects; clients read them as strings.
  for (auto it = info.begin(); it != info.end(); ++it)
    if (it.value().is_object() && it.value().contains("content") && it.value()["content"].is_string())
      it.value() = it.value()["content"];
  if (!info.contains("tokenizer_class") || !info["tokenizer_class"].is_string()) info["tokenizer_class"] = "PreTrainedTokenizerFast";
  if (const std::string t = backend.chat_template(); !t.empty()) info["chat_template"] = t;
  info["max_model_len"] = backend.max_model_len();
  return json_ok(info);
}

}  // namespace kvserve::http
