// parse_structured_output: every OpenAI / vLLM spelling of a constraint becomes one spec, and every
// malformed or conflicting one is a 400 naming the field.
#include <gtest/gtest.h>

#include "http/request_parser.h"
#include "http/structured_output_request.h"

namespace kvserve::http {
namespace {

using nlohmann::json;
using Kind = StructuredOutputSpec::Kind;

StructuredOutputSpec parse(const char* body) { return parse_structured_output(json::parse(body)); }

std::string param_of(const char* body) {
  try {
    parse(body);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    return e.param();
  }
  return "(accepted)";
}

TEST(StructuredOutputRequest, EverySpelling) {
  EXPECT_FALSE(parse(R"({"response_format": {"type": "text"}})").active());
  EXPECT_EQ(parse(R"({"response_format": {"type": "json_object"}})").kind, Kind::kJsonObject);
  auto s = parse(R"({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true,
                     "schema": {"type": "object"}}}})");
  EXPECT_EQ(s.kind, Kind::kJsonSchema);
  EXPECT_EQ(json::parse(s.text), json::parse(R"({"type": "object"})"));
  EXPECT_EQ(s.field, "response_format.json_schema.schema");
  s = parse(R"({"guided_json": "{\"type\": \"integer\"}"})");
  EXPECT_EQ(s.kind, Kind::kJsonSchema);
  EXPECT_EQ(json::parse(s.text), json::parse(R"({"type": "integer"})"));
  EXPECT_EQ(parse(R"({"guided_regex": "[a-z]+"})").text, "[a-z]+");
  EXPECT_EQ(parse(R"({"guided_choice": ["a", "b"]})").choices, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(parse(R"({"guided_grammar": "root ::= \"x\""})").kind, Kind::kGrammar);
  EXPECT_EQ(parse(R"({"structured_outputs": {"choice": ["y"]}})").field, "structured_outputs.choice");
  EXPECT_EQ(parse(R"({"structured_outputs": {"json": {"type": "object"}}})").kind, Kind::kJsonSchema);
  EXPECT_EQ(parse(R"({"structured_outputs": {"json_object": true}})").kind, Kind::kJsonObject);
  EXPECT_FALSE(parse(R"({"guided_json": null, "structured_outputs": {"json_object": false}})").active());
}

TEST(StructuredOutputRequest, ErrorsNameTheField) {
  EXPECT_EQ(param_of(R"({"response_format": {"type": "yaml"}})"), "response_format.type");
  EXPECT_EQ(param_of(R"({"response_format": "json"})"), "response_format");
  EXPECT_EQ(param_of(R"({"response_format": {"type": "json_schema"}})"), "response_format.json_schema");
  EXPECT_EQ(param_of(R"({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})"),
            "response_format.json_schema.schema");
  EXPECT_EQ(param_of(R"({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}})"),
            "response_format.json_schema.schema");
  EXPECT_EQ(param_of(R"({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}})"),
            "response_format.json_schema.strict");
  EXPECT_EQ(param_of(R"({"guided_json": "{not json"})"), "guided_json");
  EXPECT_EQ(param_of(R"({"guided_regex": 5})"), "guided_regex");
  EXPECT_EQ(param_of(R"({"guided_regex": ""})"), "guided_regex");
  EXPECT_EQ(param_of(R"({"guided_choice": []})"), "guided_choice");
  EXPECT_EQ(param_of(R"({"guided_choice": ["a", 1]})"), "guided_choice[1]");
  EXPECT_EQ(param_of(R"({"structured_outputs": {"whitespace_pattern": " "}})"), "structured_outputs.whitespace_pattern");
  EXPECT_EQ(param_of(R"({"structured_outputs": {"regex": "a", "choice": ["b"]}})"), "structured_outputs.regex");
  EXPECT_EQ(param_of(R"({"guided_regex": "a", "guided_choice": ["b"]})"), "guided_choice");
  EXPECT_EQ(param_of(R"({"response_format": {"type": "json_object"}, "guided_json": {}})"), "guided_json");
}

TEST(StructuredOutputRequest, SchemaKeepsTheClientsKeyOrder) {
  auto r = parse_chat_request(R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type":
    "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"zeta": {"type": "integer"},
    "alpha": {"type": "string"}}}}}})");
  EXPECT_LT(r.structured.text.find("zeta"), r.structured.text.find("alpha"));
  r = parse_chat_request(R"({"messages": [{"role": "user", "content": "hi"}], "guided_json":
    "{\"properties\": {\"b\": {}, \"a\": {}}}"})");
  EXPECT_LT(r.structured.text.find("\"b\""), r.structured.text.find("\"a\""));
}

TEST(StructuredOutputRequest, BothEndpointsCarryTheSpec) {
  auto chat = parse_chat_request(R"({"messages": [{"role": "user", "content": "hi"}], "guided_regex": "[0-9]"})");
  EXPECT_EQ(chat.structured.kind, Kind::kRegex);
  auto comp = parse_completion_request(R"({"prompt": "hi", "response_format": {"type": "json_object"}})");
  EXPECT_EQ(comp.structured.kind, Kind::kJsonObject);
}

}  // namespace
}  // namespace kvserve::http
