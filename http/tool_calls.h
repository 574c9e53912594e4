#pragma once
// Tool calling: the request's `tools` / `tool_choice` / `parallel_tool_calls`, the grammar that
// forces a call (tool_choice "required" or a named function), and the parsers that turn a model's
// tool-call text (Hermes <tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS]) into OpenAI tool_calls,
// whole or streamed.
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "backend/sampling/structured_output_spec.h"

namespace kvserve::http {

// How a model writes its tool calls.
enum class ToolCallFormat { kHermes, kLlama3Json, kMistral };

// "hermes" | "llama3_json" | "mistral"; nullopt for anything else.
std::optional<ToolCallFormat> tool_call_format_named(const std::string& name);
const char* tool_call_format_name(ToolCallFormat f);
// The format a chat template's tool section writes (Hermes when it names none of the markers).
ToolCallFormat detect_tool_call_format(const std::string& chat_template);

// The tool fields of a chat request.
struct ToolsRequest {
  enum class Choice { kNone, kAuto, kRequired, kNamed };
  nlohmann::json tools = nlohmann::json::array();  // as given (validated), for the chat template
  Choice choice = Choice::kNone;
  std::string named;  // kNamed: the function
  bool parallel = true;

  // Whether the output is parsed for tool calls.
  bool active() const { return !tools.empty() && choice != Choice::kNone; }
  // Whether the grammar forces a call.
  bool forced() const { return choice == Choice::kRequired || choice == Choice::kNamed; }
};

// Parses tools / tool_choice / parallel_tool_calls (and refuses the legacy functions /
// function_call); every problem is an ApiError(400) naming the field.
ToolsRequest parse_tools(const nlohmann::json& body);

// The constraint that makes the model write exactly one call of a tool the choice allows.
StructuredOutputSpec forced_tool_call_spec(const ToolsRequest& tools, ToolCallFormat format);

// Messages as chat templates expect them: an assistant's tool_calls[].function.arguments given as
// JSON text become objects (Hermes-style templates apply `tojson` to them), as vLLM does.
nlohmann::json template_messages(const nlohmann::json& messages);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text
};

struct ToolCallOutput {
  std::string content;  // text outside the calls
  std::vector<ToolCall> calls;
};

// Splits a finished output into content and calls; text that does not parse as a call stays content.
ToolCallOutput parse_tool_calls(const std::string& text, ToolCallFormat format);

// A streamed output: content is passed on until a call may be starting, then held and parsed at
// the end (OpenAI streams each call as tool_calls deltas; one delta per call is a valid stream).
class ToolCallStream {
 public:
  ToolCallStream(ToolCallFormat format, bool forced) : format_(format), holding_(forced) {}
  // The content to send now for this text delta.
  std::string feed(const std::string& delta);
  // At the end: what was held, split into content and calls.
  ToolCallOutput finish();

 private:
  ToolCallFormat format_;
  bool holding_;       // a call has (or may have) started: everything is held
  bool seen_text_ = false;
  std::string held_;
};

// OpenAI's tool_calls entries of a message (or, with index, of a stream delta).
nlohmann::json tool_calls_json(const std::vector<ToolCall>& calls, bool with_index);

}  // namespace kvserve::http
