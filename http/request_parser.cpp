// OpenAI request bodies -> ParsedRequest, with a 400 naming the field for anything wrong.
#include "http/request_parser.h"

#include "http/request_fields.h"

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "http/structured_output_request.h"

namespace kvserve::http {

using nlohmann::json;

namespace {

std::string type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a number";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, param);
}

[[noreturn]] void wrong_type(const std::string& param, const char* expected, const json& got) {
  bad(param, "'" + param + "' must be " + expected + ", got " + type_name(got));
}

std::string num_str(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// Field readers: `present` = the key exists and is not null.
const json* field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

bool get_bool(const json& obj, const char* key, bool fallback) {
  const json* v = field(obj, key);
  if (!v) return fallback;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

int64_t as_int(const json& v, const std::string& name, int64_t lo, int64_t hi) {
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9e15) {
      // 3.0 is accepted as 3 (JSON does not distinguish); huge floats fall through to the range error.
      int64_t i = static_cast<int64_t>(d);
      if (i < lo || i > hi) bad(name, "'" + name + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + num_str(d));
      return i;
    }
    if (std::isfinite(d) && std::floor(d) == d)
      bad(name, "'" + name + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + num_str(d));
    wrong_type(name, "an integer", v);
  }
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(hi) || static_cast<int64_t>(u) < lo) bad(name, "'" + name + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + std::to_string(u));
    return static_cast<int64_t>(u);
  }
  if (!v.is_number_integer()) wrong_type(name, "an integer", v);
  int64_t i = v.get<int64_t>();
  if (i < lo || i > hi) bad(name, "'" + name + "' must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", got " + std::to_string(i));
  return i;
}

std::optional<int64_t> get_int(const json& obj, const char* key, int64_t lo, int64_t hi) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  return as_int(*v, key, lo, hi);
}

std::optional<double> get_number(const json& obj, const char* key, double lo, double hi, bool lo_open = false) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi || (lo_open && d == lo)) {
    bad(key, "'" + std::string(key) + "' must be " + (lo_open ? "> " : ">= ") + num_str(lo) + " and <= " + num_str(hi) + ", got " + num_str(d));
  }
  return d;
}

std::optional<std::string> get_string(const json& obj, const char* key) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(key, "a string", *v);
  return v->get<std::string>();
}

std::vector<int64_t> token_list(const json& arr, const std::string& name);

// logit_bias, allowed_token_ids, bad_words (token ids are checked against the vocabulary later).
void parse_logit_edits(const json& body, ParsedRequest& r, const ParserLimits& limits) {
  auto& s = r.sampling;
  if (const json* lb = field(body, "logit_bias")) {
    if (!lb->is_object()) wrong_type("logit_bias", "an object mapping token ids to numbers", *lb);
    if (static_cast<int64_t>(lb->size()) > limits.max_logit_bias)
      bad("logit_bias", "'logit_bias' has at most " + std::to_string(limits.max_logit_bias) + " entries");
    std::map<int64_t, double> bias;  // "7" and "07" name one token: one entry
    for (const auto& [key, value] : lb->items()) {
      const std::string name = "logit_bias." + key;
      if (key.empty() || key.size() > 10 || key.find_first_not_of("0123456789") != std::string::npos)
        bad("logit_bias", "'logit_bias' keys must be token ids (decimal integers), got '" + key + "'");
      if (!value.is_number()) wrong_type(name, "a number", value);
      const double b = value.get<double>();
      if (!std::isfinite(b) || b < -100.0 || b > 100.0)
        bad("logit_bias", "'" + name + "' must be between -100 and 100, got " + num_str(b));
      bias[std::stoll(key)] = b;
    }
    s.logit_bias.assign(bias.begin(), bias.end());
  }
  if (const json* ids = field(body, "allowed_token_ids")) {
    if (!ids->is_array()) wrong_type("allowed_token_ids", "an array of token ids", *ids);
    if (ids->empty()) bad("allowed_token_ids", "'allowed_token_ids' must not be empty");
    s.allowed_token_ids = token_list(*ids, "allowed_token_ids");
  }
  if (const json* words = field(body, "bad_words")) {
    if (!words->is_array()) wrong_type("bad_words", "an array of strings", *words);
    if (static_cast<int64_t>(words->size()) > limits.max_bad_words)
      bad("bad_words", "'bad_words' has at most " + std::to_string(limits.max_bad_words) + " entries");
    for (size_t i = 0; i < words->size(); ++i) {
      const json& w = (*words)[i];
      const std::string name = "bad_words[" + std::to_string(i) + "]";
      if (!w.is_string()) wrong_type(name, "a string", w);
      if (w.get<std::string>().find_first_not_of(" \t\n\r\f\v") == std::string::npos)
        bad(name, "'" + name + "' must contain a non-space character");
      r.bad_words.push_back(w.get<std::string>());
    }
  }
}

// Fields common to both endpoints.
void parse_common(const json& body, ParsedRequest& r, const ParserLimits& limits) {
  if (auto m = get_string(body, "model")) r.model = *m;
  r.stream = get_bool(body, "stream", false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    if (!r.stream) bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    for (const auto& [key, value] : so->items()) {
      const std::string name = "stream_options." + key;
      if (key != "include_usage" && key != "continuous_usage_stats")
        bad(name, "unknown field '" + name + "' (stream_options takes include_usage and continuous_usage_stats)");
      if (value.is_null()) continue;
      if (!value.is_boolean()) wrong_type(name, "a boolean", value);
      (key == "include_usage" ? r.include_usage : r.continuous_usage) = value.get<bool>();
    }
    // continuous_usage_stats alone implies include_usage (vLLM's stream_options default it to true);
    // an explicit include_usage: false turns both off, as in vLLM.
    const auto iu = so->find("include_usage");
    if (iu == so->end() || iu->is_null()) r.include_usage = r.continuous_usage;
    r.continuous_usage = r.continuous_usage && r.include_usage;
  }
  auto& s = r.sampling;
  if (auto n = get_int(body, "n", 1, limits.max_n)) r.n = *n;
  if (const json* best_of = field(body, "best_of")) {
    int64_t b = as_int(*best_of, "best_of", 1, limits.max_n);
    if (b != r.n) bad("best_of", "'best_of' different from 'n' is not supported");
  }
  if (auto v = get_number(body, "temperature", 0.0, 2.0)) s.temperature = *v;
  if (auto v = get_number(body, "top_p", 0.0, 1.0, /*lo_open=*/true)) s.top_p = *v;
  if (auto v = get_int(body, "top_k", -1, int64_t{1} << 31)) s.top_k = *v < 0 ? 0 : *v;
  if (auto v = get_number(body, "min_p", 0.0, 1.0)) s.min_p = *v;
  if (auto v = get_number(body, "presence_penalty", -2.0, 2.0)) s.presence_penalty = *v;
  if (auto v = get_number(body, "frequency_penalty", -2.0, 2.0)) s.frequency_penalty = *v;
  if (auto v = get_number(body, "repetition_penalty", 0.0, 10.0, /*lo_open=*/true)) s.repetition_penalty = *v;
  if (auto v = get_int(body, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()))
    s.seed = static_cast<uint64_t>(*v);

  // max_completion_tokens (chat, newer) wins over max_tokens.
  // 0 only for a completion's echo (checked there): the prompt comes back without new text.
  std::optional<int64_t> max_tokens = get_int(body, "max_tokens", 0, limits.max_tokens);
  if (auto mct = get_int(body, "max_completion_tokens", 1, limits.max_tokens)) max_tokens = mct;
  if (max_tokens) s.max_tokens = *max_tokens;
  r.max_tokens = max_tokens;
  if (auto v = get_int(body, "min_tokens", 0, limits.max_tokens)) {
    s.min_tokens = *v;
    if (max_tokens && *v > *max_tokens) bad("min_tokens", "'min_tokens' must not exceed 'max_tokens'");
  }

  if (const json* stop = field(body, "stop")) {
    if (stop->is_string()) {
      if (stop->get<std::string>().empty()) bad("stop", "'stop' must not be an empty string");
      s.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (static_cast<int64_t>(stop->size()) > limits.max_stop)
        bad("stop", "'stop' has at most " + std::to_string(limits.max_stop) + " entries");
      for (size_t i = 0; i < stop->size(); ++i) {
        const json& e = (*stop)[i];
        std::string name = "stop[" + std::to_string(i) + "]";
        if (!e.is_string()) wrong_type(name, "a string", e);
        if (e.get<std::string>().empty()) bad(name, "'" + name + "' must not be an empty string");
        s.stop.push_back(e.get<std::string>());
      }
    } else {
      wrong_type("stop", "a string or an array of strings", *stop);
    }
  }
  if (const json* ids = field(body, "stop_token_ids")) {
    if (!ids->is_array()) wrong_type("stop_token_ids", "an array of integers", *ids);
    for (size_t i = 0; i < ids->size(); ++i)
      s.stop_token_ids.push_back(as_int((*ids)[i], "stop_token_ids[" + std::to_string(i) + "]", 0, int64_t{1} << 31));
  }
  s.ignore_eos = get_bool(body, "ignore_eos", false);
  s.include_stop_str_in_output = get_bool(body, "include_stop_str_in_output", false);
  s.skip_special_tokens = get_bool(body, "skip_special_tokens", true);
  if (auto u = get_string(body, "user")) r.user = *u;
  if (auto p = get_string(body, "kv_policy")) {
    if (p->empty()) bad("kv_policy", "'kv_policy' must not be empty");
    r.kv_policy = *p;
  }
  r.return_token_ids = get_bool(body, "return_token_ids", false);
  r.speculative = get_bool(body, "speculative", true);
  if (auto p = get_string(body, "prefix_reuse")) {
    if (*p != "exact" && *p != "compressed")
      bad("prefix_reuse", "'prefix_reuse' must be \"exact\" or \"compressed\", got \"" + *p + "\"");
    r.reuse_compressed = *p == "compressed";
  }
  parse_logit_edits(body, r, limits);
  if (auto k = get_int(body, "prompt_logprobs", 0, limits.max_logprobs)) {
    if (r.stream) bad("prompt_logprobs", "'prompt_logprobs' are not available when 'stream' is true");
    s.prompt_logprobs = *k;
  }
  if (field(body, "add_special_tokens")) r.add_special_tokens = get_bool(body, "add_special_tokens", false);
  r.structured = parse_structured_output(body);
}

std::vector<int64_t> token_list(const json& arr, const std::string& name) {
  std::vector<int64_t> out;
  out.reserve(arr.size());
  for (size_t i = 0; i < arr.size(); ++i)
    out.push_back(as_int(arr[i], name + "[" + std::to_string(i) + "]", 0, int64_t{1} << 31));
  return out;
}

void parse_prompt(const json& body, ParsedRequest& r, const ParserLimits& limits) {
  const json* p = field(body, "prompt");
  if (!p) bad("prompt", "'prompt' is required");
  if (p->is_string()) {
    r.prompts.push_back({p->get<std::string>(), {}, false});
  } else if (p->is_array()) {
    if (p->empty()) bad("prompt", "'prompt' must not be empty");
    if ((*p)[0].is_number()) {
      PromptInput in;
      in.is_tokens = true;
      in.token_ids = token_list(*p, "prompt");
      r.prompts.push_back(std::move(in));
    } else {
      if (static_cast<int64_t>(p->size()) > limits.max_prompts)
        bad("prompt", "'prompt' has at most " + std::to_string(limits.max_prompts) + " entries");
      for (size_t i = 0; i < p->size(); ++i) {
        const json& e = (*p)[i];
        std::string name = "prompt[" + std::to_string(i) + "]";
        if (e.is_string()) {
          r.prompts.push_back({e.get<std::string>(), {}, false});
        } else if (e.is_array()) {
          if (e.empty()) bad(name, "'" + name + "' must not be empty");
          PromptInput in;
          in.is_tokens = true;
          in.token_ids = token_list(e, name);
          r.prompts.push_back(std::move(in));
        } else {
          wrong_type(name, "a string or an array of token ids", e);
        }
      }
    }
  } else {
    wrong_type("prompt", "a string, an array of strings or an array of token ids", *p);
  }
  if (static_cast<int64_t>(r.prompts.size() * r.n) > limits.max_prompts)
    bad("n", "'n' times the number of prompts must be at most " + std::to_string(limits.max_prompts));
}

void parse_kv_context(const json& body, ParsedRequest& r) {
  const json* c = field(body, "kv_context");
  if (!c) return;
  PromptInput in;
  if (c->is_string()) {
    if (c->get<std::string>().empty()) bad("kv_context", "'kv_context' must not be empty");
    in.text = c->get<std::string>();
  } else if (c->is_array() && !c->empty() && (*c)[0].is_number()) {
    in.is_tokens = true;
    in.token_ids = token_list(*c, "kv_context");
  } else {
    wrong_type("kv_context", "a non-empty string or array of token ids", *c);
  }
  r.kv_context = std::move(in);
}

// Anthropic-style prompt-caching marker: {"type": "ephemeral"} (a ttl is accepted and ignored: the
// pool's LRU decides how long a context stays).
bool cache_marker(const json& holder, const std::string& name) {
  auto m = holder.find("cache_control");
  if (m == holder.end() || m->is_null()) return false;
  if (!m->is_object()) wrong_type(name + ".cache_control", "an object", *m);
  auto t = m->find("type");
  if (t == m->end() || !t->is_string() || t->get<std::string>() != "ephemeral")
    bad(name + ".cache_control.type", "'" + name + ".cache_control.type' must be \"ephemeral\"");
  return true;
}

const std::set<std::string> kRoles = {"system", "developer", "user", "assistant", "tool"};

void parse_messages(const json& body, ParsedRequest& r) {
  const json* m = field(body, "messages");
  if (!m) bad("messages", "'messages' is required");
  if (!m->is_array()) wrong_type("messages", "an array", *m);
  if (m->empty()) bad("messages", "'messages' must not be empty");
  r.messages = json::array();
  for (size_t i = 0; i < m->size(); ++i) {
    const json& msg = (*m)[i];
    const std::string name = "messages[" + std::to_string(i) + "]";
    if (!msg.is_object()) wrong_type(name, "an object", msg);
    json out = msg;
    auto role = msg.find("role");
    if (role == msg.end() || role->is_null()) bad(name + ".role", "'" + name + ".role' is required");
    if (!role->is_string()) wrong_type(name + ".role", "a string", *role);
    if (!kRoles.count(role->get<std::string>()))
      bad(name + ".role", "'" + name + ".role' must be one of system, developer, user, assistant, tool; got '" +
                              role->get<std::string>() + "'");
    if (cache_marker(msg, name)) r.context_end_message = i;
    out.erase("cache_control");
    auto content = msg.find("content");
    if (content == msg.end() || content->is_null()) {
      if (role->get<std::string>() != "assistant") bad(name + ".content", "'" + name + ".content' is required");
      out["content"] = "";
    } else if (content->is_array()) {
      // Content parts: text parts are joined (as vLLM does); anything else is not supported.
      std::string text;
      for (size_t j = 0; j < content->size(); ++j) {
        const json& part = (*content)[j];
        const std::string pname = name + ".content[" + std::to_string(j) + "]";
        if (!part.is_object()) wrong_type(pname, "an object", part);
        auto type = part.find("type");
        if (type == part.end() || !type->is_string()) bad(pname + ".type", "'" + pname + ".type' is required");
        if (type->get<std::string>() != "text")
          bad(pname + ".type", "content part type '" + type->get<std::string>() + "' is not supported (text only)");
        auto t = part.find("text");
        if (t == part.end() || !t->is_string()) bad(pname + ".text", "'" + pname + ".text' must be a string");
        if (cache_marker(part, pname)) r.context_end_message = i;
        if (!text.empty()) text += "\n";
        text += t->get<std::string>();
      }
      out["content"] = text;
    } else if (!content->is_string()) {
      wrong_type(name + ".content", "a string or an array of content parts", *content);
    }
    if (auto n = msg.find("name"); n != msg.end() && !n->is_null() && !n->is_string())
      wrong_type(name + ".name", "a string", *n);
    r.messages.push_back(std::move(out));
  }
}

}  // namespace

json parse_json_body(std::string_view body) {
  if (body.empty()) throw ApiError(400, "the request body is empty; expected a JSON object");
  std::string last_key;
  json j;
  try {
    j = json::parse(body.begin(), body.end(), [&](int /*depth*/, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::key) last_key = parsed.get<std::string>();
      return true;
    });
  } catch (const json::exception& e) {
    std::string msg = e.what();
    // Drop nlohmann's "[json.exception.parse_error.101] " prefix.
    if (auto pos = msg.find("] "); pos != std::string::npos && msg.rfind("[json.exception", 0) == 0) msg = msg.substr(pos + 2);
    if (!last_key.empty())
      throw ApiError(400, "invalid JSON in the request body (after field '" + last_key + "'): " + msg, last_key);
    throw ApiError(400, "invalid JSON in the request body: " + msg);
  }
  if (!j.is_object()) throw ApiError(400, "the request body must be a JSON object, got " + type_name(j));
  return j;
}

ParsedRequest parse_completion_json(json body, const ParserLimits& limits) {
  ParsedRequest r;
  r.endpoint = Endpoint::kCompletions;
  r.ignored_fields = check_request_fields(body, r.endpoint, limits.strict_fields);
  parse_common(body, r, limits);
  parse_prompt(body, r, limits);
  parse_kv_context(body, r);
  r.echo = get_bool(body, "echo", false);
  if (r.max_tokens == 0 && !r.echo)
    bad("max_tokens", "'max_tokens' must be between 1 and " + std::to_string(limits.max_tokens) + ", got 0 (0 only with 'echo': the prompt alone)");
  if (auto lp = get_int(body, "logprobs", 0, limits.max_logprobs)) {
    r.want_logprobs = true;
    r.top_logprobs = *lp;
  }
  r.sampling.logprobs = r.want_logprobs ? r.top_logprobs : -1;
  // As vLLM: echo with logprobs scores the prompt too (what evaluation harnesses read).
  if (r.echo && r.want_logprobs && r.sampling.prompt_logprobs < 0) r.sampling.prompt_logprobs = r.top_logprobs;
  return r;
}

ParsedRequest parse_chat_json(json body, const ParserLimits& limits) {
  ParsedRequest r;
  r.endpoint = Endpoint::kChatCompletions;
  r.ignored_fields = check_request_fields(body, r.endpoint, limits.strict_fields);
  parse_common(body, r, limits);
  if (r.max_tokens == 0) bad("max_tokens", "'max_tokens' must be between 1 and " + std::to_string(limits.max_tokens) + ", got 0");
  parse_messages(body, r);
  r.want_logprobs = get_bool(body, "logprobs", false);
  if (auto t = get_int(body, "top_logprobs", 0, limits.max_logprobs)) {
    if (!r.want_logprobs) bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
    r.top_logprobs = *t;
  }
  r.sampling.logprobs = r.want_logprobs ? r.top_logprobs : -1;
  r.add_generation_prompt = get_bool(body, "add_generation_prompt", true);
  r.continue_final_message = get_bool(body, "continue_final_message", false);
  if (r.continue_final_message && r.add_generation_prompt && field(body, "add_generation_prompt"))
    bad("continue_final_message", "'continue_final_message' and 'add_generation_prompt' cannot both be true");
  if (r.continue_final_message) r.add_generation_prompt = false;
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object", *kw);
    r.chat_template_kwargs = *kw;
  }
  r.tools = parse_tools(body);
  return r;
}

ParsedRequest parse_completion_request(std::string_view body, const ParserLimits& limits) {
  ParsedRequest r = parse_completion_json(parse_json_body(body), limits);
  keep_schema_key_order(r.structured, body);
  return r;
}

ParsedRequest parse_chat_request(std::string_view body, const ParserLimits& limits) {
  ParsedRequest r = parse_chat_json(parse_json_body(body), limits);
  keep_schema_key_order(r.structured, body);
  return r;
}

}  // namespace kvserve::http
