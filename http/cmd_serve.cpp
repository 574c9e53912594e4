// `kvserve serve`: YAML config + CLI overrides -> load the model -> OpenAI-compatible HTTP server.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>

#include "commands.h"
#include "engine.h"
#include "kv_check.h"
#include "llama_model.h"
#include "openai_service.h"
#include "server.h"
#include "server_config.h"
#include "tokenizer.h"

namespace kvserve::cli {

namespace {

struct ServeArgs {
  std::string config;
  std::optional<std::string> host, model, served_model_name, device, dtype, api_key, kv_cache_bytes, max_body_bytes,
      default_policy;
  std::optional<int> port, threads;
  std::optional<int64_t> block_size, max_num_seqs, max_num_batched_tokens, max_waiting, max_model_len;
  bool quiet = false;
};

// Applies CLI flags over the YAML values; returns the validated config.
config::ServerConfig resolve_config(const ServeArgs& a) {
  config::ServerConfig c = a.config.empty() ? config::default_server_config() : config::load_server_config(a.config);
  std::vector<config::ConfigIssue> issues;
  auto bytes = [&](const std::optional<std::string>& v, int64_t& out, const char* flag) {
    if (!v) return;
    try {
      out = config::parse_byte_size(*v);
    } catch (const std::invalid_argument& e) {
      issues.push_back({"command line", 0, 0, flag, e.what()});
    }
  };
  if (a.host) c.server.host = *a.host;
  if (a.port) c.server.port = *a.port;
  if (a.threads) c.server.threads = *a.threads;
  if (a.model) {
    c.model.path = *a.model;
    if (!a.served_model_name) c.model.served_model_name.clear();
  }
  if (a.served_model_name) c.model.served_model_name = *a.served_model_name;
  if (a.device) c.model.device = *a.device;
  if (a.dtype) c.model.dtype = *a.dtype;
  if (a.max_model_len) c.model.max_model_len = *a.max_model_len;
  if (a.api_key) c.server.api_key = *a.api_key;
  bytes(a.kv_cache_bytes, c.cache.kv_cache_bytes, "--kv-cache-bytes");
  bytes(a.max_body_bytes, c.server.max_body_bytes, "--max-body-bytes");
  if (a.block_size) c.cache.block_size = *a.block_size;
  if (a.max_num_seqs) c.scheduler.max_num_seqs = *a.max_num_seqs;
  if (a.max_num_batched_tokens) c.scheduler.max_num_batched_tokens = *a.max_num_batched_tokens;
  if (a.max_waiting) c.scheduler.max_waiting = *a.max_waiting;
  if (a.default_policy) c.default_policy = *a.default_policy;
  for (auto& i : config::validate(c)) {
    i.file = "command line / " + c.source;
    issues.push_back(i);
  }
  if (!issues.empty()) throw config::ConfigError(issues);
  return c;
}

// SIGINT/SIGTERM are blocked in every thread and taken by one waiter thread.
class SignalWaiter {
 public:
  SignalWaiter() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
    thread_ = std::thread([this] {
      int sig = 0;
      while (sigwait(&set_, &sig) == 0) {
        if (sig == SIGINT || sig == SIGTERM) break;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        signal_ = sig;
      }
      cv_.notify_all();
      if (on_signal_ && !stopping_) on_signal_(sig);
    });
  }
  ~SignalWaiter() {
    if (thread_.joinable()) {
      stopping_ = true;
      if (!received()) pthread_kill(thread_.native_handle(), SIGTERM);
      thread_.join();
    }
  }
  // Runs on the waiter thread when a signal arrives (set before one can arrive).
  void set_handler(std::function<void(int)> fn) { on_signal_ = std::move(fn); }
  int wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return signal_ != 0; });
    return signal_;
  }
  bool received() {
    std::lock_guard<std::mutex> lock(mu_);
    return signal_ != 0;
  }

 private:
  sigset_t set_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  int signal_ = 0;
  std::function<void(int)> on_signal_;
  std::atomic<bool> stopping_{false};
};

int serve(const ServeArgs& a) {
  config::ServerConfig cfg = resolve_config(a);
  const std::string api_key = config::effective_api_key(cfg.server);
  const std::string model_name = cfg.model_name();

  std::atomic<bool> loaded{false};
  SignalWaiter signals;
  signals.set_handler([&loaded](int sig) {
    if (!loaded.load()) {
      std::cerr << "kvserve: signal " << sig << " while loading; exiting\n";
      std::_Exit(0);
    }
  });

  http::ServiceOptions so;
  so.model_name = model_name;
  so.api_key = api_key;
  so.log_requests = !a.quiet;
  auto service = std::make_shared<http::OpenAIService>(so);
  http::ServerOptions sopt;
  sopt.host = cfg.server.host;
  sopt.port = cfg.server.port;
  sopt.threads = cfg.server.threads;
  sopt.max_body_bytes = cfg.server.max_body_bytes;
  sopt.request_timeout_s = cfg.server.request_timeout_s;
  sopt.idle_timeout_s = cfg.server.idle_timeout_s;
  sopt.max_concurrent_connections = cfg.server.max_concurrent_connections;
  sopt.log_requests = !a.quiet;
  http::HttpServer server(sopt, service);
  server.start();
  std::cerr << "kvserve: listening on http://" << cfg.server.host << ":" << server.port() << " (model '" << model_name
            << "' loading; /health answers 503 until it is ready)" << (api_key.empty() ? "" : "; API key required")
            << std::endl;

  // Load the model while /health says 503.
  auto t0 = std::chrono::steady_clock::now();
  std::cerr << "kvserve: loading " << cfg.model.path << " on " << cfg.model.device << std::endl;
  std::string dtype = cfg.model.dtype == "auto" ? "" : cfg.model.dtype;
  if (dtype == "fp32") dtype = "float32";
  if (dtype == "bf16") dtype = "bfloat16";
  if (dtype == "fp16") dtype = "float16";
  auto model = LlamaModel::load(cfg.model.path, LoadOptions{cfg.model.device, dtype, true});
  auto tokenizer = std::make_shared<Tokenizer>(Tokenizer::from_dir(cfg.model.path));
  EngineOptions eo;
  eo.max_num_seqs = cfg.scheduler.max_num_seqs;
  eo.max_num_batched_tokens = cfg.scheduler.max_num_batched_tokens;
  eo.max_waiting = cfg.scheduler.max_waiting;
  eo.max_model_len = cfg.model.max_model_len;
  eo.kv_cache_bytes = cfg.cache.kv_cache_bytes;
  eo.block_size = cfg.cache.block_size;
  eo.default_policy = cfg.default_policy;
  eo.policies = config::engine_policies(cfg);
  const int64_t max_model_len =
      cfg.model.max_model_len > 0 ? cfg.model.max_model_len : model->config().max_position_embeddings;
  auto engine = std::make_unique<Engine>(model, tokenizer, eo);
  service->set_backend(http::make_engine_backend(std::move(engine), tokenizer, max_model_len, cfg.default_policy));
  loaded = true;
  std::cerr << "kvserve: ready in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s: model '"
            << model_name << "', max_model_len " << max_model_len << ", policies";
  for (const auto& [n, p] : cfg.policies) std::cerr << " " << n << (n == cfg.default_policy ? "*" : "");
  std::cerr << std::endl;

  int sig = signals.wait();
  std::cerr << "kvserve: signal " << sig << ": no new connections; draining " << service->in_flight()
            << " request(s) for at most " << cfg.server.drain_timeout_s << " s" << std::endl;
  server.stop_accepting();
  service->begin_shutdown();
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(cfg.server.drain_timeout_s));
  while (service->in_flight() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const int64_t left = service->in_flight();
  auto backend = service->backend();
  backend->shutdown(/*drain=*/false);  // aborts what is left; their streams get a final chunk
  if (left > 0) {
    std::cerr << "kvserve: aborted " << left << " request(s) still running at the drain deadline" << std::endl;
    auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (service->in_flight() > 0 && std::chrono::steady_clock::now() < flush_deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  server.stop();
  std::cerr << "kvserve: stopped" << std::endl;
  return 0;
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  auto* cmd = app.add_subcommand("serve", "Serve the OpenAI-compatible HTTP API");
  cmd->add_option("--config,-c", a->config, "YAML config file (configs/default.yaml is a starting point)");
  cmd->add_option("--host", a->host, "listen address (default 127.0.0.1)");
  cmd->add_option("--port", a->port, "listen port (0 = any free port)");
  cmd->add_option("--model", a->model, "model directory (overrides model.path)");
  cmd->add_option("--served-model-name", a->served_model_name, "name clients use as `model`");
  cmd->add_option("--device", a->device, "cpu, cuda or cuda:N");
  cmd->add_option("--dtype", a->dtype, "float32, bfloat16, float16 or auto");
  cmd->add_option("--max-model-len", a->max_model_len, "context length limit (0 = the model's)");
  cmd->add_option("--api-key", a->api_key, "require Authorization: Bearer <key> (also $KVSERVE_API_KEY)");
  cmd->add_option("--threads", a->threads, "HTTP I/O threads");
  cmd->add_option("--max-body-bytes", a->max_body_bytes, "request body limit, e.g. 1MiB");
  cmd->add_option("--kv-cache-bytes", a->kv_cache_bytes, "KV cache pool size, e.g. 2GiB");
  cmd->add_option("--block-size", a->block_size, "KV cache block size in tokens");
  cmd->add_option("--max-num-seqs", a->max_num_seqs, "sequences decoding at once");
  cmd->add_option("--max-num-batched-tokens", a->max_num_batched_tokens, "prompt tokens prefilled per step");
  cmd->add_option("--max-waiting", a->max_waiting, "queued requests before 429");
  cmd->add_option("--default-policy", a->default_policy, "KV policy for requests that name none");
  cmd->add_flag("--quiet,-q", a->quiet, "no per-request log lines");
  cmd->callback([a] {
    int rc = serve(*a);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace kvserve::cli
