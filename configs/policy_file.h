#pragma once
// A standalone policy file (`--policy-config FILE`): one YAML mapping of policy parameters.
#include <map>
#include <string>

namespace kvserve::config {

// Reads {method: <library policy>, <param>: <scalar>, ...}; returns the params with "name" set to
// the method (the shape EngineOptions::policies uses). Errors name the file, line and key.
std::map<std::string, std::string> load_policy_file(const std::string& path);

}  // namespace kvserve::config
