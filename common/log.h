#pragma once
// KV_LOG: one line on stderr, prefixed "kvserve: ", written whole even when threads log at once
// (the server's operators read these lines; interleaved fragments would be useless).
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>

namespace kvserve {

inline void log_line(const std::string& message) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  std::cerr << "kvserve: " << message << std::endl;
}

}  // namespace kvserve

// KV_LOG(stream-expression), e.g. KV_LOG("loaded " << path << " in " << s << " s").
#define KV_LOG(msg)                          \
  do {                                       \
    std::ostringstream kv_log_os_;           \
    kv_log_os_ << msg;                       \
    ::kvserve::log_line(kv_log_os_.str());   \
  } while (0)
