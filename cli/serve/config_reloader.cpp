#include "cli/serve/config_reloader.h"

#include <chrono>
#include <filesystem>
#include <iostream>

#include "cli/cli_files.h"
#include "common/log.h"
#include "http/metrics.h"

namespace kvserve::cli {

std::vector<std::string> restart_only_changes(const config::ServerConfig& a, const config::ServerConfig& b) {
  std::vector<std::string> out;
  if (a.model.path != b.model.path || a.model.served_model_name != b.model.served_model_name ||
      a.model.device != b.model.device || a.model.dtype != b.model.dtype || a.model.max_model_len != b.model.max_model_len ||
      a.model.enforce_eager != b.model.enforce_eager || a.model.warmup_tokens != b.model.warmup_tokens ||
      a.model.quantization != b.model.quantization || a.model.tokenizer != b.model.tokenizer)
    out.push_back("model");
  if (a.server.host != b.server.host || a.server.port != b.server.port || a.server.api_key != b.server.api_key ||
      a.server.api_keys != b.server.api_keys || a.server.threads != b.server.threads ||
      a.server.max_body_bytes != b.server.max_body_bytes || a.server.request_timeout_s != b.server.request_timeout_s ||
      a.server.idle_timeout_s != b.server.idle_timeout_s || a.server.drain_timeout_s != b.server.drain_timeout_s ||
      a.server.max_concurrent_connections != b.server.max_concurrent_connections ||
      a.server.header_timeout_s != b.server.header_timeout_s || a.server.write_timeout_s != b.server.write_timeout_s ||
      a.server.retry_after_s != b.server.retry_after_s || a.server.allowed_origins != b.server.allowed_origins ||
      a.server.strict_fields != b.server.strict_fields || a.server.protect_last_tokens != b.server.protect_last_tokens)
    out.push_back("server");
  if (a.cache.block_size != b.cache.block_size || a.cache.kv_cache_bytes != b.cache.kv_cache_bytes ||
      a.cache.kv_cache_dtype != b.cache.kv_cache_dtype)
    out.push_back("cache");
  if (a.scheduler.max_num_seqs != b.scheduler.max_num_seqs ||
      a.scheduler.max_num_batched_tokens != b.scheduler.max_num_batched_tokens ||
      a.scheduler.enable_chunked_prefill != b.scheduler.enable_chunked_prefill ||
      a.scheduler.long_prefill_token_threshold != b.scheduler.long_prefill_token_threshold ||
      a.scheduler.max_waiting != b.scheduler.max_waiting || a.scheduler.max_queue_time_s != b.scheduler.max_queue_time_s)
    out.push_back("scheduler");
  if (a.speculative != b.speculative) out.push_back("speculative_config");
  if (config::engine_policies(a) != config::engine_policies(b)) out.push_back("policies");
  return out;
}

ConfigReloader::ConfigReloader(std::string path, std::optional<std::string> startup_text,
                               const config::ServerConfig& startup, Resolve resolve)
    : path_(std::move(path)), resolve_(std::move(resolve)), running_(startup), last_text_(std::move(startup_text)) {
  set(startup);
}

ConfigReloader::~ConfigReloader() { stop_watching(); }

std::shared_ptr<const ConfigReloader::Snapshot> ConfigReloader::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

void ConfigReloader::set(const config::ServerConfig& c) {
  auto snap = std::make_shared<Snapshot>(Snapshot{c.rollout, c.default_policy});
  std::lock_guard<std::mutex> lock(mu_);
  current_ = std::move(snap);
}

void ConfigReloader::attach(std::set<std::string> engine_policies, http::ServerMetrics* metrics) {
  std::lock_guard<std::mutex> lock(reload_mu_);
  engine_policies_ = std::move(engine_policies);
  metrics_ = metrics;
}

void ConfigReloader::reload(const char* why) {
  std::lock_guard<std::mutex> lock(reload_mu_);
  if (path_.empty()) {
    KV_LOG(why << ": no --config file to reload");
    return;
  }
  const std::optional<std::string> text = try_read_text_file(path_);
  if (text && last_text_ && *text == *last_text_) {
    KV_LOG(why << ": " << path_ << " unchanged since it was last loaded; not reloaded");
    return;
  }
  last_text_ = text;
  auto count = [&](bool ok) {
    if (metrics_) metrics_->config_reload(ok);
  };
  try {
    config::ServerConfig next = resolve_(text ? &*text : nullptr);
    auto issues = config::validate_rollout(next.rollout, engine_policies_, next.source);
    if (!engine_policies_.count(next.default_policy))
      issues.push_back({next.source, 0, 0, "default_policy",
                        "'" + next.default_policy + "' is not a policy of the running engine (new policies need a restart)"});
    if (!issues.empty()) throw config::ConfigError(issues);
    const auto ignored = restart_only_changes(running_, next);
    set(next);
    count(true);
    std::cerr << "kvserve: " << why << ": config reloaded from " << path_ << " (" << next.rollout.rules.size()
              << " rollout rule(s), default policy " << next.default_policy << ")";
    if (!ignored.empty()) {
      std::cerr << "; changes to";
      for (const auto& s : ignored) std::cerr << " " << s;
      std::cerr << " need a restart and were not applied";
    }
    std::cerr << std::endl;
  } catch (const config::ConfigError& e) {
    count(false);
    KV_LOG(why << ": config reload failed; the previous config stays in force:\n"
              << e.what());
  } catch (const std::exception& e) {
    count(false);
    KV_LOG(why << ": config reload failed; the previous config stays in force: " << e.what());
  }
}

void ConfigReloader::start_watching() {
  if (path_.empty() || watcher_.joinable()) return;
  watcher_ = std::thread([this] {
    namespace fs = std::filesystem;
    std::error_code ec;
    auto last = fs::last_write_time(path_, ec);
    while (!stop_watch_.load()) {
      for (int i = 0; i < 10 && !stop_watch_.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (stop_watch_.load()) break;
      std::error_code ec2;
      auto now = fs::last_write_time(path_, ec2);
      if (!ec2 && now != last) {
        last = now;
        reload("file change");
      }
    }
  });
}

void ConfigReloader::stop_watching() {
  stop_watch_ = true;
  if (watcher_.joinable()) watcher_.join();
}

}  // namespace kvserve::cli
