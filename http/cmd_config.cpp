// `kvserve config check FILE`: parse and validate a YAML config, reporting every problem.
#include <iostream>

#include "commands.h"
#include "server_config.h"

namespace kvserve::cli {

void add_config_commands(CLI::App& app) {
  auto* config = app.add_subcommand("config", "Work with YAML config files");
  config->require_subcommand(1);
  auto file = std::make_shared<std::string>();
  auto* check = config->add_subcommand("check", "Validate a config file; every problem is reported with file, line and key");
  check->add_option("file", *file, "YAML config file")->required();
  check->callback([file] {
    try {
      auto c = kvserve::config::load_server_config(*file);
      std::cout << *file << ": OK\n"
                << "  model: " << c.model.path << " (served as '" << c.model_name() << "') on " << c.model.device << ", "
                << c.model.dtype << "\n"
                << "  server: " << c.server.host << ":" << c.server.port
                << (kvserve::config::effective_api_key(c.server).empty() ? "" : ", API key required") << "\n"
                << "  cache: block_size " << c.cache.block_size << ", " << c.cache.kv_cache_bytes << " bytes\n"
                << "  scheduler: max_num_seqs " << c.scheduler.max_num_seqs << ", max_num_batched_tokens "
                << c.scheduler.max_num_batched_tokens << ", max_waiting " << c.scheduler.max_waiting << "\n"
                << "  policies:";
      for (const auto& [name, spec] : c.policies) {
        std::cout << " " << name;
        if (spec.method != name) std::cout << "(" << spec.method << ")";
        if (name == c.default_policy) std::cout << "*";
      }
      std::cout << "  (* = default)\n";
    } catch (const kvserve::config::ConfigError& e) {
      for (const auto& issue : e.issues()) std::cerr << issue.format() << "\n";
      std::cerr << *file << ": " << e.issues().size() << " problem" << (e.issues().size() == 1 ? "" : "s") << "\n";
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace kvserve::cli
