#pragma once
// ServerConfig: the YAML configuration of `kvserve serve`, parsed into plain structs.
//
// Layout of a config file (every section and key optional; unknown keys are errors):
//   model:     {path, served_model_name, device, dtype, max_model_len, enforce_eager, warmup_tokens,
//               tool_call_parser}
//   server:    {host, port, api_key, api_key_env, api_keys, max_body_bytes, request_timeout_s,
//               idle_timeout_s, header_timeout_s, write_timeout_s, max_concurrent_connections,
//               retry_after_s, threads, drain_timeout_s, allowed_origins, strict_fields,
//               protect_last_tokens}
//   cache:     {block_size, kv_cache_bytes, kv_cache_dtype, enable_prefix_caching, enable_context_caching, prefix_cache_bytes}
//   scheduler: {max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, long_prefill_token_threshold,
//               max_waiting, max_queue_time_s}
//   policies:  {<name>: {method: <full|snapkv|pyramidkv|...>, <param>: <scalar>, ...}, ...}
//              (method defaults to <name>; params are validated by policies/make_policy_config)
//   default_policy: <name>
//   speculative_config: {method: <none|ngram|self|draft_model>, num_speculative_tokens, prompt_lookup_min,
//               prompt_lookup_max, disable_by_batch_size, auto_disable, draft_sink_tokens, draft_window_tokens,
//               draft_min_context_tokens, draft_policy, draft_budget, draft_refresh_tokens,
//               draft_sampling, model, quantization} (vLLM's speculative_config;
//               the draft_* keys for self, model and quantization for draft_model)
//   rollout:   {default, allow_override, rules: [...]} (see rollout.h and configs/README.md)
// Sections are parsed by a table of section parsers (server_config.cpp), so later sections
// (e.g. `rollout:`) add one entry there and one struct here.
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "configs/rollout.h"

namespace kvserve::config {

struct ModelSection {
  std::string path = "models/smollm2-135m-instruct";  // Hugging Face model directory (`make model` makes it), or a .gguf file
  // A directory with tokenizer.json (+ tokenizer_config.json); empty = the model directory, or the
  // directory a .gguf file sits in.
  std::string tokenizer;
  // Weight quantization at load: none | int8 | int4 | fp8 | a ggml type (ggml blocks on the CPU; fp8 and
  // int4 on CUDA; a GGUF file's blocks are served as they are).
  std::string quantization = "none";
  std::string served_model_name;           // name in /v1/models; empty = last path component
  std::string device = "cpu";              // cpu | cuda | cuda:<index>
  std::string dtype = "float32";           // float32 | bfloat16 | float16 | auto
  int64_t max_model_len = 0;               // 0 = the model's context (backend context_length)
  std::string cpu_gemm = "mkl";            // mkl | onednn: the library for prefill-sized fp32 CPU products
  bool enforce_eager = false;              // no CUDA graphs for decode (vLLM's name); CUDA only
  // Prompt tokens of the warm-up run at start so the first request pays no device start-up
  // (backend/engine/warmup.h): -1 = auto (scheduler.max_num_batched_tokens on CUDA, none on CPU), 0 = off.
  int64_t warmup_tokens = -1;
  // How the model writes tool calls: auto (read from the chat template) | hermes | llama3_json | mistral.
  std::string tool_call_parser = "auto";
};

struct ServerSection {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0 = any free port (printed on stderr)
  std::string api_key;                       // empty = no authentication (unless the env var is set)
  std::string api_key_env = "KVSERVE_API_KEY";  // env var read when api_key is empty
  std::map<std::string, std::string> api_keys;  // named keys (name -> key); rollout rules match the name
  int64_t max_body_bytes = int64_t{1} << 20;
  double request_timeout_s = 600.0;  // a whole request (including a streamed response)
  double idle_timeout_s = 60.0;      // a keep-alive connection with nothing to read; a whole body read
  double header_timeout_s = 10.0;    // first byte of a request -> end of its headers (slowloris)
  double write_timeout_s = 30.0;     // one stalled write (a client that stopped reading) before closing
  int64_t max_concurrent_connections = 256;
  int64_t retry_after_s = 1;         // Retry-After of 429 (queue full) and 503 (over capacity, draining)
  int threads = 2;                   // I/O threads
  double drain_timeout_s = 30.0;     // SIGTERM: how long in-flight requests may still run
  std::vector<std::string> allowed_origins;  // CORS: browser origins allowed ("*" = any); empty = off
  bool strict_fields = false;  // true: request fields kvserve does not know are a 400 (default: ignored, as vLLM)
  // A prompt with no context boundary under a `compress: context` policy keeps its question (at
  // least this many last tokens) whole; 0 = such prompts are compressed whole.
  int64_t protect_last_tokens = 64;
};

struct CacheSection {
  int64_t block_size = 16;
  int64_t kv_cache_bytes = int64_t{1} << 30;
  // Storage dtype of K/V: auto (= model.dtype) | float32 | bfloat16 | float16. A 16-bit cache under
  // fp32 compute holds twice the tokens in kv_cache_bytes (CPU only: CUDA takes model.dtype).
  std::string kv_cache_dtype = "auto";
  // Automatic prefix caching: full prompt blocks stay in the pool (reclaimable) for later requests
  // that start with the same tokens; exact for every policy (docs/architecture.md, "Prefix caching").
  bool enable_prefix_caching = true;
  // Compressed contexts (policies with `compress: context`, kvzip's default) stay in the pool
  // (reclaimable) for the next request with the same context, which then prefills only its question
  // (docs/architecture.md, "Compressed contexts").
  bool enable_context_caching = true;
  // The prefix cache's host-RAM tier, per shard (0 = none): cached blocks the pool reclaims move
  // there instead of being dropped, and come back on a hit (pinned memory on a GPU), so cached
  // documents do not take the pool memory that compression frees.
  int64_t prefix_cache_bytes = 0;
  // Block layout: auto (head-wise when a policy has head_budgets: adaptive) | layer | head
  // (docs/architecture.md, "Head-wise KV lengths").
  std::string kv_layout = "auto";
};

struct SchedulerSection {
  int64_t max_num_seqs = 32;
  int64_t max_num_batched_tokens = 8192;
  // Prompts longer than what a step has left are prefilled over several steps while the running
  // requests decode (as vLLM V1). Chunked logits differ from whole-prompt ones in the last bits
  // (fp32 summation order), so greedy outputs may differ on near ties: false restores whole prompts.
  bool enable_chunked_prefill = true;
  // While requests decode, the most prompt tokens a step prefills: -1 = auto (CPU: a measured small
  // chunk, CUDA: no cap), 0 = no cap but max_num_batched_tokens.
  int64_t long_prefill_token_threshold = -1;
  int64_t max_waiting = 256;
  // Admission on queue time: a request that waited this long without starting gets 503 +
  // Retry-After, and new ones get it at once while the oldest waiting one has waited half of it.
  double max_queue_time_s = 60.0;
};

// Tensor x pipeline parallelism and the multi-process launch (one process per shard: tensor x pipeline).
struct ParallelSection {
  int64_t tensor_parallel_size = 1;
  int64_t pipeline_parallel_size = 1;
  std::vector<int64_t> pipeline_layers;  // layers per stage; empty = even split (first stages +1)
  int64_t micro_batches = 0;             // decode micro-batches in flight; 0 = one per stage
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;      // 0 = a free local port (single node only)
  double timeout_s = 20.0;  // every collective; a dead or hung process fails the job after at most this
};

// Speculative decoding as vLLM's speculative_config (backend/spec_decode/speculative_config.h
// checks the combination when the engine starts).
struct SpeculativeSection {
  std::string method = "none";  // none | ngram | self | draft_model
  int64_t num_speculative_tokens = 0;
  int64_t prompt_lookup_min = 2;
  int64_t prompt_lookup_max = 4;
  int64_t disable_by_batch_size = 0;
  bool auto_disable = true;           // pause while speculative steps are slower than plain ones
  int64_t draft_sink_tokens = 16;     // self: the draft view's sinks and window
  int64_t draft_window_tokens = 496;
  int64_t draft_min_context_tokens = -1;  // self: shorter sequences decode plainly (-1: 4096, 0 with a draft model)
  std::string draft_policy;                 // self: a policy whose kept set the view adds ("": none)
  int64_t draft_budget = 512;               // ...with this budget (tokens per layer)
  int64_t draft_refresh_tokens = 64;        // ...chosen again every this many tokens (0: never)
  std::string draft_sampling = "greedy";    // self, draft_model: greedy | sample (a sampling request's drafts)
  std::string model;                        // draft_model (self: optional): its checkpoint or GGUF ("": the served model's)
  std::string quantization;                 // draft_model (self: optional): its quantization at load ("": as stored)
  bool operator==(const SpeculativeSection&) const = default;
};

// A named KV policy: its parameters as given in YAML (scalars kept as text); the policies
// library interprets and validates them.
struct PolicySpec {
  std::string name;    // the name requests use (kv_policy)
  std::string method;  // the policies library's name: full, snapkv, pyramidkv, dynamickv, ...
  std::map<std::string, std::string> params;  // without `method`
  int line = 0;  // 1-based line of its definition (0 = implicit)
};

struct ServerConfig {
  std::string source;  // file name (or "<string>") the config came from
  ModelSection model;
  ServerSection server;
  CacheSection cache;
  SchedulerSection scheduler;
  ParallelSection parallel;
  SpeculativeSection speculative;
  std::map<std::string, PolicySpec> policies;  // always holds at least `full`
  std::string default_policy = "full";
  RolloutConfig rollout;

  // The served model name: served_model_name or the model directory's last component.
  std::string model_name() const;
};

// One problem found in a config: where and what.
struct ConfigIssue {
  std::string file;
  int line = 0;    // 1-based; 0 = unknown
  int column = 0;  // 1-based; 0 = unknown
  std::string key;  // dotted path, e.g. "server.port"
  std::string message;
  std::string format() const;  // "file:line:col: key 'server.port': message"
};

// Thrown by the parsers with every problem found (not just the first).
class ConfigError : public std::runtime_error {
 public:
  explicit ConfigError(std::vector<ConfigIssue> issues);
  const std::vector<ConfigIssue>& issues() const { return issues_; }

 private:
  std::vector<ConfigIssue> issues_;
};

// Parses YAML text; `source` names the file in errors. Throws ConfigError.
ServerConfig parse_server_config(const std::string& yaml_text, const std::string& source = "<string>");
// Reads and parses a file. Throws ConfigError (also for an unreadable file).
ServerConfig load_server_config(const std::string& path);
// A config with every default (no file).
ServerConfig default_server_config();

// The policies as EngineOptions::policies wants them: name -> params plus {"name": method}.
std::map<std::string, std::map<std::string, std::string>> engine_policies(const ServerConfig& config);

// Resolves the API key: `api_key` if set, else the environment variable `api_key_env`.
std::string effective_api_key(const ServerSection& server);

// "2GiB", "512MiB", "1.5GB", "4096", "64k" -> bytes; throws std::invalid_argument.
int64_t parse_byte_size(const std::string& text);
// Checks a device string (cpu | cuda | cuda:N); throws std::invalid_argument.
void validate_device(const std::string& device);

// Post-parse checks shared by the YAML path and CLI overrides (ports, sizes, default policy...).
// Returns problems; empty = valid.
std::vector<ConfigIssue> validate(const ServerConfig& config);

}  // namespace kvserve::config
