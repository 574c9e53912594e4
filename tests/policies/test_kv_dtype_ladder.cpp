// The KV dtype ladder: a policy with kv_dtype "ladder" becomes its rungs, and a prompt's length picks
// the rung its budget_bytes buy most from (the cache's dtype while they keep the whole prompt, int8
// down to a quarter kept for kvzip / kvzap and half for query-aware scorers, int4 below).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "cache_manager/paged_kv_memory.h"
#include "common/check.h"
#include "policies/kv_dtype_ladder.h"

using namespace kvserve;

namespace {

using Specs = std::map<std::string, std::map<std::string, std::string>>;

// Budgets as a float16 / int8 / int4 cache would resolve the same bytes (1 : 1.88 : 3.56 tokens).
void resolve(std::map<std::string, PolicyConfig>& p, const std::string& name, int64_t t16) {
  p.at(name).budget = t16;
  p.at(name + "@int8").budget = t16 * 188 / 100;
  p.at(name + "@int4").budget = t16 * 356 / 100;
}

std::string error_of(const Specs& specs) {
  try {
    resolve_policies(specs);
  } catch (const KvError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(KvDtypeLadder, APolicyBecomesItsRungs) {
  auto p = resolve_policies({{"zip", {{"name", "kvzip"}, {"budget_bytes", "1MiB"}, {"kv_dtype", "ladder"}}},
                             {"snap", {{"name", "snapkv"}, {"budget_bytes", "1MiB"}, {"kv_dtype", "ladder"}}}});
  for (const std::string n : {"zip", "snap"}) {
    EXPECT_EQ(p.at(n).kv_dtype, "");
    EXPECT_EQ(p.at(n + "@int8").kv_dtype, "int8");
    EXPECT_EQ(p.at(n + "@int4").kv_dtype, "int4");
    EXPECT_EQ(p.at(n + "@int4").budget_bytes, p.at(n).budget_bytes);
    EXPECT_EQ(p.at(n + "@int8").scorer, p.at(n).scorer);
    ASSERT_EQ(p.at(n).kv_rungs.size(), 2u);
    EXPECT_EQ(p.at(n).kv_rungs[0].first, n + "@int8");
    EXPECT_TRUE(p.at(n + "@int8").kv_rungs.empty());
  }
  EXPECT_EQ(p.at("zip").kv_rungs[0].second, 0.25);
  EXPECT_EQ(p.at("snap").kv_rungs[0].second, 0.5);
}

TEST(KvDtypeLadder, ThePromptLengthPicksTheRung) {
  auto p = resolve_policies({{"zip", {{"name", "kvzip"}, {"budget_bytes", "1MiB"}, {"kv_dtype", "ladder"}}},
                             {"snap", {{"name", "snapkv"}, {"budget_bytes", "1MiB"}, {"kv_dtype", "ladder"}}},
                             {"plain", {{"name", "snapkv"}, {"budget", "64"}}}});
  resolve(p, "zip", 100);
  resolve(p, "snap", 100);
  // The whole prompt fits in the cache's dtype: nothing is evicted, nothing rounded further.
  EXPECT_EQ(choose_kv_rung(p, "zip", 100), "zip");
  EXPECT_EQ(choose_kv_rung(p, "snap", 60), "snap");
  // 188 int8 tokens of 400 (47 %): enough for kvzip, not for snapkv, which takes 356 int4 tokens.
  EXPECT_EQ(choose_kv_rung(p, "zip", 400), "zip@int8");
  EXPECT_EQ(choose_kv_rung(p, "snap", 400), "snap@int4");
  EXPECT_EQ(choose_kv_rung(p, "snap", 300), "snap@int8");  // 188 / 300 = 63 %
  // Under a quarter in int8: int4 for both.
  EXPECT_EQ(choose_kv_rung(p, "zip", 1000), "zip@int4");
  EXPECT_EQ(choose_kv_rung(p, "snap", 100000), "snap@int4");
  // Other policies are their own rung.
  EXPECT_EQ(choose_kv_rung(p, "plain", 1000), "plain");
  EXPECT_EQ(choose_kv_rung(p, "full", 1000), "full");
}

TEST(KvDtypeLadder, ErrorsNameThePolicy) {
  const std::string no_bytes = error_of({{"zip", {{"name", "kvzip"}, {"budget", "64"}, {"kv_dtype", "ladder"}}}});
  EXPECT_NE(no_bytes.find("policy 'zip'"), std::string::npos) << no_bytes;
  EXPECT_NE(no_bytes.find("budget_bytes"), std::string::npos) << no_bytes;
  const std::string taken = error_of({{"zip", {{"name", "kvzip"}, {"budget_bytes", "1MiB"}, {"kv_dtype", "ladder"}}},
                                      {"zip@int8", {{"name", "snapkv"}}}});
  EXPECT_NE(taken.find("zip@int8"), std::string::npos) << taken;
  EXPECT_NE(taken.find("rename"), std::string::npos) << taken;
  // A policy named for its method is named once.
  const std::string once = error_of({{"snapkv", {{"budget", "4"}, {"window", "8"}}}});
  EXPECT_EQ(once.find("policy 'snapkv'"), 0u) << once;
  EXPECT_EQ(once.find("policy 'snapkv'", 1), std::string::npos) << once;
}

TEST(KvDtypeLadder, KvLadderOrdersTheRungs) {
  // A deployment that trusts int8 down to 30 % kept and never stores 4 bits: int8, then fp8 below.
  auto p = resolve_policies({{"snap", {{"name", "snapkv"}, {"budget_bytes", "1MiB"}, {"kv_dtype", "ladder"},
                                       {"kv_ladder", "int8:0.3, fp8"}}},
                             {"deep", {{"name", "snapkv"}, {"budget_bytes", "1MiB"}, {"kv_dtype", "ladder"},
                                       {"kv_ladder", "int8:0.6,int4:0.2,int3"}}}});
  ASSERT_EQ(p.at("snap").kv_rungs.size(), 2u);
  EXPECT_EQ(p.at("snap").kv_rungs[0], (std::pair<std::string, double>{"snap@int8", 0.3}));
  EXPECT_EQ(p.at("snap").kv_rungs[1], (std::pair<std::string, double>{"snap@fp8", 0.0}));
  EXPECT_EQ(p.at("snap@fp8").kv_dtype, "fp8");
  EXPECT_FALSE(p.count("snap@int4"));
  EXPECT_TRUE(p.at("snap@int8").kv_ladder.empty());
  p.at("snap").budget = 100;
  p.at("snap@int8").budget = 188;
  p.at("snap@fp8").budget = 188;
  EXPECT_EQ(choose_kv_rung(p, "snap", 400), "snap@int8");  // 47 % >= 30 %
  EXPECT_EQ(choose_kv_rung(p, "snap", 700), "snap@fp8");   // 27 %
  ASSERT_EQ(p.at("deep").kv_rungs.size(), 3u);  // names are checked where the KV layouts are built
  EXPECT_EQ(p.at("deep").kv_rungs[2].first, "deep@int3");
}

TEST(KvDtypeLadder, ABadKvLadderSaysWhatIsWrong) {
  auto err = [](const std::string& ladder, const std::string& dtype = "ladder") {
    return error_of({{"snap", {{"name", "snapkv"}, {"budget_bytes", "1MiB"}, {"kv_dtype", dtype}, {"kv_ladder", ladder}}}});
  };
  EXPECT_NE(err("int8,int4").find("needs the least fraction"), std::string::npos) << err("int8,int4");
  EXPECT_NE(err("int8:0.3,int4:0.1").find("drop its fraction"), std::string::npos) << err("int8:0.3,int4:0.1");
  EXPECT_NE(err("int8:0.2,fp8:0.4,int4").find("must fall"), std::string::npos) << err("int8:0.2,fp8:0.4,int4");
  EXPECT_NE(err("int8:1.5,int4").find("(0, 1]"), std::string::npos) << err("int8:1.5,int4");
  EXPECT_NE(err("int8:x,int4").find("kv_ladder"), std::string::npos) << err("int8:x,int4");
  EXPECT_NE(err("int8:0.5,int8").find("twice"), std::string::npos) << err("int8:0.5,int8");
  EXPECT_NE(err(",").find("kv_ladder"), std::string::npos) << err(",");
  const std::string not_ladder = err("int8:0.5,int4", "int8");
  EXPECT_NE(not_ladder.find("policy 'snap'"), std::string::npos) << not_ladder;
  EXPECT_NE(not_ladder.find("kv_dtype: ladder"), std::string::npos) << not_ladder;
}
