#pragma once
// ServerMetrics: counters and histograms for GET /metrics (Prometheus text format, vLLM-style names
// under the `kvserve:` prefix, every series labelled with model_name). Thread-safe.
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/engine/engine.h"

namespace kvserve::http {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // Appends `name_bucket{...,le=..}`, `name_sum`, `name_count` lines; `labels` is `k="v",...`.
  void render(std::string& out, const std::string& name, const std::string& labels) const;
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); last = +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

// Tokens a request kept per (layer, KV head) after prefill.
struct HeadKeptTokens {
  int64_t min = 0;
  double mean = 0.0;
  int64_t max = 0;
};

class ServerMetrics {
 public:
  explicit ServerMetrics(std::string model_name);

  // With a policy, also into the per-policy histogram (kvserve:kv_policy_*_seconds{policy=...}).
  void observe_ttft(double seconds, const std::string& policy = "");
  void observe_inter_token(double seconds);
  void observe_e2e(double seconds, const std::string& policy = "");
  // Time a request waited in the engine's queue, from arrival until the scheduler first admitted
  // it (the engine reports it through EngineOptions::on_queue_time; cmd_serve wires it here).
  void observe_queue_time(double seconds);
  // A finished engine request (one choice): its finish reason and policy's KV accounting.
  // With a rollout rule, also counted per (rule, policy).
  using HeadKept = HeadKeptTokens;
  void request_finished(const std::string& finish_reason, const std::string& policy, int64_t kept_kv_tokens,
                        int64_t full_kv_tokens, const std::string& rollout_rule = "", HeadKept head_kept = {});
  // A config reload attempt (SIGHUP or file change): success or not.
  void config_reload(bool ok);
  void http_response(int status);
  // A connection the transport closed or refused on its own: over_capacity, idle_timeout,
  // header_timeout, body_timeout, write_timeout, request_timeout, accept_error.
  void connection_closed(const std::string& reason);
  // A prompt under a `compress: context` policy, by where its context ended: messages (the turns
  // before the last user message), cache_control, kv_context, protected_question (a one-message
  // prompt: all but its question), none (compressed whole).
  void context_boundary(const std::string& kind);
  // Counts tokens the HTTP layer saw (used when the engine's stats are not available).
  void set_model_name(std::string name);

  // Prometheus text; `stats` is null while the model loads.
  std::string render(const std::optional<EngineStats>& stats) const;

 private:
  mutable std::mutex mu_;
  std::string model_name_;
  Histogram ttft_;
  Histogram itl_;
  Histogram e2e_;
  Histogram queue_;
  std::map<std::string, uint64_t> finished_;  // finish_reason -> count
  struct PolicyTotals {
    uint64_t requests = 0;
    uint64_t kept = 0;
    uint64_t full = 0;
    HeadKept head_kept;  // the latest finished request's
  };
  std::map<std::string, PolicyTotals> policies_;
  std::map<std::pair<std::string, std::string>, PolicyTotals> rules_;  // (rule, policy)
  std::map<std::string, Histogram> policy_ttft_, policy_e2e_;
  uint64_t reloads_ = 0, reload_failures_ = 0;
  bool last_reload_ok_ = true;
  std::map<int, uint64_t> http_status_;
  std::map<std::string, uint64_t> connections_closed_;
  std::map<std::string, uint64_t> context_boundaries_;
};

// kvserve series that vLLM exports too, as (kvserve name, vLLM name): /metrics repeats each under
// its vLLM name (same labels, model_name included), so that dashboards and autoscaling rules
// written for vLLM read kvserve unchanged. A new series with a vLLM twin adds a row here.
const std::vector<std::pair<std::string, std::string>>& vllm_metric_names();

// Prometheus text -> the lines of the series in vllm_metric_names() under their vLLM names.
std::string vllm_aliases(const std::string& text);

// Escapes a Prometheus label value (backslash, quote, newline).
std::string prometheus_escape(const std::string& value);

}  // namespace kvserve::http
