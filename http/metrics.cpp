// Prometheus text exposition of the server's metrics.
#include "http/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <tuple>

namespace kvserve::http {

namespace {

std::string fmt(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // Shorter form when it round-trips.
  char short_buf[64];
  std::snprintf(short_buf, sizeof short_buf, "%g", v);
  return std::strtod(short_buf, nullptr) == v ? short_buf : buf;
}

const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                          0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kItlBuckets = {0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                                         0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0};
const std::vector<double> kE2eBuckets = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                                         20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0};

void header(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n";
  out += "# TYPE " + name + " " + type + "\n";
}

}  // namespace

const std::vector<std::pair<std::string, std::string>>& vllm_metric_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"kvserve:num_requests_running", "vllm:num_requests_running"},
      {"kvserve:num_requests_waiting", "vllm:num_requests_waiting"},
      {"kvserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"},
      {"kvserve:prompt_tokens_total", "vllm:prompt_tokens_total"},
      {"kvserve:generation_tokens_total", "vllm:generation_tokens_total"},
      {"kvserve:num_preemptions_total", "vllm:num_preemptions_total"},
      {"kvserve:request_success_total", "vllm:request_success_total"},
      {"kvserve:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"},
      {"kvserve:inter_token_latency_seconds", "vllm:inter_token_latency_seconds"},
      {"kvserve:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"},
      {"kvserve:request_queue_time_seconds", "vllm:request_queue_time_seconds"},
      {"kvserve:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"},
      {"kvserve:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"},
      {"kvserve:spec_decode_num_drafts_total", "vllm:spec_decode_num_drafts_total"},
      {"kvserve:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens_total"},
      {"kvserve:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"},
      {"kvserve:spec_decode_num_accepted_tokens_per_pos_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total"},
  };
  return names;
}

std::string vllm_aliases(const std::string& text) {
  std::map<std::string, std::string> to;
  for (const auto& [k, v] : vllm_metric_names()) to[k] = v;
  // A histogram's series are its name plus one of these.
  static const char* kSuffixes[] = {"", "_bucket", "_sum", "_count"};
  auto rename = [&](const std::string& name) -> std::string {
    for (const char* suffix : kSuffixes) {
      const std::string sfx = suffix;
      if (name.size() < sfx.size() || name.compare(name.size() - sfx.size(), sfx.size(), sfx) != 0) continue;
      auto it = to.find(name.substr(0, name.size() - sfx.size()));
      if (it != to.end()) return it->second + sfx;
    }
    return "";
  };
  std::string out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    // "# HELP name ...", "# TYPE name ...", or "name{labels} value".
    const size_t name_at = line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0 ? 7 : 0;
    if (name_at == 0 && line.rfind("#", 0) == 0) continue;
    const size_t name_end = line.find_first_of("{ ", name_at);
    const std::string renamed = rename(line.substr(name_at, name_end - name_at));
    if (!renamed.empty()) out += line.substr(0, name_at) + renamed + line.substr(std::min(name_end, line.size())) + "\n";
  }
  return out;
}

std::string prometheus_escape(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  if (!std::isfinite(value)) return;
  size_t i = 0;
  while (i < bounds_.size() && value > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  uint64_t cumulative = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cumulative += counts_[i];
    std::string le = i < bounds_.size() ? fmt(bounds_[i]) : "+Inf";
    out += name + "_bucket{" + labels + ",le=\"" + le + "\"} " + std::to_string(cumulative) + "\n";
  }
  out += name + "_sum{" + labels + "} " + fmt(sum_) + "\n";
  out += name + "_count{" + labels + "} " + std::to_string(count_) + "\n";
}

ServerMetrics::ServerMetrics(std::string model_name)
    : model_name_(std::move(model_name)), ttft_(kTtftBuckets), itl_(kItlBuckets), e2e_(kE2eBuckets), queue_(kE2eBuckets) {
  for (const char* reason : {"stop", "length", "abort", "error"}) finished_[reason] = 0;
}

void ServerMetrics::set_model_name(std::string name) {
  std::lock_guard<std::mutex> lock(mu_);
  model_name_ = std::move(name);
}

void ServerMetrics::observe_ttft(double s, const std::string& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.observe(s);
  if (!policy.empty()) policy_ttft_.try_emplace(policy, kTtftBuckets).first->second.observe(s);
}
void ServerMetrics::observe_inter_token(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  itl_.observe(s);
}
void ServerMetrics::observe_e2e(double s, const std::string& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  e2e_.observe(s);
  if (!policy.empty()) policy_e2e_.try_emplace(policy, kE2eBuckets).first->second.observe(s);
}

void ServerMetrics::config_reload(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  ++reloads_;
  if (!ok) ++reload_failures_;
  last_reload_ok_ = ok;
}
void ServerMetrics::observe_queue_time(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  queue_.observe(s);
}

void ServerMetrics::request_finished(const std::string& reason, const std::string& policy, int64_t kept, int64_t full,
                                     const std::string& rule, HeadKept head_kept) {
  std::lock_guard<std::mutex> lock(mu_);
  ++finished_[reason.empty() ? "unknown" : reason];
  if (!policy.empty()) {
    auto& p = policies_[policy];
    ++p.requests;
    p.kept += static_cast<uint64_t>(std::max<int64_t>(kept, 0));
    p.full += static_cast<uint64_t>(std::max<int64_t>(full, 0));
    p.head_kept = head_kept;
    if (!rule.empty()) {
      auto& r = rules_[{rule, policy}];
      ++r.requests;
      r.kept += static_cast<uint64_t>(std::max<int64_t>(kept, 0));
      r.full += static_cast<uint64_t>(std::max<int64_t>(full, 0));
    }
  }
}

void ServerMetrics::http_response(int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++http_status_[status];
}

void ServerMetrics::connection_closed(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  ++connections_closed_[reason];
}

void ServerMetrics::context_boundary(const std::string& kind) {
  std::lock_guard<std::mutex> lock(mu_);
  ++context_boundaries_[kind];
}

std::string ServerMetrics::render(const std::optional<EngineStats>& stats) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string model = "model_name=\"" + prometheus_escape(model_name_) + "\"";
  std::string out;
  auto gauge = [&](const char* name, const char* help, double v) {
    header(out, name, "gauge", help);
    out += std::string(name) + "{" + model + "} " + fmt(v) + "\n";
  };
  auto counter = [&](const char* name, const char* help, double v) {
    header(out, name, "counter", help);
    out += std::string(name) + "{" + model + "} " + fmt(v) + "\n";
  };
  EngineStats s = stats.value_or(EngineStats{});
  gauge("kvserve:num_requests_running", "Requests in the running batch.", static_cast<double>(s.running));
  gauge("kvserve:num_requests_waiting", "Requests waiting to be scheduled.", static_cast<double>(s.waiting));
  gauge("kvserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
        s.kv_blocks_total > 0 ? static_cast<double>(s.kv_blocks_used) / static_cast<double>(s.kv_blocks_total) : 0.0);
  gauge("kvserve:kv_cache_blocks_used", "KV-cache blocks in use.", static_cast<double>(s.kv_blocks_used));
  gauge("kvserve:kv_cache_blocks_total", "KV-cache blocks in the pool.", static_cast<double>(s.kv_blocks_total));
  gauge("kvserve:kv_cache_blocks_high_water", "Most KV-cache blocks ever in use at once.",
        static_cast<double>(s.kv_blocks_high_water));
  gauge("kvserve:kv_cache_bytes_used", "Bytes of the KV-cache blocks in use (what the KV cache dtype makes of them).",
        static_cast<double>(s.kv_bytes_used));
  gauge("kvserve:kv_cache_bytes_total", "Bytes of the KV-cache pool.", static_cast<double>(s.kv_bytes_total));
  if (!s.kv_bytes_used_by_dtype.empty()) {
    header(out, "kvserve:kv_cache_bytes_used_by_dtype", "gauge",
           "Bytes of the KV-cache blocks in use per KV cache dtype (policies may store theirs in their own).");
    for (const auto& [dtype, bytes] : s.kv_bytes_used_by_dtype)
      out += "kvserve:kv_cache_bytes_used_by_dtype{" + model + ",kv_dtype=\"" + prometheus_escape(dtype) + "\"} " +
             fmt(static_cast<double>(bytes)) + "\n";
  }
  counter("kvserve:prompt_tokens_total", "Prefilled prompt tokens.", static_cast<double>(s.prompt_tokens_total));
  counter("kvserve:generation_tokens_total", "Generated tokens.", static_cast<double>(s.generation_tokens_total));
  counter("kvserve:num_preemptions_total", "Preemptions (recompute).", static_cast<double>(s.preemptions_total));
  counter("kvserve:kv_cache_admission_waits_total", "Steps whose next waiting prompt did not fit the KV cache.",
          static_cast<double>(s.kv_admission_waits_total));
  counter("kvserve:engine_steps_total", "Engine scheduler steps.", static_cast<double>(s.steps_total));
  counter("kvserve:spec_decode_num_drafts_total", "Speculative decoding: verify steps of a sequence with drafts.",
          static_cast<double>(s.spec_decode_num_drafts));
  counter("kvserve:spec_decode_num_draft_tokens_total", "Speculative decoding: draft tokens proposed.",
          static_cast<double>(s.spec_decode_num_draft_tokens));
  counter("kvserve:spec_decode_num_accepted_tokens_total", "Speculative decoding: draft tokens accepted.",
          static_cast<double>(s.spec_decode_num_accepted_tokens));
  counter("kvserve:spec_decode_draft_steps_total", "Speculative decoding: self-draft forward steps.",
          static_cast<double>(s.spec_decode_draft_steps));
  counter("kvserve:spec_decode_draft_prefix_cache_hits_total",
          "Speculative decoding: prompt tokens a draft model of another shape took from its own prefix cache.",
          static_cast<double>(s.spec_decode_draft_prefix_hits));
  counter("kvserve:spec_decode_draft_seconds_total", "Speculative decoding: seconds the self-draft steps took.",
          s.spec_decode_draft_seconds);
  counter("kvserve:spec_decode_verify_steps_total", "Speculative decoding: decode steps that verified drafts.",
          static_cast<double>(s.spec_decode_verify_steps));
  counter("kvserve:spec_decode_verify_seconds_total",
          "Speculative decoding: seconds of the forwards and sampling that verified drafts.", s.spec_decode_verify_seconds);
  counter("kvserve:spec_decode_pauses_total",
          "Speculative decoding: pauses because steps with drafts emitted fewer tokens per second than plain ones.",
          static_cast<double>(s.spec_decode_pauses));
  header(out, "kvserve:spec_decode_num_accepted_tokens_per_pos_total", "counter",
         "Speculative decoding: draft tokens accepted, per draft position (0 = the first draft).");
  for (size_t i = 0; i < s.spec_decode_accepted_per_pos.size(); ++i)
    out += "kvserve:spec_decode_num_accepted_tokens_per_pos_total{" + model + ",position=\"" + std::to_string(i) + "\"} " +
           fmt(static_cast<double>(s.spec_decode_accepted_per_pos[i])) + "\n";
  counter("kvserve:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
          static_cast<double>(s.prefix_cache_queries_total));
  counter("kvserve:prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
          static_cast<double>(s.prefix_cache_hits_total));
  gauge("kvserve:kv_cache_blocks_cached", "KV-cache blocks held by the prefix cache (in use by requests or reclaimable).",
        static_cast<double>(s.kv_blocks_cached));
  header(out, "kvserve:prefix_cache_bytes", "gauge", "Bytes of cached prefix blocks, per tier.");
  out += "kvserve:prefix_cache_bytes{" + model + ",tier=\"pool\"} " + fmt(static_cast<double>(s.prefix_cache_bytes)) + "\n";
  out += "kvserve:prefix_cache_bytes{" + model + ",tier=\"conversation\"} " +
         fmt(static_cast<double>(s.conversation_cache_bytes)) + "\n";
  out += "kvserve:prefix_cache_bytes{" + model + ",tier=\"context\"} " +
         fmt(static_cast<double>(s.compressed_context_bytes)) + "\n";
  out += "kvserve:prefix_cache_bytes{" + model + ",tier=\"host\"} " + fmt(static_cast<double>(s.prefix_cache_host_bytes)) +
         "\n";
  gauge("kvserve:prefix_cache_host_capacity_bytes", "Size of the prefix cache's host-RAM tier (cache.prefix_cache_bytes).",
        static_cast<double>(s.prefix_cache_host_capacity_bytes));
  counter("kvserve:prefix_cache_host_stores_total", "Cached blocks (one per layer each) moved from the pool to the host tier.",
          static_cast<double>(s.prefix_cache_host_stores_total));
  counter("kvserve:prefix_cache_host_loads_total", "Cached blocks (one per layer each) copied back from the host tier on a hit.",
          static_cast<double>(s.prefix_cache_host_loads_total));
  gauge("kvserve:compressed_contexts", "Compressed contexts kept for later requests (compress: context policies).",
        static_cast<double>(s.compressed_contexts));
  gauge("kvserve:kv_cache_blocks_compressed_contexts",
        "KV-cache blocks the compressed contexts hold (in use by requests or reclaimable).",
        static_cast<double>(s.kv_blocks_compressed_contexts));
  gauge("kvserve:compressed_context_full_blocks", "KV-cache blocks the same contexts would hold uncompressed.",
        static_cast<double>(s.compressed_context_full_blocks));
  gauge("kvserve:conversations_parked", "Finished requests whose compressed KV waits for their conversation's next turn.",
        static_cast<double>(s.conversations_parked));
  gauge("kvserve:kv_cache_blocks_parked", "KV-cache blocks parked conversations hold (counted in use).",
        static_cast<double>(s.kv_blocks_parked));
  counter("kvserve:step_collectives_total", "Control-path collectives of a sharded job's steps (0 in one process).",
          static_cast<double>(s.step_collectives_total));
  counter("kvserve:cuda_graph_captures_total",
          "CUDA graph captures of decode steps, the start-up warm-up's included (a growing context is captured again).",
          static_cast<double>(s.cuda_graph_captures_total));
  counter("kvserve:cuda_graph_capture_seconds_total", "Host seconds the decode steps waited for those captures.",
          s.cuda_graph_capture_seconds_total);

  header(out, "kvserve:request_success_total", "counter", "Finished requests by finish reason.");
  for (const auto& [reason, n] : finished_)
    out += "kvserve:request_success_total{" + model + ",finished_reason=\"" + prometheus_escape(reason) + "\"} " +
           std::to_string(n) + "\n";

  header(out, "kvserve:time_to_first_token_seconds", "histogram", "Time to first token.");
  ttft_.render(out, "kvserve:time_to_first_token_seconds", model);
  header(out, "kvserve:inter_token_latency_seconds", "histogram", "Time between generated tokens.");
  itl_.render(out, "kvserve:inter_token_latency_seconds", model);
  header(out, "kvserve:e2e_request_latency_seconds", "histogram", "End-to-end request latency.");
  e2e_.render(out, "kvserve:e2e_request_latency_seconds", model);
  header(out, "kvserve:request_queue_time_seconds", "histogram",
         "Time a request waited in the queue, from arrival until the scheduler first admitted it.");
  queue_.render(out, "kvserve:request_queue_time_seconds", model);

  header(out, "kvserve:kv_requests_total", "counter", "Finished requests per KV policy.");
  for (const auto& [policy, t] : policies_)
    out += "kvserve:kv_requests_total{" + model + ",policy=\"" + prometheus_escape(policy) + "\"} " +
           std::to_string(t.requests) + "\n";
  header(out, "kvserve:kv_kept_tokens_total", "counter", "KV tokens kept after prefill, all layers, per policy.");
  for (const auto& [policy, t] : policies_)
    out += "kvserve:kv_kept_tokens_total{" + model + ",policy=\"" + prometheus_escape(policy) + "\"} " +
           std::to_string(t.kept) + "\n";
  header(out, "kvserve:kv_head_kept_tokens", "gauge",
         "Tokens the policy's latest finished request kept per (layer, KV head): min, mean, max.");
  for (const auto& [policy, t] : policies_) {
    const std::string labels = "kvserve:kv_head_kept_tokens{" + model + ",policy=\"" + prometheus_escape(policy) + "\",stat=";
    out += labels + "\"min\"} " + std::to_string(t.head_kept.min) + "\n";
    out += labels + "\"mean\"} " + fmt(t.head_kept.mean) + "\n";
    out += labels + "\"max\"} " + std::to_string(t.head_kept.max) + "\n";
  }
  header(out, "kvserve:kv_full_tokens_total", "counter", "KV tokens full attention would have kept, per policy.");
  for (const auto& [policy, t] : policies_)
    out += "kvserve:kv_full_tokens_total{" + model + ",policy=\"" + prometheus_escape(policy) + "\"} " +
           std::to_string(t.full) + "\n";
  header(out, "kvserve:kv_compression_ratio", "gauge", "Kept / full KV tokens so far, per policy.");
  for (const auto& [policy, t] : policies_)
    out += "kvserve:kv_compression_ratio{" + model + ",policy=\"" + prometheus_escape(policy) + "\"} " +
           fmt(t.full > 0 ? static_cast<double>(t.kept) / static_cast<double>(t.full) : 1.0) + "\n";

  for (const auto& [name, help, hist] :
       {std::tuple<const char*, const char*, const std::map<std::string, Histogram>*>{
            "kvserve:kv_policy_time_to_first_token_seconds", "Time to first token per KV policy.", &policy_ttft_},
        {"kvserve:kv_policy_e2e_request_latency_seconds", "End-to-end request latency per KV policy.", &policy_e2e_}}) {
    header(out, name, "histogram", help);
    for (const auto& [policy, h] : *hist) h.render(out, name, model + ",policy=\"" + prometheus_escape(policy) + "\"");
  }
  auto rule_series = [&](const char* name, const char* help, auto value) {
    header(out, name, "counter", help);
    for (const auto& [key, t] : rules_)
      out += std::string(name) + "{" + model + ",rule=\"" + prometheus_escape(key.first) + "\",policy=\"" +
             prometheus_escape(key.second) + "\"} " + std::to_string(value(t)) + "\n";
  };
  rule_series("kvserve:rollout_requests_total", "Finished requests per rollout rule and policy.",
              [](const PolicyTotals& t) { return t.requests; });
  rule_series("kvserve:rollout_kept_tokens_total", "KV tokens kept per rollout rule and policy.",
              [](const PolicyTotals& t) { return t.kept; });
  rule_series("kvserve:rollout_full_tokens_total", "KV tokens full attention would keep, per rollout rule and policy.",
              [](const PolicyTotals& t) { return t.full; });
  counter("kvserve:config_reloads_total", "Config reload attempts (SIGHUP or file change).", static_cast<double>(reloads_));
  counter("kvserve:config_reload_failures_total", "Config reloads rejected (the previous config stays).",
          static_cast<double>(reload_failures_));
  gauge("kvserve:config_last_reload_success", "1 if the last reload (or the startup config) was applied.",
        last_reload_ok_ ? 1.0 : 0.0);

  header(out, "kvserve:http_responses_total", "counter", "HTTP responses by status code.");
  for (const auto& [status, n] : http_status_)
    out += "kvserve:http_responses_total{" + model + ",status=\"" + std::to_string(status) + "\"} " +
           std::to_string(n) + "\n";
  header(out, "kvserve:http_connections_closed_total", "counter",
         "Connections the server closed or refused on its own, by reason (timeouts, over capacity).");
  for (const auto& [reason, n] : connections_closed_)
    out += "kvserve:http_connections_closed_total{" + model + ",reason=\"" + prometheus_escape(reason) + "\"} " +
           std::to_string(n) + "\n";
  header(out, "kvserve:kv_context_boundary_total", "counter",
         "Prompts under compress: context policies by where their context ended (messages, cache_control, "
         "kv_context, protected_question, none).");
  for (const auto& [kind, n] : context_boundaries_)
    out += "kvserve:kv_context_boundary_total{" + model + ",kind=\"" + prometheus_escape(kind) + "\"} " +
           std::to_string(n) + "\n";
  return out + vllm_aliases(out);
}

}  // namespace kvserve::http
