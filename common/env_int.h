#pragma once
// An integer setting read once from the environment (A/B switches such as KVSERVE_INT4_DENSE_ROWS):
// `fallback` when the variable is unset or empty.
#include <cstdint>
#include <cstdlib>

namespace kvserve {

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoll(e) : fallback;
}

}  // namespace kvserve
