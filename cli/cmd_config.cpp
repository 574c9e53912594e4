// `kvserve config check FILE`: parse and validate a YAML config, reporting every problem.
// `kvserve config explain FILE --model M --header k=v --user u`: which rollout rule and policy a
// request would get.
#include <cctype>
#include <iostream>

#include "cli/commands.h"
#include "configs/server_config.h"

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
                << c.model.dtype << (c.model.enforce_eager ? ", enforce_eager" : "") << "\n"
                << "  server: " << c.server.host << ":" << c.server.port
                << (kvserve::config::effective_api_key(c.server).empty() ? "" : ", API key required") << "\n"
                << "  cache: block_size " << c.cache.block_size << ", " << c.cache.kv_cache_bytes << " bytes, KV "
                << c.cache.kv_cache_dtype
                << (c.cache.enable_prefix_caching ? ", prefix caching" : "")
                << (c.cache.prefix_cache_bytes > 0 ? " + host tier " + std::to_string(c.cache.prefix_cache_bytes) + " bytes" : "")
                << "\n"
                << "  scheduler: max_num_seqs " << c.scheduler.max_num_seqs << ", max_num_batched_tokens "
                << c.scheduler.max_num_batched_tokens
                << (c.scheduler.enable_chunked_prefill ? ", chunked prefill" : "") << ", max_waiting " << c.scheduler.max_waiting << "\n"
                << "  policies:";
      for (const auto& [name, spec] : c.policies) {
        std::cout << " " << name;
        if (spec.method != name) std::cout << "(" << spec.method << ")";
        if (name == c.default_policy) std::cout << "*";
      }
      std::cout << "  (* = default)\n";
      if (c.rollout.present) {
        std::cout << "  rollout: " << c.rollout.rules.size() << " rule(s)";
        for (const auto& r : c.rollout.rules) {
          std::cout << "\n    " << r.name << " -> " << (r.policy.empty() ? "(default)" : r.policy);
          if (r.canary) std::cout << ", " << r.canary->percent << "% " << r.canary->policy << " by " << r.canary->sticky_by;
          if (r.max_draft_tokens) std::cout << (*r.max_draft_tokens == 0 ? ", no speculation"
                                                                          : ", at most " + std::to_string(*r.max_draft_tokens) + " draft tokens");
        }
        std::cout << "\n    default -> " << (c.rollout.default_policy.empty() ? c.default_policy : c.rollout.default_policy)
                  << "; overrides allowed:";
        for (const auto& o : c.rollout.allow_override) std::cout << " " << o;
        if (c.rollout.allow_override.empty()) std::cout << " none";
        std::cout << "\n";
      }
    } catch (const kvserve::config::ConfigError& e) {
      for (const auto& issue : e.issues()) std::cerr << issue.format() << "\n";
      std::cerr << *file << ": " << e.issues().size() << " problem" << (e.issues().size() == 1 ? "" : "s") << "\n";
      throw CLI::RuntimeError(1);
    }
  });

  struct ExplainArgs {
    std::string file, model, user, api_key_name, endpoint = "completions", kv_policy, request_id = "explain";
    std::vector<std::string> headers;
    int64_t prompt_tokens = -1;
  };
  auto ea = std::make_shared<ExplainArgs>();
  auto* explain = config->add_subcommand("explain", "Show which rollout rule and KV policy a request would get");
  explain->add_option("file", ea->file, "YAML config file")->required();
  explain->add_option("--model", ea->model, "the request's model (default: the served model name)");
  explain->add_option("--header", ea->headers, "request header name=value (repeatable)");
  explain->add_option("--user", ea->user, "the request's `user` field");
  explain->add_option("--api-key-name", ea->api_key_name, "name of the API key used (server.api_keys)");
  explain->add_option("--prompt-tokens", ea->prompt_tokens, "prompt length in tokens");
  explain->add_option("--endpoint", ea->endpoint, "completions or chat")->check(CLI::IsMember({"completions", "chat"}));
  explain->add_option("--kv-policy", ea->kv_policy, "the request's explicit kv_policy");
  explain->add_option("--request-id", ea->request_id, "request id (the sticky key when user/header is absent)");
  explain->callback([ea] {
    kvserve::config::ServerConfig c;
    try {
      c = kvserve::config::load_server_config(ea->file);
    } catch (const kvserve::config::ConfigError& e) {
      for (const auto& issue : e.issues()) std::cerr << issue.format() << "\n";
      throw CLI::RuntimeError(1);
    }
    kvserve::config::RequestFacts f;
    f.model = ea->model.empty() ? c.model_name() : ea->model;
    for (const auto& h : ea->headers) {
      auto eq = h.find('=');
      if (eq == std::string::npos) throw CLI::ValidationError("--header", "expected name=value, got '" + h + "'");
      std::string name = h.substr(0, eq);
      for (auto& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      f.headers[name] = h.substr(eq + 1);
    }
    f.user = ea->user;
    f.api_key_name = ea->api_key_name;
    f.prompt_tokens = ea->prompt_tokens;
    f.endpoint = ea->endpoint;
    f.request_id = ea->request_id;
    f.requested_policy = ea->kv_policy;
    auto d = kvserve::config::decide(c.rollout, f, c.default_policy);
    if (d.override_rejected) {
      std::cout << "rejected (400): kv_policy '" << ea->kv_policy << "' is not in rollout.allow_override\n";
      return;
    }
    std::cout << "rule: " << d.rule << "\npolicy: " << d.policy << "\narm: " << d.arm << "\n";
    if (d.max_draft_tokens)
      std::cout << "speculative: " << (*d.max_draft_tokens == 0 ? std::string("off") : "at most " + std::to_string(*d.max_draft_tokens) + " draft tokens") << "\n";
    if (d.arm == "canary" || d.arm == "base") {
      for (const auto& r : c.rollout.rules) {
        if (r.name != d.rule || !r.canary) continue;
        std::string key = r.canary->sticky_by == "user" ? f.user : "";
        if (r.canary->sticky_by.rfind("header:", 0) == 0) {
          std::string hn = r.canary->sticky_by.substr(7);
          for (auto& ch : hn) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
          auto it = f.headers.find(hn);
          if (it != f.headers.end()) key = it->second;
        }
        std::cout << "canary: " << r.canary->percent << "% to " << r.canary->policy << ", sticky by " << r.canary->sticky_by
                  << (key.empty() ? " (absent: the request id decides, so the arm varies per request)" : "") << "\n";
      }
    }
  });
}

}  // namespace kvserve::cli
