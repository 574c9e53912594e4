// `kvserve chat-template`: renders a chat template against a JSON context, for checking templates
// and for the reference tests against Python's jinja2.
#include <iostream>

#include "cli/cli_files.h"
#include "cli/commands.h"
#include "text/chat_template.h"

namespace kvserve::cli {
namespace {

// Renders every {"template", "context"} pair of a JSON array in one process (the reference tests
// would otherwise pay the binary's start-up per case); prints a JSON array of {"output"} or {"error"}.
void run_batch(const std::string& path) {
  auto cases = nlohmann::ordered_json::parse(read_text_file(path), nullptr, false);
  KV_CHECK(!cases.is_discarded() && cases.is_array(), path << " must be a JSON array of {template, context}");
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (const auto& c : cases) {
    nlohmann::ordered_json r = nlohmann::ordered_json::object();
    try {
      KV_CHECK(c.is_object() && c.contains("template") && c["template"].is_string() && c.contains("context"),
               "batch entries need a string template and a context");
      r["output"] = ChatTemplate(c["template"].get<std::string>()).render(c["context"]);
    } catch (const std::exception& e) {
      r["error"] = e.what();
    }
    results.push_back(std::move(r));
  }
  std::string out = results.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  std::cout.write(out.data(), static_cast<std::streamsize>(out.size()));
  std::cout.flush();
}

}  // namespace

void add_chat_template_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("chat-template", "Render a chat template (Jinja) against a JSON context");
  auto template_path = std::make_shared<std::string>();
  auto context_path = std::make_shared<std::string>();
  auto batch_path = std::make_shared<std::string>();
  auto* t = cmd->add_option("--template", *template_path, "template file (raw Jinja, or a tokenizer_config.json with chat_template)");
  auto* c = cmd->add_option("--context", *context_path, "JSON file: messages, add_generation_prompt, bos_token, ...");
  auto* b = cmd->add_option("--batch", *batch_path, "JSON file: array of {template, context}; prints a JSON array of results");
  b->excludes(t)->excludes(c);
  cmd->callback([template_path, context_path, batch_path] {
    if (!batch_path->empty()) return run_batch(*batch_path);
    KV_CHECK(!template_path->empty() && !context_path->empty(), "chat-template needs --template and --context (or --batch)");
    std::string source = read_text_file(*template_path);
    // A tokenizer_config.json carries the template in its chat_template field.
    if (template_path->size() >= 5 && template_path->compare(template_path->size() - 5, 5, ".json") == 0) {
      auto cfg = nlohmann::json::parse(source, nullptr, false);
      KV_CHECK(!cfg.is_discarded() && cfg.contains("chat_template") && cfg["chat_template"].is_string(),
               *template_path << " has no string chat_template field");
      source = cfg["chat_template"].get<std::string>();
    }
    auto context = nlohmann::ordered_json::parse(read_text_file(*context_path), nullptr, false);
    KV_CHECK(!context.is_discarded(), *context_path << " is not valid JSON");
    std::string out = ChatTemplate(source).render(context);
    std::cout.write(out.data(), static_cast<std::streamsize>(out.size()));
    std::cout.flush();
  });
}

}  // namespace kvserve::cli
