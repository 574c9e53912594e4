// `kvserve chat-template`: renders a chat template against a JSON context, for checking templates
// and for the reference tests against Python's jinja2.
#include <fstream>
#include <iostream>
#include <sstream>

#include "chat_template.h"
#include "commands.h"

namespace kvserve::cli {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KV_CHECK(in, "cannot open " << path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

void add_chat_template_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("chat-template", "Render a chat template (Jinja) against a JSON context");
  auto template_path = std::make_shared<std::string>();
  auto context_path = std::make_shared<std::string>();
  cmd->add_option("--template", *template_path, "template file (raw Jinja, or a tokenizer_config.json with chat_template)")
      ->required();
  cmd->add_option("--context", *context_path, "JSON file: messages, add_generation_prompt, bos_token, ...")->required();
  cmd->callback([template_path, context_path] {
    std::string source = read_file(*template_path);
    // A tokenizer_config.json carries the template in its chat_template field.
    if (template_path->size() >= 5 && template_path->compare(template_path->size() - 5, 5, ".json") == 0) {
      auto cfg = nlohmann::json::parse(source, nullptr, false);
      KV_CHECK(!cfg.is_discarded() && cfg.contains("chat_template") && cfg["chat_template"].is_string(),
               *template_path << " has no string chat_template field");
      source = cfg["chat_template"].get<std::string>();
    }
    auto context = nlohmann::ordered_json::parse(read_file(*context_path), nullptr, false);
    KV_CHECK(!context.is_discarded(), *context_path << " is not valid JSON");
    std::string out = ChatTemplate(source).render(context);
    std::cout.write(out.data(), static_cast<std::streamsize>(out.size()));
    std::cout.flush();
  });
}

}  // namespace kvserve::cli
