#pragma once
// Transport-neutral HTTP request/response types shared by the server (server.cpp) and the
// OpenAI routes (openai_service.cpp).
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace kvserve::http {

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string target;  // path and query
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
  std::string remote;  // peer address, for logs

  std::string path() const { return target.substr(0, target.find('?')); }
  std::string header(const std::string& lower_name) const {
    auto it = headers.find(lower_name);
    return it == headers.end() ? std::string() : it->second;
  }
};

using HeaderList = std::vector<std::pair<std::string, std::string>>;

// n random hexadecimal digits (response ids, request ids).
inline std::string random_hex(size_t n) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* digits = "0123456789abcdef";
  std::string s(n, '0');
  for (auto& c : s) c = digits[rng() & 15];
  return s;
}

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  HeaderList headers;
  std::string body;
};

// One request's way back to the client, implemented by the transport. Thread-safe: the engine's
// thread calls it; every call only queues work on the connection's executor and never blocks.
// Calls after the exchange ended (or the client left) are ignored.
class ResponseChannel {
 public:
  virtual ~ResponseChannel() = default;
  // A complete response; ends the exchange.
  virtual void respond(HttpResponse response) = 0;
  // Server-sent events: headers first, then data, then the end.
  virtual void begin_stream(int status, HeaderList headers) = 0;
  virtual void stream(std::string data) = 0;
  virtual void end_stream() = 0;
  // `fn` runs once if the client goes away (or the request times out) before the exchange ends.
  virtual void on_abort(std::function<void()> fn) = 0;
};

}  // namespace kvserve::http
