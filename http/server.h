#pragma once
// HttpServer: the Boost.Beast/Asio transport. A small pool of I/O threads; one strand per
// connection; keep-alive, body-size limit, idle/header/write/request timeouts, a connection cap
// (503 + Retry-After beyond it), chunked SSE streaming, client-disconnect detection. Requests are
// handed to an OpenAIService.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "http/openai_service.h"

namespace kvserve::http {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0 = any free port
  int threads = 2;
  int64_t max_body_bytes = int64_t{1} << 20;
  double request_timeout_s = 600.0;
  double idle_timeout_s = 60.0;    // waiting for a request's first byte; also the whole body read
  double header_timeout_s = 10.0;  // first byte -> end of the headers (cuts off slowloris clients)
  double write_timeout_s = 30.0;   // one write may stall this long (a client that stopped reading)
  int64_t max_concurrent_connections = 256;
  int retry_after_s = 1;           // Retry-After of the over-capacity 503
  bool log_requests = true;
  std::vector<std::string> allowed_origins;  // CORS (http/cors.h); empty = off
};

class HttpServer {
 public:
  HttpServer(ServerOptions options, std::shared_ptr<OpenAIService> service);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and listens (throws std::runtime_error naming host:port on failure); starts the threads.
  void start();
  // The bound port (useful with port 0).
  int port() const { return bound_port_; }
  // Stops accepting new connections; open ones keep being served.
  void stop_accepting();
  // Closes every connection and joins the threads.
  void stop();
  int64_t open_connections() const;

  struct Impl;

 private:
  ServerOptions options_;
  std::shared_ptr<OpenAIService> service_;
  std::shared_ptr<Impl> impl_;
  int bound_port_ = 0;
};

}  // namespace kvserve::http
