#pragma once
// The kvserve CLI's subcommands; each lives in its own cmd_*.cpp and registers itself on the app.
#include <CLI/CLI.hpp>

namespace kvserve::cli {

void add_generate_command(CLI::App& app);    // cmd_generate.cpp
void add_forward_command(CLI::App& app);     // cmd_forward.cpp
void add_tokenize_commands(CLI::App& app);   // cmd_tokenize.cpp: tokenize, detokenize
void add_serve_command(CLI::App& app);       // cmd_serve.cpp
void add_config_commands(CLI::App& app);     // cmd_config.cpp: config check
void add_chat_template_command(CLI::App& app);  // cmd_chat_template.cpp: chat-template
void add_policy_commands(CLI::App& app);     // cmd_policy.cpp: policy budgets, policy select
void add_plan_command(CLI::App& app);        // cmd_plan.cpp: plan (TP x PP memory arithmetic)
void add_bench_commands(CLI::App& app);      // cmd_bench.cpp: bench decode
void add_perplexity_command(CLI::App& app);  // cmd_perplexity.cpp: teacher-forced perplexity through the KV cache
void add_gguf_commands(CLI::App& app);       // cmd_gguf.cpp: gguf inspect, gguf dequantize

}  // namespace kvserve::cli
