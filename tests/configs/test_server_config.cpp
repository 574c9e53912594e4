// ServerConfig YAML parsing: valid files, defaults, sizes, and a table of malformed cases that must
// each name the line and key.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "configs/server_config.h"

using kvserve::config::ConfigError;
using kvserve::config::parse_byte_size;
using kvserve::config::parse_server_config;

TEST(ServerConfig, DefaultsFromEmptyFile) {
  auto c = parse_server_config("", "empty.yaml");
  EXPECT_EQ(c.server.host, "127.0.0.1");
  EXPECT_EQ(c.server.port, 8000);
  EXPECT_EQ(c.default_policy, "full");
  ASSERT_EQ(c.policies.count("full"), 1u);
  EXPECT_EQ(c.model_name(), "smollm2-135m-instruct");
}

TEST(ServerConfig, FullFile) {
  const char* yaml = R"(
model:
  path: /models/llama-3-8b/
  device: cuda:1
  dtype: bfloat16
  max_model_len: 8192
server:
  host: 0.0.0.0
  port: 9000
  api_key: secret
  max_body_bytes: 2MiB
  request_timeout_s: 30
  idle_timeout_s: 5.5
  header_timeout_s: 2.5
  write_timeout_s: 7
  max_concurrent_connections: 64
  retry_after_s: 4
cache:
  block_size: 32
  kv_cache_bytes: 2GiB
scheduler:
  max_num_seqs: 8
  max_num_batched_tokens: 4096
  max_waiting: 10
policies:
  pyramid128:
    method: pyramidkv
    budget: 128
    window: 8
  knorm:
    skip_layers: [0, 1]
default_policy: pyramid128
)";
  auto c = parse_server_config(yaml, "full.yaml");
  EXPECT_EQ(c.model.path, "/models/llama-3-8b/");
  EXPECT_EQ(c.model_name(), "llama-3-8b");
  EXPECT_EQ(c.model.device, "cuda:1");
  EXPECT_EQ(c.model.dtype, "bfloat16");
  EXPECT_EQ(c.model.max_model_len, 8192);
  EXPECT_EQ(c.server.host, "0.0.0.0");
  EXPECT_EQ(c.server.port, 9000);
  EXPECT_EQ(c.server.api_key, "secret");
  EXPECT_EQ(c.server.max_body_bytes, 2 << 20);
  EXPECT_DOUBLE_EQ(c.server.idle_timeout_s, 5.5);
  EXPECT_EQ(c.server.max_concurrent_connections, 64);
  EXPECT_DOUBLE_EQ(c.server.header_timeout_s, 2.5);
  EXPECT_DOUBLE_EQ(c.server.write_timeout_s, 7.0);
  EXPECT_EQ(c.server.retry_after_s, 4);
  EXPECT_EQ(c.cache.block_size, 32);
  EXPECT_EQ(c.cache.kv_cache_bytes, int64_t{2} << 30);
  EXPECT_EQ(c.scheduler.max_num_seqs, 8);
  EXPECT_EQ(c.scheduler.max_num_batched_tokens, 4096);
  EXPECT_EQ(c.scheduler.max_waiting, 10);
  EXPECT_EQ(c.default_policy, "pyramid128");
  ASSERT_EQ(c.policies.size(), 3u);  // + implicit full
  EXPECT_EQ(c.policies.at("pyramid128").params.at("budget"), "128");
  EXPECT_EQ(c.policies.at("pyramid128").line, 26);
  EXPECT_EQ(c.policies.at("pyramid128").method, "pyramidkv");
  EXPECT_EQ(c.policies.at("pyramid128").params.count("method"), 0u);
  EXPECT_EQ(c.policies.at("knorm").method, "knorm");
  EXPECT_EQ(c.policies.at("knorm").params.at("skip_layers"), "0,1");
  auto engine = kvserve::config::engine_policies(c);
  EXPECT_EQ(engine.at("pyramid128").at("name"), "pyramidkv");
  EXPECT_EQ(engine.at("pyramid128").at("budget"), "128");
  EXPECT_TRUE(c.policies.count("full"));
}

TEST(ServerConfig, ByteSizes) {
  EXPECT_EQ(parse_byte_size("4096"), 4096);
  EXPECT_EQ(parse_byte_size("1KiB"), 1024);
  EXPECT_EQ(parse_byte_size("1k"), 1024);
  EXPECT_EQ(parse_byte_size("1.5GB"), 1500000000);
  EXPECT_EQ(parse_byte_size("2 GiB"), int64_t{2} << 30);
  EXPECT_EQ(parse_byte_size("512mib"), int64_t{512} << 20);
  EXPECT_THROW(parse_byte_size("lots"), std::invalid_argument);
  EXPECT_THROW(parse_byte_size("2XB"), std::invalid_argument);
  EXPECT_THROW(parse_byte_size("-1"), std::invalid_argument);
  EXPECT_THROW(parse_byte_size("99999999999TB"), std::invalid_argument);
}

TEST(ServerConfig, ApiKeyFromEnvironment) {
  auto c = parse_server_config("server:\n  api_key_env: KVSERVE_TEST_KEY_XYZ\n", "env.yaml");
  ::setenv("KVSERVE_TEST_KEY_XYZ", "from-env", 1);
  EXPECT_EQ(kvserve::config::effective_api_key(c.server), "from-env");
  c.server.api_key = "explicit";
  EXPECT_EQ(kvserve::config::effective_api_key(c.server), "explicit");
  ::unsetenv("KVSERVE_TEST_KEY_XYZ");
}

TEST(ServerConfig, LoadMissingFileNamesIt) {
  try {
    kvserve::config::load_server_config("/nonexistent/kv.yaml");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/kv.yaml"), std::string::npos);
  }
}

TEST(ServerConfig, KvCacheDtype) {
  EXPECT_EQ(parse_server_config("").cache.kv_cache_dtype, "auto");
  for (const char* d : {"auto", "float32", "bfloat16", "float16", "fp16", "bf16"}) {
    EXPECT_EQ(parse_server_config(std::string("cache:\n  kv_cache_dtype: ") + d + "\n").cache.kv_cache_dtype, d);
  }
  // CUDA pools take only the compute dtype (the CUDA kernels read K/V in q's dtype).
  const std::string cuda_fp16 = "model:\n  device: cuda\n  dtype: bfloat16\ncache:\n  kv_cache_dtype: float16\n";
  try {
    parse_server_config(cuda_fp16, "gpu.yaml");
    FAIL() << "accepted a float16 KV cache under bfloat16 compute on CUDA";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.issues().size(), 1u) << e.what();
    EXPECT_EQ(e.issues()[0].key, "cache.kv_cache_dtype");
    EXPECT_NE(e.issues()[0].message.find("CUDA pools take only model.dtype"), std::string::npos) << e.what();
  }
  // The same dtype spelled either way, auto, or CPU: accepted. model.dtype auto is bfloat16 on CUDA.
  EXPECT_NO_THROW(parse_server_config("model:\n  device: cuda\n  dtype: bf16\ncache:\n  kv_cache_dtype: bfloat16\n"));
  EXPECT_NO_THROW(parse_server_config("model:\n  device: cuda:1\n  dtype: auto\ncache:\n  kv_cache_dtype: bfloat16\n"));
  EXPECT_THROW(parse_server_config("model:\n  device: cuda\n  dtype: auto\ncache:\n  kv_cache_dtype: float32\n"),
               ConfigError);
  EXPECT_THROW(parse_server_config("model:\n  device: cuda\ncache:\n  kv_cache_dtype: float16\n"), ConfigError);
  EXPECT_NO_THROW(parse_server_config("model:\n  device: cuda\ncache:\n  kv_cache_dtype: auto\n"));
  EXPECT_NO_THROW(parse_server_config("model:\n  device: cpu\ncache:\n  kv_cache_dtype: float16\n"));
}

TEST(ServerConfig, WeightQuantizationPerDevice) {
  // ggml block types are CPU products; CUDA takes fp8 and int4 (tinygemm).
  for (const char* q : {"int8", "int4", "fp8", "q4_k", "none"})
    EXPECT_NO_THROW(parse_server_config(std::string("model:\n  quantization: ") + q + "\n")) << q;
  for (const char* q : {"int4", "fp8", "none"})
    EXPECT_NO_THROW(parse_server_config(std::string("model:\n  device: cuda\n  quantization: ") + q + "\n")) << q;
  for (const char* q : {"int8", "q4_0", "q6_k"}) {
    try {
      parse_server_config(std::string("model:\n  device: cuda:0\n  quantization: ") + q + "\n", "gpu.yaml");
      FAIL() << "accepted quantization " << q << " on CUDA";
    } catch (const ConfigError& e) {
      ASSERT_EQ(e.issues().size(), 1u) << e.what();
      EXPECT_EQ(e.issues()[0].key, "model.quantization");
      EXPECT_NE(e.issues()[0].message.find("on CUDA use fp8 or int4"), std::string::npos) << e.what();
    }
  }
}

TEST(ServerConfig, DefaultYamlIsValid) {
  auto c = kvserve::config::load_server_config(std::string(KVSERVE_SOURCE_DIR) + "/configs/default.yaml");
  EXPECT_EQ(c.server.host, "127.0.0.1");
  EXPECT_EQ(c.server.port, 8000);
  EXPECT_EQ(c.model.device, "cpu");
  EXPECT_EQ(c.model.path, "models/smollm2-135m-instruct");
  EXPECT_EQ(c.model_name(), "smollm2-135m-instruct");
  EXPECT_EQ(c.cache.kv_cache_dtype, "auto");
  EXPECT_EQ(c.speculative.method, "none");
}

TEST(ServerConfig, SpeculativeConfigSection) {
  auto c = parse_server_config(
      "speculative_config:\n  method: ngram\n  num_speculative_tokens: 5\n  prompt_lookup_min: 1\n"
      "  prompt_lookup_max: 3\n  disable_by_batch_size: 16\n",
      "spec.yaml");
  EXPECT_EQ(c.speculative.method, "ngram");
  EXPECT_EQ(c.speculative.num_speculative_tokens, 5);
  EXPECT_EQ(c.speculative.prompt_lookup_min, 1);
  EXPECT_EQ(c.speculative.prompt_lookup_max, 3);
  EXPECT_EQ(c.speculative.disable_by_batch_size, 16);
  EXPECT_EQ(c.speculative.draft_sampling, "greedy");
  EXPECT_EQ(parse_server_config("speculative_config:\n  method: self\n  num_speculative_tokens: 4\n  draft_sampling: sample\n",
                                "spec.yaml")
                .speculative.draft_sampling,
            "sample");
}

struct BadCase {
  const char* name;
  const char* yaml;
  int line;             // expected 1-based line of the first issue
  const char* key;      // expected key of the first issue
  const char* message;  // a fragment of the message
};

class MalformedConfig : public ::testing::TestWithParam<BadCase> {};

TEST_P(MalformedConfig, NamesFileLineAndKey) {
  const BadCase& bc = GetParam();
  try {
    parse_server_config(bc.yaml, "bad.yaml");
    FAIL() << bc.name << ": accepted";
  } catch (const ConfigError& e) {
    ASSERT_FALSE(e.issues().empty());
    const auto& first = e.issues().front();
    EXPECT_EQ(first.file, "bad.yaml") << bc.name;
    EXPECT_EQ(first.line, bc.line) << bc.name << ": " << e.what();
    EXPECT_EQ(first.key, bc.key) << bc.name << ": " << e.what();
    EXPECT_NE(first.message.find(bc.message), std::string::npos) << bc.name << ": " << e.what();
    std::string what = e.what();
    EXPECT_NE(what.find("bad.yaml:" + std::to_string(bc.line)), std::string::npos) << what;
  }
}

const BadCase kBadCases[] = {
    {"syntax", "server:\n  port: [1, 2\n", 3, "", "YAML syntax error"},
    {"top_level_list", "- a\n- b\n", 1, "", "must be a mapping"},
    {"unknown_top_key", "model:\n  path: x\nservre:\n  port: 1\n", 3, "servre", "valid keys at top level: model, server"},
    {"unknown_server_key", "server:\n  prot: 80\n", 2, "server.prot", "valid keys in 'server': host, port"},
    {"port_type", "server:\n  port: eighty\n", 2, "server.port", "expected an integer"},
    {"port_range", "server:\n  port: 70000\n", 2, "server.port", "between 0 and 65535"},
    {"port_huge", "server:\n  port: 99999999999999999999999\n", 2, "server.port", "between"},
    {"port_float", "server:\n  port: 80.5\n", 2, "server.port", "expected an integer"},
    {"port_list", "server:\n  port: [80]\n", 2, "server.port", "got a list"},
    {"section_scalar", "server: 8000\n", 1, "server", "expected a mapping"},
    {"duplicate_key", "server:\n  port: 1\n  port: 2\n", 3, "server.port", "duplicate key"},
    {"bad_device", "model:\n  device: tpu\n", 2, "model.device", "cpu, cuda or cuda:<index>"},
    {"bad_dtype", "model:\n  dtype: int4\n", 2, "model.dtype", "float32"},
    {"bad_cpu_gemm", "model:\n  cpu_gemm: openblas\n", 2, "model.cpu_gemm", "mkl, onednn; got 'openblas'"},
    {"bad_bytes", "cache:\n  kv_cache_bytes: 2 gigs\n", 2, "cache.kv_cache_bytes", "unknown unit"},
    {"zero_block", "cache:\n  block_size: 0\n", 2, "cache.block_size", "between 1"},
    {"spec_method", "speculative_config:\n  method: eagle\n", 2, "speculative_config.method",
     "none, ngram, self, draft_model; got 'eagle'"},
    {"spec_tokens", "speculative_config:\n  method: ngram\n  num_speculative_tokens: 65\n", 3,
     "speculative_config.num_speculative_tokens", "between 0"},
    {"spec_draft_sampling", "speculative_config:\n  draft_sampling: top\n", 2, "speculative_config.draft_sampling",
     "must be greedy or sample"},
    {"spec_key", "speculative_config:\n  draft_model: x\n", 2, "speculative_config.draft_model",
     "valid keys in 'speculative_config'"},
    {"bad_prefix_cache_bytes", "cache:\n  prefix_cache_bytes: lots\n", 2, "cache.prefix_cache_bytes", "is not a size"},
    {"prefix_cache_bytes_list", "cache:\n  prefix_cache_bytes: [1GiB]\n", 2, "cache.prefix_cache_bytes", "a size"},
    {"bad_kv_cache_dtype", "cache:\n  block_size: 16\n  kv_cache_dtype: int2\n", 3, "cache.kv_cache_dtype",
     "must be one of auto, float32, bfloat16, float16, int8, int4, fp8, q8_0, q4_0, q4_1, fp8_e4m3; got 'int2'"},
    {"fp8_e5m2_kv_cache_dtype", "cache:\n  kv_cache_dtype: fp8_e5m2\n", 2, "cache.kv_cache_dtype",
     "kvserve's fp8 KV cache is e4m3"},
    {"kv_cache_dtype_list", "cache:\n  kv_cache_dtype: [float16]\n", 2, "cache.kv_cache_dtype", "expected a string"},
    {"neg_timeout", "server:\n  idle_timeout_s: -1\n", 2, "server.idle_timeout_s", "between"},
    {"zero_header_timeout", "server:\n  header_timeout_s: 0\n", 2, "server.header_timeout_s", "between"},
    {"write_timeout_text", "server:\n  write_timeout_s: soon\n", 2, "server.write_timeout_s", "expected a number"},
    {"retry_after_float", "server:\n  retry_after_s: 1.5\n", 2, "server.retry_after_s", "expected an integer"},
    {"retry_after_negative", "server:\n  retry_after_s: -1\n", 2, "server.retry_after_s", "between"},
    {"nan_timeout", "server:\n  request_timeout_s: .nan\n", 2, "server.request_timeout_s", "expected a number"},
    {"policy_not_map", "policies:\n  p1: 5\n", 2, "policies.p1", "expected a mapping of parameters"},
    {"policy_unknown_method", "policies:\n  fast:\n    method: turbo\n", 3, "policies.fast.method", "unknown policy method 'turbo'"},
    {"policy_unknown_method_by_name", "policies:\n  fast: {budget: 3}\n", 2, "policies.fast.method", "pyramidkv"},
    {"policy_bad_param", "policies:\n  pyramidkv:\n    budgt: 64\n", 2, "policies.pyramidkv", "unknown policy parameter 'budgt'"},
    {"policy_bad_value", "policies:\n  snapkv:\n    window: -3\n", 2, "policies.snapkv", "window"},
    {"policy_nested", "policies:\n  pyramidkv:\n    budget:\n      a: 1\n", 4, "policies.pyramidkv.budget", "scalar or a list"},
    {"policy_bad_name", "policies:\n  \"bad name\": {method: full}\n", 2, "policies.bad name", "policy names"},
    {"policy_dup", "policies:\n  a: {method: full}\n  a: {method: full}\n", 3, "policies.a", "duplicate policy"},
    {"unknown_default_policy", "policies:\n  a: {method: full}\ndefault_policy: pyramid\n", 3, "default_policy",
     "not a defined policy"},
    {"scheduler_key", "scheduler:\n  max_num_seqs: 4\n  max_seqs: 3\n", 3, "scheduler.max_seqs", "max_num_seqs"},
    {"chunked_prefill_not_bool", "scheduler:\n  enable_chunked_prefill: yes\n", 2, "scheduler.enable_chunked_prefill",
     "expected true or false"},
    {"host_null", "server:\n  host:\n", 2, "server.host", "expected a string"},
    {"enforce_eager_yes", "model:\n  enforce_eager: yes\n", 2, "model.enforce_eager", "expected true or false"},
    {"enforce_eager_number", "model:\n  enforce_eager: 1\n", 2, "model.enforce_eager", "expected true or false"},
    {"enforce_eager_list", "model:\n  enforce_eager: [true]\n", 2, "model.enforce_eager", "expected true or false"},
    {"enforce_eager_typo", "model:\n  enforce_eagre: true\n", 2, "model.enforce_eagre", "enforce_eager"},
    {"warmup_tokens_negative", "model:\n  warmup_tokens: -2\n", 2, "model.warmup_tokens", "-1"},
    {"warmup_tokens_text", "model:\n  warmup_tokens: lots\n", 2, "model.warmup_tokens", "integer"},
};

TEST(ServerConfig, PrefixCacheHostTier) {
  EXPECT_EQ(parse_server_config("", "empty.yaml").cache.prefix_cache_bytes, 0);
  EXPECT_EQ(parse_server_config("cache:\n  prefix_cache_bytes: 8GiB\n", "t.yaml").cache.prefix_cache_bytes,
            int64_t{8} << 30);
  EXPECT_EQ(parse_server_config("cache:\n  prefix_cache_bytes: 0\n", "t.yaml").cache.prefix_cache_bytes, 0);
  try {
    parse_server_config("cache:\n  enable_prefix_caching: false\n  prefix_cache_bytes: 1GiB\n", "t.yaml");
    FAIL() << "a host tier without the prefix cache was accepted";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.issues().size(), 1u);
    EXPECT_EQ(e.issues()[0].key, "cache.prefix_cache_bytes");
    EXPECT_NE(e.issues()[0].message.find("enable_prefix_caching"), std::string::npos) << e.what();
  }
}

TEST(ServerConfig, EnforceEager) {
  EXPECT_FALSE(parse_server_config("", "empty.yaml").model.enforce_eager);
  EXPECT_TRUE(parse_server_config("model:\n  enforce_eager: true\n", "e.yaml").model.enforce_eager);
  EXPECT_FALSE(parse_server_config("model:\n  enforce_eager: false\n", "e.yaml").model.enforce_eager);
}

TEST(ServerConfig, WarmupTokens) {
  EXPECT_EQ(parse_server_config("", "empty.yaml").model.warmup_tokens, -1);
  EXPECT_EQ(parse_server_config("model:\n  warmup_tokens: 0\n", "w.yaml").model.warmup_tokens, 0);
  EXPECT_EQ(parse_server_config("model:\n  warmup_tokens: 4096\n", "w.yaml").model.warmup_tokens, 4096);
}

INSTANTIATE_TEST_SUITE_P(Table, MalformedConfig, ::testing::ValuesIn(kBadCases),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return std::string(info.param.name); });

TEST(ServerConfig, ChunkedPrefillIsOnUnlessDisabled) {
  const auto d = parse_server_config("model:\n  path: m\n", "a.yaml");
  EXPECT_TRUE(d.scheduler.enable_chunked_prefill);
  EXPECT_EQ(d.scheduler.long_prefill_token_threshold, -1);  // auto
  EXPECT_DOUBLE_EQ(d.scheduler.max_queue_time_s, 60.0);
  EXPECT_FALSE(d.server.strict_fields);
  EXPECT_EQ(d.server.protect_last_tokens, 64);
  const auto c = parse_server_config(
      "model:\n  path: m\nscheduler:\n  enable_chunked_prefill: false\n  long_prefill_token_threshold: 0\n"
      "  max_queue_time_s: 0\nserver:\n  strict_fields: true\n  protect_last_tokens: 0\n",
      "b.yaml");
  EXPECT_FALSE(c.scheduler.enable_chunked_prefill);
  EXPECT_EQ(c.scheduler.long_prefill_token_threshold, 0);
  EXPECT_DOUBLE_EQ(c.scheduler.max_queue_time_s, 0.0);
  EXPECT_TRUE(c.server.strict_fields);
  EXPECT_EQ(c.server.protect_last_tokens, 0);
  for (const char* bad : {"scheduler:\n  long_prefill_token_threshold: -2\n", "scheduler:\n  max_queue_time_s: -1\n",
                          "server:\n  strict_fields: maybe\n", "server:\n  protect_last_tokens: -1\n"}) {
    try {
      parse_server_config(std::string("model:\n  path: m\n") + bad, "c.yaml");
      ADD_FAILURE() << "accepted " << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("c.yaml"), std::string::npos) << e.what();
    }
  }
}

TEST(ServerConfig, ReportsEveryProblem) {
  try {
    parse_server_config("server:\n  port: x\n  host: [1]\nmodel:\n  colour: red\n", "multi.yaml");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.issues().size(), 3u) << e.what();
  }
}

TEST(ServerConfig, AllowedOrigins) {
  EXPECT_TRUE(parse_server_config("", "empty.yaml").server.allowed_origins.empty());  // CORS off by default
  auto c = parse_server_config("server:\n  allowed_origins: [\"https://a.example\", \"*\"]\n", "cors.yaml");
  EXPECT_EQ(c.server.allowed_origins, (std::vector<std::string>{"https://a.example", "*"}));
  for (const char* bad : {"server:\n  allowed_origins: https://a.example\n", "server:\n  allowed_origins: [\"\"]\n",
                          "server:\n  allowed_origins: [[1]]\n"}) {
    try {
      parse_server_config(bad, "cors.yaml");
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("allowed_origins"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("cors.yaml:2"), std::string::npos) << e.what();
    }
  }
}
