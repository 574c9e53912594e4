// PolicyConfig: named defaults, parameter parsing and the errors users see.
#include <gtest/gtest.h>

#include <string>

#include "common/check.h"
#include "policies/policy_config.h"

using namespace kvserve;

namespace {
std::string error_of(const std::string& name, const std::map<std::string, std::string>& params) {
  try {
    make_policy_config(name, params);
  } catch (const KvError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(PolicyConfig, NamedDefaults) {
  auto snap = make_policy_config("snapkv");
  EXPECT_EQ(snap.allocator, AllocatorKind::kUniform);
  EXPECT_EQ(snap.scorer, ScorerKind::kWindowAttention);
  EXPECT_EQ(snap.window, 8);
  EXPECT_EQ(snap.kernel, 7);
  EXPECT_EQ(snap.pooling, PoolingKind::kMax);
  EXPECT_EQ(snap.budget, 128);

  auto pyr = make_policy_config("pyramidkv");
  EXPECT_EQ(pyr.allocator, AllocatorKind::kPyramid);
  EXPECT_EQ(pyr.beta, 20);

  auto dyn = make_policy_config("dynamickv");
  EXPECT_EQ(dyn.allocator, AllocatorKind::kDynamic);
  EXPECT_EQ(dyn.r_max, 10);
  EXPECT_EQ(dyn.update_interval, 4);
  EXPECT_TRUE(dyn.window_mean());

  auto kn = make_policy_config("knorm");
  EXPECT_EQ(kn.scorer, ScorerKind::kKeyNorm);
  EXPECT_EQ(kn.skip_layers, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(kn.window, 0);
  auto kn_kvpress = make_policy_config("knorm", {{"semantics", "kvpress"}});
  EXPECT_TRUE(kn_kvpress.skip_layers.empty());

  EXPECT_EQ(make_policy_config("streamingllm").sink, 4);
  EXPECT_EQ(make_policy_config("h2o").scorer, ScorerKind::kAccumulatedAttention);
  EXPECT_TRUE(make_policy_config("full").is_full());
  EXPECT_EQ(make_policy_config("random", {{"seed", "7"}}).seed, 7u);
  for (const auto& n : policy_names()) EXPECT_NO_THROW(make_policy_config(n)) << n;
}

TEST(PolicyConfig, ParsesParameters) {
  auto c = make_policy_config("pyramidkv", {{"budget", "64"},
                                            {"window", "4"},
                                            {"kernel", "5"},
                                            {"pooling", "avg"},
                                            {"beta", "10"},
                                            {"semantics", "kvpress"}});
  EXPECT_EQ(c.budget, 64);
  EXPECT_EQ(c.window, 4);
  EXPECT_EQ(c.kernel, 5);
  EXPECT_EQ(c.pooling, PoolingKind::kAvg);
  EXPECT_EQ(c.beta, 10);
  EXPECT_EQ(c.semantics, Semantics::kKvpress);
  EXPECT_TRUE(c.window_mean());

  auto r = make_policy_config("snapkv", {{"budget", "0.25"}});
  EXPECT_EQ(r.budget, 0);
  EXPECT_DOUBLE_EQ(r.budget_ratio, 0.25);
  EXPECT_EQ(r.budget_tokens(1000), 250);
  auto r2 = make_policy_config("snapkv", {{"budget_ratio", "0.5"}});
  EXPECT_DOUBLE_EQ(r2.budget_ratio, 0.5);

  auto s = make_policy_config("knorm", {{"skip_layers", "3,1,3"}});
  EXPECT_EQ(s.skip_layers, (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(make_policy_config("knorm", {{"skip_layers", ""}}).skip_layers.empty());
  EXPECT_EQ(make_policy_config("dynamickv", {{"m", "2"}}).update_interval, 2);
}

TEST(PolicyConfig, ErrorsNameKeyAndValue) {
  auto e = error_of("snapkv", {{"windw", "8"}});
  EXPECT_NE(e.find("windw"), std::string::npos) << e;
  EXPECT_NE(e.find("valid keys"), std::string::npos) << e;
  EXPECT_NE(e.find("window"), std::string::npos) << e;

  e = error_of("snapkv", {{"window", "eight"}});
  EXPECT_NE(e.find("'window'"), std::string::npos) << e;
  EXPECT_NE(e.find("eight"), std::string::npos) << e;

  e = error_of("snapkv", {{"kernel", "4"}});
  EXPECT_NE(e.find("kernel"), std::string::npos) << e;
  EXPECT_NE(e.find("odd"), std::string::npos) << e;

  e = error_of("snapkv", {{"pooling", "median"}});
  EXPECT_NE(e.find("median"), std::string::npos) << e;
  EXPECT_NE(e.find("max|avg"), std::string::npos) << e;

  e = error_of("snapkv", {{"budget", "1.5"}});
  EXPECT_NE(e.find("budget"), std::string::npos) << e;
  e = error_of("snapkv", {{"budget", "-3"}});
  EXPECT_NE(e.find("-3"), std::string::npos) << e;
  e = error_of("snapkv", {{"budget", "8"}});  // not above the window
  EXPECT_NE(e.find("window"), std::string::npos) << e;
  e = error_of("nosuch", {});
  EXPECT_NE(e.find("nosuch"), std::string::npos) << e;
  EXPECT_NE(e.find("pyramidkv"), std::string::npos) << e;
  e = error_of("dynamickv", {{"semantics", "kvpress"}});
  EXPECT_NE(e.find("kvpress"), std::string::npos) << e;
  e = error_of("knorm", {{"skip_layers", "0,,1"}});
  EXPECT_NE(e.find("skip_layers"), std::string::npos) << e;
  e = error_of("knorm", {{"decode_budget", "10"}, {"decode_evict_chunk", "16"}});
  EXPECT_NE(e.find("decode_budget"), std::string::npos) << e;
  e = error_of("snapkv", {{"prefix_reuse", "lossy"}});
  EXPECT_NE(e.find("prefix_reuse"), std::string::npos) << e;
  EXPECT_NE(e.find("exact|compressed"), std::string::npos) << e;
  e = error_of("full", {{"prefix_reuse", "compressed"}});
  EXPECT_NE(e.find("compressing policy"), std::string::npos) << e;
}

TEST(PolicyConfig, PrefixReuse) {
  EXPECT_FALSE(make_policy_config("snapkv").reuse_compressed) << "exact by default";
  EXPECT_TRUE(make_policy_config("snapkv", {{"prefix_reuse", "compressed"}}).reuse_compressed);
  EXPECT_FALSE(make_policy_config("pyramidkv", {{"prefix_reuse", "exact"}}).reuse_compressed);
  EXPECT_EQ(to_json(make_policy_config("dynamickv", {{"prefix_reuse", "compressed"}}))["prefix_reuse"],
            "compressed");
}

TEST(PolicyConfig, ToJson) {
  auto j = to_json(make_policy_config("pyramidkv", {{"budget", "64"}}));
  EXPECT_EQ(j["name"], "pyramidkv");
  EXPECT_EQ(j["allocator"], "pyramid");
  EXPECT_EQ(j["scorer"], "window_attention");
  EXPECT_EQ(j["budget"], 64);
  EXPECT_EQ(j["pooling"], "max");
  EXPECT_EQ(j["semantics"], "paper");
  auto jr = to_json(make_policy_config("knorm"));
  EXPECT_DOUBLE_EQ(jr["budget_ratio"].get<double>(), 0.5);
  EXPECT_EQ(jr["skip_layers"], nlohmann::json::array({0, 1}));
}
