#pragma once
// KV_CHECK: invariant and input checks that throw with file:line context; used by every component.
#include <sstream>
#include <stdexcept>
#include <string>

namespace kvserve {

// Thrown for violated invariants and bad input; the message says what and where.
class KvError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
[[noreturn]] inline void throw_check(const char* file, int line, const char* cond, const std::string& msg) {
  std::ostringstream os;
  os << msg << " [" << cond << " at " << file << ":" << line << "]";
  throw KvError(os.str());
}
}  // namespace detail

}  // namespace kvserve

// KV_CHECK(cond, stream-expression): throws kvserve::KvError carrying the message and file/line.
#define KV_CHECK(cond, msg)                                                      \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::ostringstream kv_check_os_;                                           \
      kv_check_os_ << msg;                                                       \
      ::kvserve::detail::throw_check(__FILE__, __LINE__, #cond, kv_check_os_.str()); \
    }                                                                            \
  } while (0)

// KV_FAIL(stream-expression): input errors that need no condition text.
#define KV_FAIL(msg)                                                             \
  do {                                                                           \
    std::ostringstream kv_check_os_;                                             \
    kv_check_os_ << msg;                                                         \
    throw ::kvserve::KvError(kv_check_os_.str());                                \
  } while (0)
