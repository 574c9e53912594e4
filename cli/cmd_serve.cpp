// `kvserve serve`: YAML config + CLI overrides -> load the model -> OpenAI-compatible HTTP server.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <set>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>

#include "backend/engine/engine.h"
#include "backend/quantization/gguf_tokenizer.h"
#include "backend/engine/scheduler.h"
#include "backend/model/decoder_model.h"
#include "cli/cli_files.h"
#include "cli/commands.h"
#include "cli/kv_cache_dtype_cli.h"
#include "cli/quantization_cli.h"
#include "cli/speculative_cli.h"
#include "cli/parallel_cli.h"
#include "cli/serve/config_reloader.h"
#include "cli/serve/signal_waiter.h"
#include "common/check.h"
#include "common/fresh_thread.h"
#include "common/log.h"
#include "configs/server_config.h"
#include "http/openai_service.h"
#include "http/server.h"
#include "parallel/dist_env.h"
#include "text/tokenizer.h"

namespace kvserve::cli {

namespace {

struct ServeArgs {
  std::string config;
  std::optional<std::string> host, model, served_model_name, device, dtype, cpu_gemm, api_key, kv_cache_bytes, prefix_cache_bytes, max_body_bytes,
      default_policy;
  std::string kv_cache_dtype;  // empty = the config's cache.kv_cache_dtype
  std::string quantization;    // empty = the config's model.quantization
  std::string speculative_config;  // JSON; empty = the config's speculative_config
  std::optional<std::string> tokenizer;
  std::string kv_layout;       // empty = the config's cache.kv_layout
  std::optional<int> port, threads;
  std::optional<double> max_queue_time_s;
  std::optional<int64_t> block_size, max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold, max_waiting,
      max_model_len, warmup_tokens;
  std::optional<bool> enable_chunked_prefill, enable_prefix_caching, enable_context_caching;
  std::vector<std::string> allowed_origins;  // --allowed-origins (replaces server.allowed_origins)
  ParallelFlags parallel;
  bool quiet = false, enforce_eager = false;
};

EngineOptions engine_options(const config::ServerConfig& cfg) {
  EngineOptions eo;
  eo.max_num_seqs = cfg.scheduler.max_num_seqs;
  eo.max_num_batched_tokens = cfg.scheduler.max_num_batched_tokens;
  eo.enable_chunked_prefill = cfg.scheduler.enable_chunked_prefill;
  eo.long_prefill_token_threshold = cfg.scheduler.long_prefill_token_threshold;
  eo.max_waiting = cfg.scheduler.max_waiting;
  eo.max_queue_time_s = cfg.scheduler.max_queue_time_s;
  eo.max_model_len = cfg.model.max_model_len;
  eo.enforce_eager = cfg.model.enforce_eager;
  eo.warmup_tokens = cfg.model.warmup_tokens;
  eo.kv_cache_bytes = cfg.cache.kv_cache_bytes;
  eo.prefix_cache_bytes = cfg.cache.prefix_cache_bytes;
  eo.kv_layout = parse_kv_layout(cfg.cache.kv_layout);
  eo.block_size = cfg.cache.block_size;
  eo.enable_prefix_caching = cfg.cache.enable_prefix_caching;
  eo.enable_context_caching = cfg.cache.enable_context_caching;
  eo.default_policy = cfg.default_policy;
  eo.speculative = speculative_config(cfg.speculative);
  eo.policies = config::engine_policies(cfg);
  return eo;
}

LoadOptions load_options(const config::ServerConfig& cfg) {
  std::string dtype = cfg.model.dtype == "auto" ? "" : cfg.model.dtype;
  if (dtype == "fp32") dtype = "float32";
  if (dtype == "bf16") dtype = "bfloat16";
  if (dtype == "fp16") dtype = "float16";
  LoadOptions load;
  load.device = cfg.model.device;
  load.dtype = dtype;
  load.cpu_gemm = cpu_gemm_from_name(cfg.model.cpu_gemm);
  load.kv_cache_dtype = cfg.cache.kv_cache_dtype;
  load.quantization = cfg.model.quantization;
  return load;
}

// Rank 0 hosts HTTP and the scheduler; with no torchrun variables that is node 0's first process.
bool hosts_http(const ParallelOptions& po) {
  if (auto env = parallel::dist_env_from_environment()) return env->rank == 0;
  return po.node_rank == 0;
}

// Applies CLI flags over the YAML values; returns the validated config. `text`: the config file's
// content, already read (else the file is read here).
config::ServerConfig resolve_config(const ServeArgs& a, const std::string* text = nullptr) {
  config::ServerConfig c = a.config.empty() ? config::default_server_config()
                           : text           ? config::parse_server_config(*text, a.config)
                                            : config::load_server_config(a.config);
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
  if (a.cpu_gemm) c.model.cpu_gemm = *a.cpu_gemm;
  if (a.max_model_len) c.model.max_model_len = *a.max_model_len;
  if (a.enforce_eager) c.model.enforce_eager = true;
  if (a.warmup_tokens) c.model.warmup_tokens = *a.warmup_tokens;
  if (a.api_key) c.server.api_key = *a.api_key;
  if (!a.allowed_origins.empty()) c.server.allowed_origins = a.allowed_origins;
  bytes(a.kv_cache_bytes, c.cache.kv_cache_bytes, "--kv-cache-bytes");
  bytes(a.prefix_cache_bytes, c.cache.prefix_cache_bytes, "--prefix-cache-bytes");
  bytes(a.max_body_bytes, c.server.max_body_bytes, "--max-body-bytes");
  if (a.block_size) c.cache.block_size = *a.block_size;
  if (!a.kv_cache_dtype.empty()) c.cache.kv_cache_dtype = a.kv_cache_dtype;
  if (!a.quantization.empty()) c.model.quantization = a.quantization;
  if (!a.speculative_config.empty())
    c.speculative = speculative_section(parse_speculative_config_json(a.speculative_config, "--speculative-config"));
  if (a.tokenizer) c.model.tokenizer = *a.tokenizer;
  if (!a.kv_layout.empty()) c.cache.kv_layout = a.kv_layout;
  if (a.max_num_seqs) c.scheduler.max_num_seqs = *a.max_num_seqs;
  if (a.max_num_batched_tokens) c.scheduler.max_num_batched_tokens = *a.max_num_batched_tokens;
  if (a.enable_chunked_prefill) c.scheduler.enable_chunked_prefill = *a.enable_chunked_prefill;
  if (a.long_prefill_token_threshold) c.scheduler.long_prefill_token_threshold = *a.long_prefill_token_threshold;
  if (a.enable_prefix_caching) c.cache.enable_prefix_caching = *a.enable_prefix_caching;
  if (a.enable_context_caching) c.cache.enable_context_caching = *a.enable_context_caching;
  if (a.max_waiting) c.scheduler.max_waiting = *a.max_waiting;
  if (a.max_queue_time_s) c.scheduler.max_queue_time_s = *a.max_queue_time_s;
  if (a.default_policy) c.default_policy = *a.default_policy;
  for (auto& i : config::validate(c)) {
    i.file = "command line / " + c.source;
    issues.push_back(i);
  }
  if (!issues.empty()) throw config::ConfigError(issues);
  return c;
}

int serve(const ServeArgs& a) {
  // The text the startup config was parsed from (reloads compare against it).
  const std::optional<std::string> startup_text = a.config.empty() ? std::nullopt : try_read_text_file(a.config);
  config::ServerConfig cfg = resolve_config(a, startup_text ? &*startup_text : nullptr);
  const ParallelOptions po = a.parallel.apply(to_parallel_options(cfg.parallel));
  if (!hosts_http(po)) {
    // A worker rank: load this rank's shard and follow rank 0's steps; no HTTP here.
    auto job = ParallelJob::start(po, cfg.model.path, load_options(cfg));
    return job->run_worker(engine_options(cfg));
  }
  const std::string api_key = config::effective_api_key(cfg.server);
  const std::string model_name = cfg.model_name();

  std::atomic<bool> loaded{false};
  SignalWaiter signals;
  signals.set_handler([&loaded](int sig) {
    if (!loaded.load()) {
      KV_LOG("signal " << sig << " while loading; exiting");
      std::_Exit(0);
    }
  });

  auto reloader = std::make_shared<ConfigReloader>(
      a.config, startup_text, cfg, [&a](const std::string* text) { return resolve_config(a, text); });
  http::ServiceOptions so;
  so.model_name = model_name;
  so.api_key = api_key;
  so.api_keys = cfg.server.api_keys;
  so.log_requests = !a.quiet;
  so.retry_after_s = static_cast<int>(cfg.server.retry_after_s);
  so.limits.strict_fields = cfg.server.strict_fields;
  so.protect_last_tokens = cfg.server.protect_last_tokens;
  so.tool_call_parser = cfg.model.tool_call_parser;
  so.rollout_resolver = [reloader, model_name, keys = cfg.server.api_keys](
                            const http::HttpRequest& http_req, const http::ParsedRequest& req, int64_t prompt_tokens,
                            const std::string& request_id) -> http::ServiceOptions::PolicyChoice {
    auto snap = reloader->current();
    config::RequestFacts f;
    f.model = req.model.empty() ? model_name : req.model;
    f.headers = http_req.headers;
    if (!keys.empty()) {
      const std::string token = http::bearer_token(http_req);
      for (const auto& [name, key] : keys)
        if (!token.empty() && token == key) f.api_key_name = name;
    }
    f.prompt_tokens = prompt_tokens;
    f.endpoint = req.endpoint == http::Endpoint::kChatCompletions ? "chat" : "completions";
    f.user = req.user;
    f.request_id = request_id;
    f.requested_policy = req.kv_policy;
    auto d = config::decide(snap->rollout, f, snap->default_policy);
    if (d.override_rejected) {
      std::string allowed;
      for (const auto& p : snap->rollout.allow_override) allowed += (allowed.empty() ? "" : ", ") + p;
      throw http::ApiError(400, "kv_policy '" + req.kv_policy + "' may not be chosen by requests on this server (rollout.allow_override: " +
                                    (allowed.empty() ? std::string("none") : allowed) + ")",
                           "kv_policy");
    }
    return {d.policy, snap->rollout.present ? d.rule : std::string(), d.max_draft_tokens.value_or(-1)};
  };
  auto service = std::make_shared<http::OpenAIService>(so);
  http::ServerOptions sopt;
  sopt.host = cfg.server.host;
  sopt.port = cfg.server.port;
  sopt.threads = cfg.server.threads;
  sopt.max_body_bytes = cfg.server.max_body_bytes;
  sopt.request_timeout_s = cfg.server.request_timeout_s;
  sopt.idle_timeout_s = cfg.server.idle_timeout_s;
  sopt.header_timeout_s = cfg.server.header_timeout_s;
  sopt.write_timeout_s = cfg.server.write_timeout_s;
  sopt.retry_after_s = static_cast<int>(cfg.server.retry_after_s);
  sopt.max_concurrent_connections = cfg.server.max_concurrent_connections;
  sopt.log_requests = !a.quiet;
  sopt.allowed_origins = cfg.server.allowed_origins;
  http::HttpServer server(sopt, service);
  server.start();
  KV_LOG("listening on http://" << cfg.server.host << ":" << server.port() << " (model '" << model_name
                                 << "' loading; /health answers 503 until it is ready)"
                                 << (api_key.empty() ? "" : "; API key required"));

  // Load the model while /health says 503.
  auto t0 = std::chrono::steady_clock::now();
  std::cerr << "kvserve: loading " << cfg.model.path << " on " << cfg.model.device;
  if (po.world_size() > 1)
    std::cerr << " (tensor parallel " << po.tensor_parallel_size << " x pipeline parallel " << po.pipeline_parallel_size
              << " = " << po.world_size() << " ranks over " << po.nnodes << " node(s))";
  std::cerr << std::endl;
  auto job = ParallelJob::start(po, cfg.model.path, load_options(cfg));
  auto model = job->model();
  auto tokenizer = std::make_shared<Tokenizer>(load_model_tokenizer(cfg.model.tokenizer.empty() ? cfg.model.path : cfg.model.tokenizer));
  EngineOptions eo = engine_options(cfg);
  // The engine (its thread is joined by backend->shutdown below) never outlives the service.
  eo.on_queue_time = [m = &service->metrics()](double seconds) { m->observe_queue_time(seconds); };
  const int64_t max_model_len =
      cfg.model.max_model_len > 0 ? cfg.model.max_model_len : context_length(model->config());
  // The engine's start-up (KV pool, warm-up) runs on a thread that ends, as the load does
  // (common/fresh_thread.h): no idle OpenMP pool outlives it to slow the engine thread's steps.
  auto engine = run_on_fresh_thread([&] { return std::make_unique<Engine>(model, tokenizer, eo, job->make_runner(eo)); });
  // A rank's process dying fails the job at once (the launcher notices before any timeout).
  job->set_on_failure([e = engine.get()](const std::string& why) { e->mark_unhealthy(why); });
  service->set_backend(http::make_engine_backend(std::move(engine), tokenizer, max_model_len, cfg.default_policy));
  loaded = true;
  std::cerr << "kvserve: ready in "
            << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s: model '"
            << model_name << "', max_model_len " << max_model_len << ", policies";
  for (const auto& [n, p] : cfg.policies) std::cerr << " " << n << (n == cfg.default_policy ? "*" : "");
  std::cerr << std::endl;

  // Hot reload (SIGHUP, or the file's mtime changing): rollout rules and the default policy.
  const std::vector<std::string> engine_policy_list = service->backend()->policy_names();
  reloader->attach({engine_policy_list.begin(), engine_policy_list.end()}, &service->metrics());
  signals.set_reload([reloader] { reloader->reload("SIGHUP"); });
  reloader->start_watching();

  int sig = signals.wait();
  signals.set_reload(nullptr);
  reloader->stop_watching();
  KV_LOG("signal " << sig << ": no new connections; draining " << service->in_flight()
            << " request(s) for at most " << cfg.server.drain_timeout_s << " s");
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
    KV_LOG("aborted " << left << " request(s) still running at the drain deadline");
    auto flush_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (service->in_flight() > 0 && std::chrono::steady_clock::now() < flush_deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  job->set_on_failure(nullptr);
  job->join_workers();  // the engine told them to exit
  server.stop();
  KV_LOG("stopped");
  return 0;
}

}  // namespace

void add_serve_command(CLI::App& app) {
  auto a = std::make_shared<ServeArgs>();
  auto* cmd = app.add_subcommand("serve", "Serve the OpenAI-compatible HTTP API");
  cmd->add_option("--config,-c", a->config, "YAML config file (configs/default.yaml is a starting point)");
  cmd->add_option("--host", a->host, "listen address (default 127.0.0.1)");
  cmd->add_option("--port", a->port, "listen port (0 = any free port)");
  cmd->add_option("--model", a->model, "model directory or .gguf file (overrides model.path)");
  cmd->add_option("--tokenizer", a->tokenizer, "directory with tokenizer.json (default: the model directory; for a .gguf file the tokenizer.json beside it, else the file's own tokenizer metadata)");
  cmd->add_option("--served-model-name", a->served_model_name, "name clients use as `model`");
  cmd->add_option("--device", a->device, "cpu, cuda or cuda:N");
  cmd->add_option("--dtype", a->dtype, "float32, bfloat16, float16 or auto");
  cmd->add_option("--cpu-gemm", a->cpu_gemm, "mkl (default; logits equal transformers') or onednn (faster prefill on AMD)");
  cmd->add_option("--max-model-len", a->max_model_len, "context length limit (0 = the model's)");
  cmd->add_flag("--enforce-eager", a->enforce_eager, "decode without CUDA graphs (sets model.enforce_eager)");
  cmd->add_option("--warmup-tokens", a->warmup_tokens,
                  "prompt tokens of the warm-up at start (sets model.warmup_tokens; -1 = auto: the token budget on CUDA, "
                  "none on CPU; 0 = off)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 40));
  cmd->add_option("--api-key", a->api_key, "require Authorization: Bearer <key> (also $KVSERVE_API_KEY)");
  cmd->add_option("--threads", a->threads, "HTTP I/O threads");
  cmd->add_option("--max-body-bytes", a->max_body_bytes, "request body limit, e.g. 1MiB");
  cmd->add_option("--allowed-origins", a->allowed_origins,
                  "CORS: browser origins allowed to call the API, e.g. https://app.example.com or '*' (sets server.allowed_origins)")
      ->delimiter(',');
  cmd->add_option("--kv-cache-bytes", a->kv_cache_bytes, "KV cache pool size, e.g. 2GiB");
  cmd->add_option("--block-size", a->block_size, "KV cache block size in tokens");
  add_kv_cache_dtype_option(cmd, a->kv_cache_dtype);
  add_quantization_option(cmd, a->quantization);
  add_speculative_option(cmd, a->speculative_config);
  cmd->add_option("--kv-layout", a->kv_layout, "KV block layout: auto, layer, head (sets cache.kv_layout)")
      ->check(CLI::IsMember({"auto", "layer", "head"}));
  cmd->add_option("--max-num-seqs", a->max_num_seqs, "sequences decoding at once");
  cmd->add_option("--max-num-batched-tokens", a->max_num_batched_tokens, "prompt tokens prefilled per step");
  // A function, not an optional<bool> target: CLI11 would set that to false when the flag is absent,
  // overriding the YAML.
  cmd->add_flag_function(
      "--enable-chunked-prefill,!--no-enable-chunked-prefill", [a](int64_t n) { a->enable_chunked_prefill = n > 0; },
      "prefill prompts over several steps while others decode (default on)");
  cmd->add_option("--long-prefill-token-threshold", a->long_prefill_token_threshold,
                  "while requests decode, prompt tokens prefilled per step at most (-1 = auto: " +
                      std::to_string(kAutoLongPrefillTokensCpu) + " on CPU, no cap on CUDA; 0 = no cap)");
  cmd->add_flag_function(
      "--enable-prefix-caching,!--no-enable-prefix-caching", [a](int64_t n) { a->enable_prefix_caching = n > 0; },
      "keep full prompt blocks for later requests with the same prefix (default on)");
  cmd->add_flag_function(
      "--enable-context-caching,!--no-enable-context-caching", [a](int64_t n) { a->enable_context_caching = n > 0; },
      "keep compressed contexts (compress: context policies, e.g. kvzip) for later requests with the same context "
      "(default on)");
  cmd->add_option("--prefix-cache-bytes", a->prefix_cache_bytes,
                  "host-RAM tier of the prefix cache per shard, e.g. 8GiB (sets cache.prefix_cache_bytes; 0 = none)");
  cmd->add_option("--max-waiting", a->max_waiting, "queued requests before 429");
  cmd->add_option("--max-queue-time-s", a->max_queue_time_s,
                  "a request waiting this long to start gets 503, new ones once the oldest waited half; 0 = off");
  cmd->add_option("--default-policy", a->default_policy, "KV policy for requests that name none");
  cmd->add_flag("--quiet,-q", a->quiet, "no per-request log lines");
  a->parallel.add_to(cmd);
  cmd->callback([a] {
    int rc = serve(*a);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace kvserve::cli
