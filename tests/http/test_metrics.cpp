// /metrics text: names, labels, histogram buckets.
#include <gtest/gtest.h>

#include "http/metrics.h"

using namespace kvserve::http;

static bool has_line(const std::string& text, const std::string& line) {
  return text.find("\n" + line + "\n") != std::string::npos || text.rfind(line + "\n", 0) == 0;
}

TEST(Metrics, RendersVllmStyleNames) {
  ServerMetrics m("tiny-llama");
  m.observe_ttft(0.03);
  m.observe_ttft(3.0);
  m.observe_inter_token(0.012);
  m.observe_e2e(1.2);
  m.request_finished("stop", "pyramidkv", 300, 1200);
  m.request_finished("length", "pyramidkv", 100, 400);
  m.request_finished("length", "full", 50, 50);
  kvserve::EngineStats s;
  s.running = 2;
  s.waiting = 1;
  s.kv_blocks_total = 100;
  s.kv_blocks_used = 25;
  s.kv_bytes_total = 6800;
  s.kv_bytes_used = 1700;
  s.kv_bytes_used_by_dtype = {{"float16", 1200}, {"int8", 500}};
  s.prompt_tokens_total = 42;
  s.generation_tokens_total = 7;
  std::string t = m.render(s);
  const std::string L = "model_name=\"tiny-llama\"";
  EXPECT_TRUE(has_line(t, "kvserve:num_requests_running{" + L + "} 2")) << t;
  EXPECT_TRUE(has_line(t, "kvserve:num_requests_waiting{" + L + "} 1"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_cache_usage_perc{" + L + "} 0.25"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_cache_blocks_used{" + L + "} 25"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_cache_blocks_total{" + L + "} 100"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_cache_bytes_used{" + L + "} 1700"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_cache_bytes_total{" + L + "} 6800"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_cache_bytes_used_by_dtype{" + L + ",kv_dtype=\"float16\"} 1200")) << t;
  EXPECT_TRUE(has_line(t, "kvserve:kv_cache_bytes_used_by_dtype{" + L + ",kv_dtype=\"int8\"} 500"));
  EXPECT_TRUE(has_line(t, "kvserve:prompt_tokens_total{" + L + "} 42"));
  EXPECT_TRUE(has_line(t, "kvserve:generation_tokens_total{" + L + "} 7"));
  EXPECT_TRUE(has_line(t, "kvserve:request_success_total{" + L + ",finished_reason=\"length\"} 2"));
  EXPECT_TRUE(has_line(t, "kvserve:request_success_total{" + L + ",finished_reason=\"stop\"} 1"));
  EXPECT_TRUE(has_line(t, "kvserve:time_to_first_token_seconds_bucket{" + L + ",le=\"0.04\"} 1"));
  EXPECT_TRUE(has_line(t, "kvserve:time_to_first_token_seconds_bucket{" + L + ",le=\"+Inf\"} 2"));
  EXPECT_TRUE(has_line(t, "kvserve:time_to_first_token_seconds_count{" + L + "} 2"));
  EXPECT_TRUE(has_line(t, "kvserve:time_to_first_token_seconds_sum{" + L + "} 3.03"));
  EXPECT_TRUE(has_line(t, "kvserve:inter_token_latency_seconds_count{" + L + "} 1"));
  EXPECT_TRUE(has_line(t, "kvserve:e2e_request_latency_seconds_count{" + L + "} 1"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_kept_tokens_total{" + L + ",policy=\"pyramidkv\"} 400"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_full_tokens_total{" + L + ",policy=\"pyramidkv\"} 1600"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_compression_ratio{" + L + ",policy=\"pyramidkv\"} 0.25"));
  EXPECT_TRUE(has_line(t, "kvserve:kv_compression_ratio{" + L + ",policy=\"full\"} 1"));
  EXPECT_NE(t.find("# TYPE kvserve:time_to_first_token_seconds histogram"), std::string::npos);
  EXPECT_NE(t.find("# TYPE kvserve:prompt_tokens_total counter"), std::string::npos);
}

TEST(Metrics, LoadingAndEscaping) {
  ServerMetrics m("a\"b");
  std::string t = m.render(std::nullopt);
  EXPECT_NE(t.find("kvserve:kv_cache_blocks_used{model_name=\"a\\\"b\"} 0"), std::string::npos) << t;
}

TEST(Metrics, QueueTimeIsNotTimeToFirstToken) {
  ServerMetrics m("tiny");
  m.observe_ttft(3.0);
  m.observe_queue_time(0.1);
  const std::string t = m.render(std::nullopt);
  const std::string L = "model_name=\"tiny\"";
  EXPECT_TRUE(has_line(t, "kvserve:request_queue_time_seconds_count{" + L + "} 1")) << t;
  EXPECT_TRUE(has_line(t, "kvserve:request_queue_time_seconds_sum{" + L + "} 0.1"));
  EXPECT_TRUE(has_line(t, "kvserve:request_queue_time_seconds_bucket{" + L + ",le=\"0.3\"} 1"));
  EXPECT_TRUE(has_line(t, "kvserve:time_to_first_token_seconds_count{" + L + "} 1"));
  EXPECT_TRUE(has_line(t, "kvserve:time_to_first_token_seconds_sum{" + L + "} 3"));
}

TEST(Metrics, VllmNamesRepeatTheirKvserveTwins) {
  ServerMetrics m("tiny");
  m.observe_ttft(0.03);
  m.request_finished("length", "full", 5, 5);
  kvserve::EngineStats s;
  s.running = 3;
  s.prompt_tokens_total = 11;
  const std::string t = m.render(s);
  const std::string L = "model_name=\"tiny\"";
  EXPECT_TRUE(has_line(t, "vllm:num_requests_running{" + L + "} 3")) << t;
  EXPECT_TRUE(has_line(t, "vllm:prompt_tokens_total{" + L + "} 11")) << t;
  EXPECT_TRUE(has_line(t, "vllm:request_success_total{" + L + ",finished_reason=\"length\"} 1")) << t;
  EXPECT_TRUE(has_line(t, "vllm:time_to_first_token_seconds_count{" + L + "} 1")) << t;
  EXPECT_TRUE(has_line(t, "# TYPE vllm:time_to_first_token_seconds histogram")) << t;
  // Every mapped series appears under both names, line for line; unmapped ones only as kvserve:.
  for (const auto& [ours, theirs] : vllm_metric_names()) {
    size_t a = 0, b = 0;
    for (size_t at = t.find(ours); at != std::string::npos; at = t.find(ours, at + 1)) ++a;
    for (size_t at = t.find(theirs); at != std::string::npos; at = t.find(theirs, at + 1)) ++b;
    EXPECT_GT(a, 0u) << ours;
    EXPECT_EQ(a, b) << ours;
  }
  EXPECT_EQ(t.find("vllm:kv_kept_tokens_total"), std::string::npos);
}
