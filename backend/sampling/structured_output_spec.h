#pragma once
// StructuredOutputSpec: what a request constrains its output to (a JSON schema, any JSON, a regex,
// a choice of strings, an EBNF grammar, a tool call), as parsed from the request, before compilation.
#include <string>
#include <vector>

namespace kvserve {

struct StructuredOutputSpec {
  enum class Kind { kNone, kJsonSchema, kJsonObject, kRegex, kChoice, kGrammar, kToolCall };
  Kind kind = Kind::kNone;
  std::string text;                  // the schema (JSON text), regex or EBNF grammar
  std::vector<std::string> choices;  // kChoice
  // kToolCall: a JSON value matching the schema `text`, between these two literal strings (the
  // tool-call format's tags, e.g. "<tool_call>\n" and "\n</tool_call>").
  std::string prefix, suffix;
  // The request field it came from, named in errors ("response_format.json_schema.schema", "guided_regex").
  std::string field;

  bool active() const { return kind != Kind::kNone; }
  // The cache key of its compiled grammar.
  std::string key() const {
    std::string k = std::to_string(static_cast<int>(kind)) + ":" + text + "\x1e" + prefix + "\x1e" + suffix;
    for (const auto& c : choices) k += "\x1f" + c;
    return k;
  }
};

}  // namespace kvserve
