#include "cli/policy_cli.h"

#include "common/check.h"
#include "configs/policy_file.h"
#include "policies/policy_config.h"

namespace kvserve::cli {

std::map<std::string, std::string> parse_key_values(const std::vector<std::string>& items, const std::string& flag) {
  std::map<std::string, std::string> out;
  for (const auto& kv : items) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) KV_FAIL(flag << " '" << kv << "' is not key=value");
    out[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return out;
}

std::string policy_name_list() {
  std::string out;
  for (const auto& n : policy_names()) out += (out.empty() ? "" : ", ") + n;
  return out;
}

void PolicyFlags::add_to(CLI::App* cmd) {
  cmd->add_option("--policy", policy, "KV policy: " + policy_name_list());
  cmd->add_option("--budget", budget, "KV budget: average tokens per layer incl. the window, or a ratio 0<r<1");
  cmd->add_option("--policy-param", params, "policy parameter key=value (repeatable), e.g. window=8");
  cmd->add_option("--policy-config", policy_config, "YAML file of policy parameters (method: ..., budget: ...)");
}

std::map<std::string, std::map<std::string, std::string>> PolicyFlags::specs() const {
  std::map<std::string, std::string> p;
  if (!policy_config.empty()) p = config::load_policy_file(policy_config);
  std::string method = policy;
  if (auto it = p.find("name"); it != p.end() && policy == "full") method = it->second;
  p["name"] = method;
  if (!budget.empty()) p["budget"] = budget;
  for (const auto& [k, v] : parse_key_values(params, "--policy-param")) p[k] = v;
  if (method == "full" && p.size() == 1) return {};
  return {{method, p}};
}

}  // namespace kvserve::cli
