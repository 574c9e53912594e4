#include "http/tool_calls.h"

#include <random>
#include <regex>
#include <utility>

#include "http/api_error.h"

namespace kvserve::http {

using nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string& field, const std::string& why) { throw ApiError(400, why, field); }

const json* present(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

// The markers a format's calls start with ("" for Llama 3.1 JSON: a bare object).
const char* start_marker(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kHermes: return "<tool_call>";
    case ToolCallFormat::kMistral: return "[TOOL_CALLS]";
    case ToolCallFormat::kLlama3Json: break;
  }
  return "";
}

std::string call_id() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdef";
  std::string s = "call_";
  for (int i = 0; i < 24; ++i) s += digits[rng() & 15];
  return s;
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(" \t\r\n") - a + 1);
}

// One call object {"name": ..., "arguments" | "parameters": {...}}; nullopt when it is not one.
std::optional<ToolCall> call_from(const json& j) {
  if (!j.is_object()) return std::nullopt;
  auto n = j.find("name");
  if (n == j.end() || !n->is_string() || n->get<std::string>().empty()) return std::nullopt;
  const json* args = present(j, "arguments");
  if (!args) args = present(j, "parameters");
  ToolCall c{call_id(), n->get<std::string>(), "{}"};
  if (args) c.arguments = args->is_string() ? args->get<std::string>() : args->dump();
  return c;
}

// Calls from JSON text holding one call object or an array of them.
std::optional<std::vector<ToolCall>> calls_from_text(const std::string& text) {
  const auto j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  std::vector<ToolCall> out;
  if (j.is_array()) {
    for (const auto& e : j) {
      auto c = call_from(e);
      if (!c) return std::nullopt;
      out.push_back(std::move(*c));
    }
    if (out.empty()) return std::nullopt;
    return out;
  }
  auto c = call_from(j);
  if (!c) return std::nullopt;
  out.push_back(std::move(*c));
  return out;
}

json function_schema(const json& tool, const char* args_key) {
  const json& f = tool["function"];
  const json* params = present(f, "parameters");
  return {{"type", "object"},
          {"properties", {{"name", {{"enum", json::array({f["name"]})}}}, {args_key, params ? *params : json{{"type", "object"}}}}},
          {"required", json::array({"name", args_key})}};
}

}  // namespace

std::optional<ToolCallFormat> tool_call_format_named(const std::string& name) {
  if (name == "hermes") return ToolCallFormat::kHermes;
  if (name == "llama3_json") return ToolCallFormat::kLlama3Json;
  if (name == "mistral") return ToolCallFormat::kMistral;
  return std::nullopt;
}

const char* tool_call_format_name(ToolCallFormat f) {
  switch (f) {
    case ToolCallFormat::kHermes: return "hermes";
    case ToolCallFormat::kLlama3Json: return "llama3_json";
    case ToolCallFormat::kMistral: return "mistral";
  }
  return "hermes";
}

ToolCallFormat detect_tool_call_format(const std::string& t) {
  if (t.find("<tool_call>") != std::string::npos) return ToolCallFormat::kHermes;
  if (t.find("[TOOL_CALLS]") != std::string::npos) return ToolCallFormat::kMistral;
  if (t.find("<|python_tag|>") != std::string::npos || t.find("Environment: ipython") != std::string::npos)
    return ToolCallFormat::kLlama3Json;
  return ToolCallFormat::kHermes;
}

ToolsRequest parse_tools(const json& body) {
  ToolsRequest r;
  // Their defaults ([] and "none") are no-ops, as in the request-field table (http/request_fields.cpp).
  if (const json* f = present(body, "functions"); f && !(f->is_array() && f->empty()))
    fail("functions", "'functions' is deprecated and not supported; use 'tools'");
  if (const json* f = present(body, "function_call"); f && *f != "none")
    fail("function_call", "'function_call' is deprecated and not supported; use 'tool_choice'");
  if (const json* tools = present(body, "tools")) {
    if (!tools->is_array()) fail("tools", "'tools' must be an array");
    static const std::regex kName("[a-zA-Z0-9_-]{1,64}");
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string at = "tools[" + std::to_string(i) + "]";
      if (!t.is_object()) fail(at, "'" + at + "' must be an object");
      const json* type = present(t, "type");
      if (!type || *type != "function") fail(at + ".type", "'" + at + ".type' must be \"function\"");
      const json* f = present(t, "function");
      if (!f || !f->is_object()) fail(at + ".function", "'" + at + ".function' must be an object");
      const json* name = present(*f, "name");
      if (!name || !name->is_string()) fail(at + ".function.name", "'" + at + ".function.name' is required");
      if (!std::regex_match(name->get<std::string>(), kName))
        fail(at + ".function.name", "'" + at + ".function.name' must be 1 to 64 of a-z, A-Z, 0-9, _ and -");
      if (const json* d = present(*f, "description"); d && !d->is_string())
        fail(at + ".function.description", "'" + at + ".function.description' must be a string");
      if (const json* p = present(*f, "parameters"); p && !p->is_object())
        fail(at + ".function.parameters", "'" + at + ".function.parameters' must be a JSON schema object");
      if (const json* s = present(*f, "strict"); s && !s->is_boolean())
        fail(at + ".function.strict", "'" + at + ".function.strict' must be a boolean");
      for (size_t k = 0; k < i; ++k)
        if ((*tools)[k]["function"]["name"] == *name)
          fail(at + ".function.name", "two tools are named '" + name->get<std::string>() + "'");
    }
    r.tools = *tools;
  }
  r.choice = r.tools.empty() ? ToolsRequest::Choice::kNone : ToolsRequest::Choice::kAuto;
  if (const json* c = present(body, "tool_choice")) {
    if (c->is_string()) {
      const std::string s = c->get<std::string>();
      if (s == "none") r.choice = ToolsRequest::Choice::kNone;
      else if (s == "auto") r.choice = ToolsRequest::Choice::kAuto;
      else if (s == "required") r.choice = ToolsRequest::Choice::kRequired;
      else fail("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or a named function; got '" + s + "'");
    } else if (c->is_object()) {
      const json* f = present(*c, "function");
      const json* name = f && f->is_object() ? present(*f, "name") : nullptr;
      if (!name || !name->is_string()) fail("tool_choice.function.name", "'tool_choice.function.name' is required");
      r.choice = ToolsRequest::Choice::kNamed;
      r.named = name->get<std::string>();
      bool known = false;
      for (const auto& t : r.tools) known = known || t["function"]["name"] == r.named;
      if (!known) fail("tool_choice.function.name", "'tool_choice' names '" + r.named + "', which is not in 'tools'");
    } else {
      fail("tool_choice", "'tool_choice' must be a string or an object");
    }
    if (r.tools.empty() && r.choice != ToolsRequest::Choice::kNone)
      fail("tool_choice", "'tool_choice' needs 'tools'");
  }
  if (const json* p = present(body, "parallel_tool_calls")) {
    if (!p->is_boolean()) fail("parallel_tool_calls", "'parallel_tool_calls' must be a boolean");
    r.parallel = p->get<bool>();
  }
  return r;
}

StructuredOutputSpec forced_tool_call_spec(const ToolsRequest& tools, ToolCallFormat format) {
  const char* args_key = format == ToolCallFormat::kLlama3Json ? "parameters" : "arguments";
  json schema;
  if (tools.choice == ToolsRequest::Choice::kNamed) {
    for (const auto& t : tools.tools)
      if (t["function"]["name"] == tools.named) schema = function_schema(t, args_key);
  } else {
    json any = json::array();
    for (const auto& t : tools.tools) any.push_back(function_schema(t, args_key));
    schema = any.size() == 1 ? any[0] : json{{"anyOf", any}};
  }
  StructuredOutputSpec s;
  s.kind = StructuredOutputSpec::Kind::kToolCall;
  s.field = tools.choice == ToolsRequest::Choice::kNamed ? "tool_choice" : "tools";
  s.text = schema.dump();
  switch (format) {
    case ToolCallFormat::kHermes: s.prefix = "<tool_call>\n", s.suffix = "\n</tool_call>"; break;
    // [TOOL_CALLS] is a special token a grammar cannot write: the forced call is the bare list.
    case ToolCallFormat::kMistral: s.prefix = "[", s.suffix = "]"; break;
    case ToolCallFormat::kLlama3Json: break;
  }
  return s;
}

json template_messages(const json& messages) {
  json out = messages;
  for (auto& m : out) {
    auto tc = m.find("tool_calls");
    if (tc == m.end() || !tc->is_array()) continue;
    for (auto& call : *tc) {
      if (!call.is_object() || !call.contains("function") || !call["function"].is_object()) continue;
      json& f = call["function"];
      if (f.contains("arguments") && f["arguments"].is_string()) {
        auto parsed = json::parse(f["arguments"].get<std::string>(), nullptr, /*allow_exceptions=*/false);
        if (!parsed.is_discarded()) f["arguments"] = parsed;
      }
    }
  }
  return out;
}

ToolCallOutput parse_tool_calls(const std::string& text, ToolCallFormat format) {
  ToolCallOutput out;
  switch (format) {
    case ToolCallFormat::kHermes: {
      static const std::string open = "<tool_call>", close = "</tool_call>";
      size_t at = 0;
      std::string content;
      std::vector<ToolCall> calls;
      while (true) {
        const size_t s = text.find(open, at);
        if (s == std::string::npos) {
          content += text.substr(at);
          break;
        }
        content += text.substr(at, s - at);
        const size_t e = text.find(close, s + open.size());
        const std::string body = text.substr(s + open.size(), e == std::string::npos ? std::string::npos : e - s - open.size());
        auto c = calls_from_text(trim(body));
        if (!c) return {text, {}};  // not a call after all: all of it is content
        for (auto& x : *c) calls.push_back(std::move(x));
        if (e == std::string::npos) break;
        at = e + close.size();
      }
      out.content = trim(content).empty() ? "" : content;
      out.calls = std::move(calls);
      return out;
    }
    case ToolCallFormat::kMistral: {
      const std::string marker = start_marker(format);
      const size_t s = text.find(marker);
      std::string body = s == std::string::npos ? trim(text) : trim(text.substr(s + marker.size()));
      if (s == std::string::npos && (body.empty() || body[0] != '[')) return {text, {}};
      auto c = calls_from_text(body);
      if (!c) return {text, {}};
      out.content = s == std::string::npos || trim(text.substr(0, s)).empty() ? "" : text.substr(0, s);
      out.calls = std::move(*c);
      return out;
    }
    case ToolCallFormat::kLlama3Json: {
      std::string body = trim(text);
      static const std::string tag = "<|python_tag|>";
      if (body.rfind(tag, 0) == 0) body = trim(body.substr(tag.size()));
      if (body.empty() || body[0] != '{') return {text, {}};
      // One object, or several separated by ';'.
      if (auto c = calls_from_text(body)) {
        out.calls = std::move(*c);
        return out;
      }
      std::vector<ToolCall> calls;
      size_t at = 0;
      while (at <= body.size()) {
        const size_t semi = body.find(';', at);
        auto c = calls_from_text(trim(body.substr(at, semi == std::string::npos ? std::string::npos : semi - at)));
        if (!c) return {text, {}};
        for (auto& x : *c) calls.push_back(std::move(x));
        if (semi == std::string::npos) break;
        at = semi + 1;
      }
      out.calls = std::move(calls);
      return out;
    }
  }
  return {text, {}};
}

std::string ToolCallStream::feed(const std::string& delta) {
  held_ += delta;
  if (holding_) return "";
  if (format_ == ToolCallFormat::kLlama3Json) {
    if (seen_text_) {
      std::string out;
      out.swap(held_);
      return out;
    }
    const std::string t = trim(held_);
    static const std::string tag = "<|python_tag|>";
    if (t.empty()) return "";
    if (t[0] == '{' || t.rfind(tag, 0) == 0) {
      holding_ = true;
      return "";
    }
    if (tag.rfind(t, 0) == 0) return "";  // may still become the tag
    seen_text_ = true;
    std::string out;
    out.swap(held_);
    return out;
  }
  const std::string marker = start_marker(format_);
  const size_t at = held_.find(marker);
  if (at != std::string::npos) {
    holding_ = true;
    std::string out = held_.substr(0, at);
    held_.erase(0, at);
    return out;
  }
  // Hold a tail that may be the start of the marker.
  size_t keep = 0;
  for (size_t k = std::min(marker.size() - 1, held_.size()); k > 0; --k)
    if (held_.compare(held_.size() - k, k, marker, 0, k) == 0) {
      keep = k;
      break;
    }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

ToolCallOutput ToolCallStream::finish() {
  if (!holding_) return {std::exchange(held_, ""), {}};
  return parse_tool_calls(std::exchange(held_, ""), format_);
}

json tool_calls_json(const std::vector<ToolCall>& calls, bool with_index) {
  json arr = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json c = {{"id", calls[i].id}, {"type", "function"}, {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (with_index) c["index"] = i;
    arr.push_back(std::move(c));
  }
  return arr;
}

}  // namespace kvserve::http
