#pragma once
// Chat templates: renders a model's Hugging Face `chat_template` (Jinja) the way transformers does
// (jinja2 ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, raise_exception, strftime_now,
// transformers' tojson), with a C++ interpreter of the Jinja subset real templates use.
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "common/check.h"

namespace kvserve {

namespace text::jinja {
struct Program;
}

// A template that does not parse, fails while rendering, or calls raise_exception(msg).
class TemplateError : public KvError {
 public:
  explicit TemplateError(const std::string& msg, bool raised = false)
      : KvError(msg), raised_(raised) {}
  // True when the template itself called raise_exception; what() is then its message verbatim.
  bool raised_by_template() const { return raised_; }

 private:
  bool raised_;
};

// A parsed chat template; parsing happens once, render() is const and thread-safe.
class ChatTemplate {
 public:
  explicit ChatTemplate(std::string source);
  // `context` is a JSON object: messages, add_generation_prompt, bos_token, eos_token, tools,
  // documents and any extra kwargs. As transformers does, tools/documents default to None and
  // add_generation_prompt to false when absent.
  // Pass an ordered_json (parse with nlohmann::ordered_json::parse) so that dicts keep the
  // request's key order, as Python does; `tools|tojson` output depends on it.
  std::string render(const nlohmann::ordered_json& context) const;
  // Same, but nlohmann::json has already sorted every object's keys.
  std::string render(const nlohmann::json& context) const;
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::shared_ptr<const text::jinja::Program> program_;
};

}  // namespace kvserve
