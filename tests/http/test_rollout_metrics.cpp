// The rollout series of /metrics: per (rule, policy) counters, per-policy latency histograms and
// the config-reload gauges.
#include <gtest/gtest.h>

#include "http/metrics.h"

using kvserve::http::ServerMetrics;

TEST(RolloutMetrics, PerRulePerPolicyAndReloadSeries) {
  ServerMetrics m("tiny");
  m.observe_ttft(0.03, "pyramidkv");
  m.observe_e2e(1.2, "pyramidkv");
  m.observe_ttft(0.02);  // no policy: only the global histogram
  m.request_finished("stop", "pyramidkv", 300, 1200, "stage");
  m.request_finished("length", "full", 50, 50, "stage");
  m.request_finished("length", "full", 50, 50);  // no rule
  std::string text = m.render(std::nullopt);
  EXPECT_NE(text.find("kvserve:rollout_requests_total{model_name=\"tiny\",rule=\"stage\",policy=\"pyramidkv\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("kvserve:rollout_kept_tokens_total{model_name=\"tiny\",rule=\"stage\",policy=\"pyramidkv\"} 300"), std::string::npos);
  EXPECT_NE(text.find("kvserve:rollout_full_tokens_total{model_name=\"tiny\",rule=\"stage\",policy=\"full\"} 50"), std::string::npos);
  EXPECT_NE(text.find("kvserve:kv_requests_total{model_name=\"tiny\",policy=\"full\"} 2"), std::string::npos);
  EXPECT_NE(text.find("kvserve:kv_policy_time_to_first_token_seconds_count{model_name=\"tiny\",policy=\"pyramidkv\"} 1"), std::string::npos);
  EXPECT_NE(text.find("kvserve:kv_policy_e2e_request_latency_seconds_count{model_name=\"tiny\",policy=\"pyramidkv\"} 1"), std::string::npos);
  EXPECT_NE(text.find("kvserve:time_to_first_token_seconds_count{model_name=\"tiny\"} 2"), std::string::npos);
  EXPECT_NE(text.find("kvserve:config_last_reload_success{model_name=\"tiny\"} 1"), std::string::npos);
  m.config_reload(false);
  text = m.render(std::nullopt);
  EXPECT_NE(text.find("kvserve:config_reload_failures_total{model_name=\"tiny\"} 1"), std::string::npos);
  EXPECT_NE(text.find("kvserve:config_last_reload_success{model_name=\"tiny\"} 0"), std::string::npos);
  m.config_reload(true);
  text = m.render(std::nullopt);
  EXPECT_NE(text.find("kvserve:config_reloads_total{model_name=\"tiny\"} 2"), std::string::npos);
  EXPECT_NE(text.find("kvserve:config_last_reload_success{model_name=\"tiny\"} 1"), std::string::npos);
}
