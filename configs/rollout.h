#pragma once
// The `rollout:` section of the server config: ordered rules that pick the KV policy of a request
// (by model, headers, API-key name, prompt length, endpoint), canary splits sticky by a user or a
// header, a default, and which explicit `kv_policy` overrides a request may make.
//
//   rollout:
//     default: full                      # policy when no rule matches (default: default_policy)
//     allow_override: [full]             # a request's kv_policy is honoured only for these (else 400)
//     rules:
//       - name: tenant-a                 # unique
//         match:                         # every given condition must hold (a list = any of)
//           model: tiny                  # or [a, b]
//           headers: {x-tenant: [a, b]}  # header name -> value or list of values
//           api_key: team-a              # name from server.api_keys (or list)
//           prompt_tokens: {min: 0, max: 4096}
//           endpoint: chat               # completions | chat (or list)
//         policy: snapkv                 # the base arm
//         canary: {policy: pyramidkv, percent: 10, sticky_by: user}   # or header:<name>
//         speculative: false             # or {num_speculative_tokens: 2}: caps the server's
//                                        # speculative_config for matching requests (both arms)
//
// decide() is pure: the same facts always give the same decision.
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace YAML {
class Node;
}

namespace kvserve::config {

struct ConfigIssue;

struct RolloutMatch {
  std::vector<std::string> models;                          // any of; empty = any
  std::map<std::string, std::vector<std::string>> headers;  // lower-cased name -> any of; all names must match
  std::vector<std::string> api_keys;                        // API-key names; any of
  std::optional<int64_t> min_prompt_tokens, max_prompt_tokens;  // inclusive
  std::vector<std::string> endpoints;                       // completions | chat
};

struct RolloutCanary {
  std::string policy;
  double percent = 0.0;            // [0, 100] of matching traffic goes to `policy`
  std::string sticky_by = "user";  // "user" (the request's `user` field) | "header:<name>"
  int line = 0;
};

struct RolloutRule {
  std::string name;
  int line = 0;
  RolloutMatch match;
  std::string policy;  // the base arm; empty = the rollout default
  int policy_line = 0;
  std::optional<RolloutCanary> canary;
  // Unset: the server's speculative_config; 0: matching requests decode without speculation; k: at
  // most k draft tokens a step.
  std::optional<int64_t> max_draft_tokens;
};

struct RolloutConfig {
  bool present = false;  // a `rollout:` section was given (without one, any kv_policy override is allowed)
  std::vector<RolloutRule> rules;
  std::string default_policy;  // empty = the config's default_policy
  int default_line = 0;
  std::vector<std::string> allow_override;
  std::vector<int> allow_override_lines;
};

// What decide() looks at, extracted from one request.
struct RequestFacts {
  std::string model;
  std::map<std::string, std::string> headers;  // lower-cased names
  std::string api_key_name;                    // name of the API key used ("" = none / unnamed)
  int64_t prompt_tokens = -1;                  // -1 = unknown (range conditions then do not match)
  std::string endpoint;                        // completions | chat
  std::string user;                            // the request's `user` field
  std::string request_id;                      // sticky fallback when the sticky key is absent
  std::string requested_policy;                // the request's kv_policy ("" = none)
};

struct RolloutDecision {
  std::string policy;  // "" only when override_rejected
  std::string rule;    // matching rule name, "default" or "override"
  std::string arm;     // "base" | "canary" | "default" | "override"
  bool override_rejected = false;  // kv_policy given but not in allow_override
  std::optional<int64_t> max_draft_tokens;  // the matching rule's `speculative:` cap
};

// `fallback_default` is used when the rollout has no `default:`.
RolloutDecision decide(const RolloutConfig& config, const RequestFacts& facts, const std::string& fallback_default);

// The canary bucket of a sticky key in [0, 10000): FNV-1a 64 of rule name + '\0' + key, mixed.
uint32_t canary_bucket(const std::string& rule_name, const std::string& key);

// Parses the `rollout:` node into `out`, appending problems (with `file`, line, key) to `issues`.
void parse_rollout_section(const YAML::Node& node, const std::string& path, const std::string& file,
                           RolloutConfig& out, std::vector<ConfigIssue>& issues);

// Checks every policy name the rollout refers to against `policies`.
std::vector<ConfigIssue> validate_rollout(const RolloutConfig& config, const std::set<std::string>& policies,
                                          const std::string& file);

}  // namespace kvserve::config
