#pragma once
// ConfigReloader: applies edits of a running server's YAML config (on SIGHUP or when the file's
// mtime changes). Only the rollout rules and the default policy change live; everything else needs
// a restart and is reported as such. A bad edit leaves the previous config in force.
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "configs/server_config.h"

namespace kvserve::http {
class ServerMetrics;
}

namespace kvserve::cli {

class ConfigReloader {
 public:
  // The reloadable part, swapped whole: a request resolves its policy once, at admission, against
  // the snapshot current then.
  struct Snapshot {
    config::RolloutConfig rollout;
    std::string default_policy;
  };
  // Re-reads the config from `text` (the file's bytes; null = unreadable) with the command line's
  // overrides applied; throws ConfigError.
  using Resolve = std::function<config::ServerConfig(const std::string* text)>;

  // `path` empty: no config file (nothing to reload). `startup_text`: the bytes `startup` came from.
  ConfigReloader(std::string path, std::optional<std::string> startup_text, const config::ServerConfig& startup,
                 Resolve resolve);
  ~ConfigReloader();  // stops watching

  std::shared_ptr<const Snapshot> current() const;
  // Reloads validate against the running engine's policies (new ones need a restart) and count
  // in `metrics`; call once the engine is up.
  void attach(std::set<std::string> engine_policies, http::ServerMetrics* metrics);
  // Re-reads the file now; `why` prefixes the log lines ("SIGHUP", "file change").
  void reload(const char* why);
  // Polls the file's mtime about once a second on a thread of its own.
  void start_watching();
  void stop_watching();

 private:
  void set(const config::ServerConfig& c);

  const std::string path_;
  const Resolve resolve_;
  mutable std::mutex mu_;  // guards current_
  std::shared_ptr<const Snapshot> current_;
  std::mutex reload_mu_;  // one reload at a time; guards the members below
  config::ServerConfig running_;
  // One edit often fires both triggers (an editor's save plus a SIGHUP, or two mtime changes for
  // one save): bytes equal to the last applied or attempted load are not reloaded (nor counted).
  std::optional<std::string> last_text_;
  std::set<std::string> engine_policies_;
  http::ServerMetrics* metrics_ = nullptr;
  std::atomic<bool> stop_watch_{false};
  std::thread watcher_;
};

// Which restart-only settings differ between two configs ("model", "server", ...).
std::vector<std::string> restart_only_changes(const config::ServerConfig& a, const config::ServerConfig& b);

}  // namespace kvserve::cli
