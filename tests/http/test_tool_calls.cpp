// Tool calling: request validation (400 naming the field), the forced-call constraint, the three
// output formats parsed whole and streamed, and tool_calls history as templates expect it.
#include <gtest/gtest.h>

#include "http/api_error.h"
#include "http/tool_calls.h"

namespace kvserve::http {
namespace {

using nlohmann::json;

const json kWeather = json::parse(R"({"type": "function", "function": {"name": "get_weather",
  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})");

std::string param_of(const json& body) {
  try {
    parse_tools(body);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    return e.param();
  }
  return "(accepted)";
}

TEST(ToolCalls, ParsesChoices) {
  EXPECT_FALSE(parse_tools(json::object()).active());
  auto t = parse_tools({{"tools", {kWeather}}});
  EXPECT_EQ(t.choice, ToolsRequest::Choice::kAuto);
  EXPECT_TRUE(t.active());
  EXPECT_FALSE(t.forced());
  EXPECT_FALSE(parse_tools({{"tools", {kWeather}}, {"tool_choice", "none"}}).active());
  EXPECT_TRUE(parse_tools({{"tools", {kWeather}}, {"tool_choice", "required"}}).forced());
  t = parse_tools({{"tools", {kWeather}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}},
                   {"parallel_tool_calls", false}});
  EXPECT_EQ(t.choice, ToolsRequest::Choice::kNamed);
  EXPECT_EQ(t.named, "get_weather");
  EXPECT_FALSE(t.parallel);
}

TEST(ToolCalls, BadToolsNameTheField) {
  EXPECT_EQ(param_of({{"tools", "x"}}), "tools");
  EXPECT_EQ(param_of({{"tools", {{{"type", "function"}, {"function", {{"description", "d"}}}}}}}), "tools[0].function.name");
  EXPECT_EQ(param_of({{"tools", {{{"type", "function"}, {"function", {{"name", "a b"}}}}}}}), "tools[0].function.name");
  EXPECT_EQ(param_of({{"tools", {{{"type", "retrieval"}}}}}), "tools[0].type");
  EXPECT_EQ(param_of({{"tools", {kWeather, kWeather}}}), "tools[1].function.name");
  EXPECT_EQ(param_of({{"tools", {{{"type", "function"}, {"function", {{"name", "f"}, {"parameters", 3}}}}}}}),
            "tools[0].function.parameters");
  EXPECT_EQ(param_of({{"tools", {kWeather}}, {"tool_choice", "always"}}), "tool_choice");
  EXPECT_EQ(param_of({{"tool_choice", "required"}}), "tool_choice");
  EXPECT_EQ(param_of({{"tools", {kWeather}}, {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}),
            "tool_choice.function.name");
  EXPECT_EQ(param_of({{"functions", {kWeather["function"]}}}), "functions");
  EXPECT_EQ(param_of({{"tools", {kWeather}}, {"parallel_tool_calls", "yes"}}), "parallel_tool_calls");
}

TEST(ToolCalls, ForcedSpecWrapsTheCallSchemaInTheFormatsTags) {
  auto t = parse_tools({{"tools", {kWeather}}, {"tool_choice", "required"}});
  auto s = forced_tool_call_spec(t, ToolCallFormat::kHermes);
  EXPECT_EQ(s.kind, StructuredOutputSpec::Kind::kToolCall);
  EXPECT_EQ(s.prefix, "<tool_call>\n");
  EXPECT_EQ(s.suffix, "\n</tool_call>");
  const json schema = json::parse(s.text);
  EXPECT_EQ(schema["properties"]["name"]["enum"], json::array({"get_weather"}));
  EXPECT_EQ(schema["properties"]["arguments"], kWeather["function"]["parameters"]);
  EXPECT_TRUE(json::parse(forced_tool_call_spec(t, ToolCallFormat::kLlama3Json).text)["properties"].contains("parameters"));
}

TEST(ToolCalls, ParsesEachFormat) {
  auto h = parse_tool_calls("Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
                            ToolCallFormat::kHermes);
  ASSERT_EQ(h.calls.size(), 1u);
  EXPECT_EQ(h.calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(h.calls[0].arguments), json({{"city", "Paris"}}));
  EXPECT_EQ(h.content, "Sure.\n");
  EXPECT_EQ(h.calls[0].id.rfind("call_", 0), 0u);
  auto two = parse_tool_calls("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", "
                              "\"arguments\": {\"x\": 1}}</tool_call>",
                              ToolCallFormat::kHermes);
  ASSERT_EQ(two.calls.size(), 2u);
  EXPECT_EQ(two.calls[1].name, "b");
  EXPECT_EQ(two.content, "");
  // Not a call after all: the text stays content.
  auto bad = parse_tool_calls("<tool_call>{oops", ToolCallFormat::kHermes);
  EXPECT_TRUE(bad.calls.empty());
  EXPECT_EQ(bad.content, "<tool_call>{oops");
  auto l = parse_tool_calls("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}", ToolCallFormat::kLlama3Json);
  ASSERT_EQ(l.calls.size(), 1u);
  EXPECT_EQ(json::parse(l.calls[0].arguments), json({{"q", "x"}}));
  EXPECT_TRUE(parse_tool_calls("Hello there", ToolCallFormat::kLlama3Json).calls.empty());
  auto m = parse_tool_calls("[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", \"arguments\": {}}]",
                            ToolCallFormat::kMistral);
  ASSERT_EQ(m.calls.size(), 2u);
  EXPECT_EQ(m.calls[1].name, "g");
}

TEST(ToolCalls, StreamPassesContentAndHoldsTheCall) {
  ToolCallStream s(ToolCallFormat::kHermes, /*forced=*/false);
  std::string content;
  for (const char* d : {"Let me ", "check.<tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Rome\"}}",
                        "\n</tool_call>"})
    content += s.feed(d);
  EXPECT_EQ(content, "Let me check.");
  auto out = s.finish();
  ASSERT_EQ(out.calls.size(), 1u);
  EXPECT_EQ(json::parse(out.calls[0].arguments)["city"], "Rome");
  // A '<' that does not start the marker is released.
  ToolCallStream t(ToolCallFormat::kHermes, false);
  EXPECT_EQ(t.feed("a <"), "a ");
  EXPECT_EQ(t.feed("b"), "<b");
  EXPECT_EQ(t.finish().content, "");
  ToolCallStream plain(ToolCallFormat::kLlama3Json, false);
  EXPECT_EQ(plain.feed("Hi"), "Hi");
  EXPECT_TRUE(plain.finish().calls.empty());
}

TEST(ToolCalls, TemplateMessagesTurnArgumentTextIntoObjects) {
  const json msgs = json::parse(R"([{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
    "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}, {"role": "tool", "content": "ok", "tool_call_id": "c"}])");
  const json out = template_messages(msgs);
  EXPECT_EQ(out[0]["tool_calls"][0]["function"]["arguments"], json({{"a", 1}}));
  EXPECT_EQ(out[1], msgs[1]);
}

TEST(ToolCalls, FormatByNameAndFromTemplate) {
  EXPECT_EQ(tool_call_format_named("mistral"), ToolCallFormat::kMistral);
  EXPECT_FALSE(tool_call_format_named("auto"));
  EXPECT_EQ(detect_tool_call_format("... <tool_call> ..."), ToolCallFormat::kHermes);
  EXPECT_EQ(detect_tool_call_format("[TOOL_CALLS]"), ToolCallFormat::kMistral);
  EXPECT_EQ(detect_tool_call_format("<|python_tag|>"), ToolCallFormat::kLlama3Json);
}

}  // namespace
}  // namespace kvserve::http
