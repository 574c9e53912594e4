// ChatTemplate: parses once, renders with the variables transformers' apply_chat_template passes.
#include "text/chat_template.h"

#include "text/jinja.h"

namespace kvserve {

ChatTemplate::ChatTemplate(std::string source) : source_(std::move(source)), program_(text::jinja::parse(source_)) {}

namespace {

std::string render_value(const text::jinja::Program& program, text::jinja::Value ctx) {
  // transformers always passes these, so templates may test `tools is none` rather than `is defined`.
  for (const char* key : {"tools", "documents"})
    if (!ctx.dict->find(std::string(key))) ctx.dict->set(text::jinja::Value::string(key), text::jinja::Value::none());
  if (!ctx.dict->find(std::string("add_generation_prompt")))
    ctx.dict->set(text::jinja::Value::string("add_generation_prompt"), text::jinja::Value::boolean(false));
  return text::jinja::render(program, ctx);
}

}  // namespace

std::string ChatTemplate::render(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) throw TemplateError("chat template context must be a JSON object");
  return render_value(*program_, text::jinja::from_json(context));
}

std::string ChatTemplate::render(const nlohmann::json& context) const {
  if (!context.is_object()) throw TemplateError("chat template context must be a JSON object");
  return render_value(*program_, text::jinja::from_json(context));
}

}  // namespace kvserve
