// The `rollout:` section: rule matching, precedence, canary stickiness and malformed-YAML errors.
#include <gtest/gtest.h>

#include <string>

#include "configs/rollout.h"
#include "configs/server_config.h"

using namespace kvserve::config;

namespace {

const char* kPolicies = R"(policies:
  full: {}
  snapkv: {budget: 24, window: 4}
  pyramidkv: {budget: 24, window: 4}
)";

ServerConfig parse(const std::string& rollout) { return parse_server_config(std::string(kPolicies) + rollout, "r.yaml"); }

RequestFacts facts() {
  RequestFacts f;
  f.model = "tiny";
  f.endpoint = "completions";
  f.prompt_tokens = 100;
  f.request_id = "req-1";
  return f;
}

}  // namespace

TEST(Rollout, NoSectionMeansDefaultAndAnyOverride) {
  auto c = parse("");
  EXPECT_FALSE(c.rollout.present);
  auto d = decide(c.rollout, facts(), c.default_policy);
  EXPECT_EQ(d.policy, "full");
  EXPECT_EQ(d.rule, "default");
  auto f = facts();
  f.requested_policy = "snapkv";
  d = decide(c.rollout, f, c.default_policy);
  EXPECT_EQ(d.policy, "snapkv");
  EXPECT_EQ(d.rule, "override");
}

TEST(Rollout, RulesMatchInOrderOnEveryCondition) {
  auto c = parse(R"(rollout:
  default: snapkv
  rules:
    - name: tenant-a
      match: {headers: {X-Tenant: [a, b]}, endpoint: chat}
      policy: pyramidkv
    - name: long
      match: {prompt_tokens: {min: 1000}}
      policy: pyramidkv
    - name: team
      match: {api_key: team-x, model: [tiny, other]}
      policy: full
    - name: short-chat
      match: {prompt_tokens: {max: 50}}
      policy: full
)");
  auto f = facts();
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "default");
  EXPECT_EQ(decide(c.rollout, f, "full").policy, "snapkv");
  f.headers["x-tenant"] = "b";
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "default");  // endpoint is completions
  f.endpoint = "chat";
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "tenant-a");
  f.headers["x-tenant"] = "c";
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "default");
  f.prompt_tokens = 1000;
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "long");
  f.prompt_tokens = 999;
  f.api_key_name = "team-x";
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "team");
  f.model = "else";
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "default");
  f.prompt_tokens = 50;
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "short-chat");
  // Precedence: the first matching rule wins.
  f.headers["x-tenant"] = "a";
  f.prompt_tokens = 5000;
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "tenant-a");
  f.prompt_tokens = -1;  // unknown length: range rules never match
  f.headers.clear();
  EXPECT_EQ(decide(c.rollout, f, "full").rule, "default");
}

TEST(Rollout, OverrideOnlyForListedPolicies) {
  auto c = parse("rollout:\n  allow_override: [full]\n");
  auto f = facts();
  f.requested_policy = "full";
  EXPECT_EQ(decide(c.rollout, f, "full").policy, "full");
  f.requested_policy = "snapkv";
  EXPECT_TRUE(decide(c.rollout, f, "full").override_rejected);
  auto none = parse("rollout:\n  default: snapkv\n");
  f.requested_policy = "full";
  EXPECT_TRUE(decide(none.rollout, f, "full").override_rejected);
}

TEST(Rollout, CanarySplitIsStickyAndWithinTolerance) {
  for (double pct : {0.0, 10.0, 50.0, 100.0}) {
    auto c = parse("rollout:\n  rules:\n    - name: stage\n      policy: full\n      canary: {policy: pyramidkv, percent: " +
                   std::to_string(pct) + ", sticky_by: user}\n");
    int canary = 0;
    const int users = 10000;
    for (int u = 0; u < users; ++u) {
      auto f = facts();
      f.user = "user-" + std::to_string(u);
      f.request_id = "r" + std::to_string(u);
      auto d = decide(c.rollout, f, "full");
      EXPECT_EQ(d.rule, "stage");
      if (d.arm == "canary") {
        ++canary;
        EXPECT_EQ(d.policy, "pyramidkv");
      } else {
        EXPECT_EQ(d.policy, "full");
      }
      // The same user always gets the same arm, whatever the request id.
      for (int k = 0; k < 3; ++k) {
        f.request_id = "other-" + std::to_string(k);
        EXPECT_EQ(decide(c.rollout, f, "full").arm, d.arm);
      }
    }
    EXPECT_NEAR(100.0 * canary / users, pct, 1.5) << "percent " << pct;
  }
}

TEST(Rollout, CanaryStickyByHeaderAndRequestIdFallback) {
  auto c = parse(R"(rollout:
  rules:
    - name: stage
      canary: {policy: pyramidkv, percent: 30, sticky_by: "header:X-Tenant"}
)");
  int canary = 0;
  for (int t = 0; t < 10000; ++t) {
    auto f = facts();
    f.headers["x-tenant"] = "t" + std::to_string(t);
    f.user = "ignored";
    auto d = decide(c.rollout, f, "snapkv");
    if (d.arm == "canary") ++canary;
    else EXPECT_EQ(d.policy, "snapkv");  // no base policy: the default
    f.request_id = "different";
    EXPECT_EQ(decide(c.rollout, f, "snapkv").arm, d.arm);
  }
  EXPECT_NEAR(canary / 100.0, 30.0, 1.5);
  // No sticky key: the request id decides.
  int by_id = 0;
  for (int r = 0; r < 10000; ++r) {
    auto f = facts();
    f.request_id = "cmpl-" + std::to_string(r);
    if (decide(c.rollout, f, "full").arm == "canary") ++by_id;
  }
  EXPECT_NEAR(by_id / 100.0, 30.0, 1.5);
}

TEST(Rollout, NamedApiKeysParse) {
  auto c = parse_server_config("server:\n  api_keys: {team-a: k1, team-b: k2}\n", "x.yaml");
  EXPECT_EQ(c.server.api_keys.at("team-a"), "k1");
  EXPECT_EQ(c.server.api_keys.size(), 2u);
}

struct BadCase {
  const char* yaml;  // after the policies section (which is 4 lines)
  int line;
  const char* key;
};

TEST(Rollout, MalformedYamlNamesLineAndKey) {
  const BadCase cases[] = {
      {"rollout:\n  default: nosuch\n", 6, "rollout.default"},
      {"rollout:\n  bogus: 1\n", 6, "rollout.bogus"},
      {"rollout: [1, 2]\n", 5, "rollout"},
      {"rollout:\n  rules: {a: 1}\n", 6, "rollout.rules"},
      {"rollout:\n  allow_override: [full, nosuch]\n", 6, "rollout.allow_override"},
      {"rollout:\n  allow_override: {a: 1}\n", 6, "rollout.allow_override"},
      {"rollout:\n  rules:\n    - name: a\n      policy: nosuch\n", 8, "rollout.rules[0].policy"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      colour: red\n", 9, "rollout.rules[0].colour"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n    - name: a\n      policy: full\n", 9, "rollout.rules[1].name"},
      {"rollout:\n  rules:\n    - name: a\n      canary: {policy: pyramidkv, percent: 150}\n", 8, "rollout.rules[0].canary.percent"},
      {"rollout:\n  rules:\n    - name: a\n      canary: {policy: pyramidkv, percent: -1}\n", 8, "rollout.rules[0].canary.percent"},
      {"rollout:\n  rules:\n    - name: a\n      canary: {policy: pyramidkv, percent: ten}\n", 8, "rollout.rules[0].canary.percent"},
      {"rollout:\n  rules:\n    - name: a\n      canary: {policy: nosuch, percent: 5}\n", 8, "rollout.rules[0].canary.policy"},
      {"rollout:\n  rules:\n    - name: a\n      canary: {policy: full, percent: 5, sticky_by: moon}\n", 8, "rollout.rules[0].canary.sticky_by"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      match: {prompt_tokens: {min: abc}}\n", 9, "rollout.rules[0].match.prompt_tokens.min"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      match: {endpoint: embeddings}\n", 9, "rollout.rules[0].match.endpoint"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      match: {headers: [x]}\n", 9, "rollout.rules[0].match.headers"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      match: {model: {a: b}}\n", 9, "rollout.rules[0].match.model"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      match: {tenant: x}\n", 9, "rollout.rules[0].match.tenant"},
      {"rollout:\n  rules:\n    - name: [a]\n      policy: full\n", 7, "rollout.rules[0].name"},
      {"rollout:\n  rules:\n    - policy: full\n", 7, "rollout.rules[0].name"},
      {"rollout:\n  rules:\n    - name: a\n", 7, "rollout.rules[0]"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      speculative: maybe\n", 9, "rollout.rules[0].speculative"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      speculative: {gamma: 2}\n", 9, "rollout.rules[0].speculative.gamma"},
      {"rollout:\n  rules:\n    - name: a\n      policy: full\n      speculative: {num_speculative_tokens: -1}\n", 9,
       "rollout.rules[0].speculative.num_speculative_tokens"},
      {"server:\n  api_keys: [a]\n", 6, "server.api_keys"},
  };
  for (const auto& bc : cases) {
    SCOPED_TRACE(bc.yaml);
    try {
      parse(bc.yaml);
      ADD_FAILURE() << "no error";
    } catch (const ConfigError& e) {
      bool found = false;
      for (const auto& i : e.issues()) {
        if (i.key == bc.key && i.line == bc.line && i.file == "r.yaml") found = true;
      }
      EXPECT_TRUE(found) << "wanted line " << bc.line << " key " << bc.key << "; got:\n" << e.what();
    }
  }
}

TEST(Rollout, RulesMayTurnSpeculationOffOrCapIt) {
  auto c = parse(R"(rollout:
  rules:
    - name: off
      match: {headers: {x-tenant: a}}
      policy: snapkv
      speculative: false
    - name: capped
      match: {headers: {x-tenant: b}}
      canary: {policy: pyramidkv, percent: 100}
      speculative: {num_speculative_tokens: 2}
    - name: on
      match: {headers: {x-tenant: c}}
      policy: full
      speculative: true
)");
  auto f = facts();
  f.headers["x-tenant"] = "a";
  EXPECT_EQ(decide(c.rollout, f, c.default_policy).max_draft_tokens, std::optional<int64_t>(0));
  f.headers["x-tenant"] = "b";
  const auto d = decide(c.rollout, f, c.default_policy);
  EXPECT_EQ(d.arm, "canary");  // both arms of a rule speculate as the rule says
  EXPECT_EQ(d.max_draft_tokens, std::optional<int64_t>(2));
  f.headers["x-tenant"] = "c";
  EXPECT_FALSE(decide(c.rollout, f, c.default_policy).max_draft_tokens.has_value());
  f.headers["x-tenant"] = "z";  // no rule: the server's speculative_config
  EXPECT_FALSE(decide(c.rollout, f, c.default_policy).max_draft_tokens.has_value());
}

TEST(Rollout, ExampleStagedRolloutConfigsParse) {
  const std::string dir = std::string(KVSERVE_SOURCE_DIR) + "/configs/rollout/";
  const std::pair<const char*, double> stages[] = {{"stage0.yaml", 0}, {"stage10.yaml", 10}, {"stage50.yaml", 50}, {"stage100.yaml", 100}};
  for (const auto& [file, pct] : stages) {
    auto c = load_server_config(dir + file);
    ASSERT_EQ(c.rollout.rules.size(), 2u) << file;
    ASSERT_TRUE(c.rollout.rules[1].canary) << file;
    EXPECT_EQ(c.rollout.rules[1].canary->percent, pct) << file;
  }
}
