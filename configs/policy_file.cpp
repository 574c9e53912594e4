#include "configs/policy_file.h"

#include <yaml-cpp/yaml.h>

#include "common/check.h"

namespace kvserve::config {

std::map<std::string, std::string> load_policy_file(const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    KV_FAIL(path << ": cannot open");
  } catch (const YAML::Exception& e) {
    KV_FAIL(path << ":" << e.mark.line + 1 << ": malformed YAML: " << e.msg);
  }
  if (!root.IsMap()) KV_FAIL(path << ": expected a mapping of policy parameters (method: ..., budget: ...)");
  std::map<std::string, std::string> params;
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    if (!kv.second.IsScalar()) {
      // Lists (skip_layers) are written as comma-separated text, which make_policy_config accepts.
      if (kv.second.IsSequence()) {
        std::string joined;
        for (const auto& e : kv.second) joined += (joined.empty() ? "" : ",") + e.as<std::string>();
        params[key] = joined;
        continue;
      }
      KV_FAIL(path << ":" << kv.second.Mark().line + 1 << ": key '" << key << "' must be a scalar");
    }
    params[key == "method" ? "name" : key] = kv.second.as<std::string>();
  }
  return params;
}

}  // namespace kvserve::config
