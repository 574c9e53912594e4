#pragma once
// The KV-policy flags shared by `generate` and `forward`: --policy, --budget, --policy-param, --policy-config.
#include <CLI/CLI.hpp>

#include <map>
#include <string>
#include <vector>

namespace kvserve::cli {

// "k=v" flag values -> {k: v}; `flag` names the option in the error for a malformed entry.
std::map<std::string, std::string> parse_key_values(const std::vector<std::string>& items, const std::string& flag);
// Every policy method's name, comma-separated (for flags' help).
std::string policy_name_list();

struct PolicyFlags {
  std::string policy = "full";
  std::string budget;                  // tokens per layer (int) or a ratio (0 < r < 1)
  std::vector<std::string> params;     // key=value
  std::string policy_config;           // YAML file with the parameters

  void add_to(CLI::App* cmd);
  // {policy name -> params (with "name" = method)} for EngineOptions::policies / resolve_policies.
  std::map<std::string, std::map<std::string, std::string>> specs() const;
  // The policy those specs select ("full" when they are empty).
  static std::string selected(const std::map<std::string, std::map<std::string, std::string>>& specs) {
    return specs.empty() ? "full" : specs.begin()->first;
  }
};

}  // namespace kvserve::cli
