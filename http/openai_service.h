#pragma once
// OpenAIService: the routes of the OpenAI-compatible API over a ServingBackend, independent of the
// transport: /v1/completions, /v1/chat/completions (JSON or SSE), /v1/models, /health, /version,
// /metrics. Auth, error bodies and per-request metrics live here.
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "http/http_types.h"
#include "http/metrics.h"
#include "http/request_parser.h"
#include "http/serving_backend.h"

namespace kvserve::http {

struct ServiceOptions {
  std::string model_name = "model";
  std::string api_key;  // empty = no auth
  ParserLimits limits;
  bool log_requests = true;
  // Picks the KV policy of a request that names none (rollout rules go here); "" = the default.
  std::function<std::string(const HttpRequest&, const ParsedRequest&)> policy_resolver;
  // Rollout rules (replaces policy_resolver when set): called after tokenization with the longest
  // prompt's length and the response id; sees the request's own kv_policy and decides whether it
  // may override (throw ApiError to refuse). Empty policy = the default. `rule` is reported in the
  // X-KV-Rollout-Rule header, usage.kv_rollout_rule and /metrics.
  struct PolicyChoice {
    std::string policy;
    std::string rule;
    int64_t max_draft_tokens = -1;  // >= 0: the rule's cap on draft tokens a step (0 = no speculation)
  };
  std::function<PolicyChoice(const HttpRequest&, const ParsedRequest&, int64_t prompt_tokens, const std::string& request_id)>
      rollout_resolver;
  // Named API keys (name -> key), accepted besides api_key; auth is required if either is set.
  std::map<std::string, std::string> api_keys;
  // Seconds sent in Retry-After with every 429 (queue full) and 503 (loading, shutting down).
  int retry_after_s = 1;
  // How the model writes tool calls: "auto" (read from the chat template), hermes, llama3_json, mistral.
  std::string tool_call_parser = "auto";
  // A prompt with no context boundary under a `compress: context` policy keeps at least this many
  // last tokens (its question) whole and compresses the rest as its context; 0 = compress it whole.
  int64_t protect_last_tokens = 64;
};

// The Bearer token of a request ("" = none).
std::string bearer_token(const HttpRequest& req);

class OpenAIService {
 public:
  explicit OpenAIService(ServiceOptions options);

  // Installs the loaded model (before this, /health and the API answer 503).
  void set_backend(std::shared_ptr<ServingBackend> backend);
  std::shared_ptr<ServingBackend> backend() const;
  // Stop taking new generation requests (503); in-flight ones continue.
  void begin_shutdown() { shutting_down_ = true; }
  bool shutting_down() const { return shutting_down_; }
  // Generation requests still producing output.
  int64_t in_flight() const { return in_flight_->load(); }

  // Handles one request: answers through `channel`, now or later (from the engine's thread).
  void handle(HttpRequest request, std::shared_ptr<ResponseChannel> channel);

  ServerMetrics& metrics() { return *metrics_; }
  const ServiceOptions& options() const { return options_; }

 private:
  HttpResponse route_simple(const HttpRequest& req, bool& handled);
  void generate(const HttpRequest& req, Endpoint endpoint, std::shared_ptr<ResponseChannel> channel);
  bool authorized(const HttpRequest& req) const;

  ServiceOptions options_;
  mutable std::mutex mu_;
  std::shared_ptr<ServingBackend> backend_;
  std::atomic<bool> shutting_down_{false};
  std::shared_ptr<std::atomic<int64_t>> in_flight_ = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<ServerMetrics> metrics_;
  std::chrono::system_clock::time_point started_ = std::chrono::system_clock::now();
};

// The error response for an ApiError (JSON body, status).
HttpResponse error_response(const ApiError& error);

// Version string reported by GET /version.
const char* kvserve_version();

}  // namespace kvserve::http
