// kvserve: command-line entry point.
#include <csignal>
#include <iostream>

#include "cli/commands.h"
#include "common/check.h"
#include "common/log.h"
#include "parallel/launcher.h"

int main(int argc, char** argv) {
  // A peer that dies (a worker rank, a client) must fail the write to its socket with EPIPE, which
  // the caller turns into an error, not kill the server with SIGPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  kvserve::parallel::set_command_line(argc, argv);  // workers of a sharded job re-run this command
  CLI::App app{"kvserve: an LLM serving engine with per-layer KV-cache compression"};
  app.require_subcommand(1);
  kvserve::cli::add_generate_command(app);
  kvserve::cli::add_forward_command(app);
  kvserve::cli::add_tokenize_commands(app);
  kvserve::cli::add_serve_command(app);
  kvserve::cli::add_config_commands(app);
  kvserve::cli::add_chat_template_command(app);
  kvserve::cli::add_policy_commands(app);
  kvserve::cli::add_plan_command(app);
  kvserve::cli::add_bench_commands(app);
  kvserve::cli::add_perplexity_command(app);
  kvserve::cli::add_gguf_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    KV_LOG("error: " << e.what());
    return 1;
  }
  return 0;
}
