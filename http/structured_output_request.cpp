#include "http/structured_output_request.h"

#include <string>

#include "http/api_error.h"

namespace kvserve::http {

using nlohmann::json;
using Kind = StructuredOutputSpec::Kind;

namespace {

[[noreturn]] void fail(const std::string& field, const std::string& why) { throw ApiError(400, why, field); }

const json* present(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() || it->is_null() ? nullptr : &*it;
}

std::string need_string(const json& v, const std::string& field) {
  if (!v.is_string()) fail(field, "'" + field + "' must be a string");
  if (v.get<std::string>().empty()) fail(field, "'" + field + "' must not be empty");
  return v.get<std::string>();
}

// A schema given as an object (OpenAI, vLLM) or as JSON text (vLLM accepts both for guided_json).
std::string schema_text(const json& v, const std::string& field) {
  if (v.is_object() || v.is_boolean()) return v.dump();
  if (v.is_string()) {
    const auto j = json::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !(j.is_object() || j.is_boolean())) fail(field, "'" + field + "' is not a JSON schema object");
    return j.dump();
  }
  fail(field, "'" + field + "' must be a JSON schema object");
}

std::vector<std::string> choices(const json& v, const std::string& field) {
  if (!v.is_array() || v.empty()) fail(field, "'" + field + "' must be a non-empty array of strings");
  std::vector<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) out.push_back(need_string(v[i], field + "[" + std::to_string(i) + "]"));
  return out;
}

StructuredOutputSpec from_response_format(const json& rf) {
  StructuredOutputSpec s;
  if (!rf.is_object()) fail("response_format", "'response_format' must be an object");
  const json* t = present(rf, "type");
  if (!t || !t->is_string()) fail("response_format.type", "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\"");
  const std::string type = t->get<std::string>();
  s.field = "response_format";
  if (type == "text") return s;
  if (type == "json_object") {
    s.kind = Kind::kJsonObject;
    return s;
  }
  if (type != "json_schema")
    fail("response_format.type", "unsupported response_format type '" + type + "' (text, json_object, json_schema)");
  const json* js = present(rf, "json_schema");
  if (!js || !js->is_object()) fail("response_format.json_schema", "'response_format.json_schema' must be an object");
  if (const json* st = present(*js, "strict"); st && !st->is_boolean())
    fail("response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean");
  if (const json* n = present(*js, "name"); n && !n->is_string())
    fail("response_format.json_schema.name", "'response_format.json_schema.name' must be a string");
  const json* schema = present(*js, "schema");
  s.field = "response_format.json_schema.schema";
  if (!schema) fail(s.field, "'response_format.json_schema.schema' is required");
  s.kind = Kind::kJsonSchema;
  s.text = schema_text(*schema, s.field);
  return s;
}

// vLLM's structured_outputs object: exactly one of its constraint keys.
StructuredOutputSpec from_structured_outputs(const json& so) {
  if (!so.is_object()) fail("structured_outputs", "'structured_outputs' must be an object");
  StructuredOutputSpec s;
  for (auto it = so.begin(); it != so.end(); ++it) {
    if (it->is_null()) continue;
    const std::string key = it.key(), field = "structured_outputs." + key;
    StructuredOutputSpec one;
    one.field = field;
    if (key == "json") {
      one.kind = Kind::kJsonSchema, one.text = schema_text(*it, field);
    } else if (key == "regex") {
      one.kind = Kind::kRegex, one.text = need_string(*it, field);
    } else if (key == "choice") {
      one.kind = Kind::kChoice, one.choices = choices(*it, field);
    } else if (key == "grammar") {
      one.kind = Kind::kGrammar, one.text = need_string(*it, field);
    } else if (key == "json_object") {
      if (!it->is_boolean()) fail(field, "'" + field + "' must be a boolean");
      if (!it->get<bool>()) continue;
      one.kind = Kind::kJsonObject;
    } else {
      fail(field, "'" + field + "' is not supported (json, regex, choice, grammar, json_object)");
    }
    if (s.active()) fail(field, "'structured_outputs' may set only one of json, regex, choice, grammar, json_object");
    s = std::move(one);
  }
  return s;
}

}  // namespace

void keep_schema_key_order(StructuredOutputSpec& spec, std::string_view body) {
  if (spec.kind != Kind::kJsonSchema) return;
  const auto j = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return;
  const nlohmann::ordered_json* v = &j;
  size_t at = 0;
  while (at <= spec.field.size()) {  // the field's path, "a.b.c"
    const size_t dot = spec.field.find('.', at);
    const std::string key = spec.field.substr(at, dot == std::string::npos ? std::string::npos : dot - at);
    if (!v->is_object() || !v->contains(key)) return;
    v = &(*v)[key];
    if (dot == std::string::npos) break;
    at = dot + 1;
  }
  if (v->is_string()) {
    const auto inner = nlohmann::ordered_json::parse(v->get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (!inner.is_discarded()) spec.text = inner.dump();
  } else if (v->is_object()) {
    spec.text = v->dump();
  }
}

StructuredOutputSpec parse_structured_output(const json& body) {
  StructuredOutputSpec out;
  auto take = [&](StructuredOutputSpec s) {
    if (!s.active()) return;
    if (out.active())
      fail(s.field, "'" + s.field + "' and '" + out.field + "' both constrain the output; send only one");
    out = std::move(s);
  };
  if (const json* rf = present(body, "response_format")) take(from_response_format(*rf));
  if (const json* v = present(body, "guided_json")) {
    StructuredOutputSpec s;
    s.kind = Kind::kJsonSchema, s.field = "guided_json", s.text = schema_text(*v, "guided_json");
    take(std::move(s));
  }
  if (const json* v = present(body, "guided_regex")) {
    StructuredOutputSpec s;
    s.kind = Kind::kRegex, s.field = "guided_regex", s.text = need_string(*v, "guided_regex");
    take(std::move(s));
  }
  if (const json* v = present(body, "guided_choice")) {
    StructuredOutputSpec s;
    s.kind = Kind::kChoice, s.field = "guided_choice", s.choices = choices(*v, "guided_choice");
    take(std::move(s));
  }
  if (const json* v = present(body, "guided_grammar")) {
    StructuredOutputSpec s;
    s.kind = Kind::kGrammar, s.field = "guided_grammar", s.text = need_string(*v, "guided_grammar");
    take(std::move(s));
  }
  if (const json* v = present(body, "structured_outputs")) take(from_structured_outputs(*v));
  return out;
}

}  // namespace kvserve::http
