#pragma once
// CorsPolicy: which browser origins may call the API (server.allowed_origins, --allowed-origins)
// and the Access-Control-* headers of their preflights and responses. No origins = CORS off: no
// headers, and OPTIONS is answered like any other unknown method.
#include <string>
#include <vector>

#include "http/http_types.h"

namespace kvserve::http {

class CorsPolicy {
 public:
  explicit CorsPolicy(std::vector<std::string> allowed_origins = {}) : origins_(std::move(allowed_origins)) {}
  bool enabled() const { return !origins_.empty(); }
  // `origin` is one of the allowed origins, or "*" is.
  bool allows(const std::string& origin) const;
  // A browser's preflight: OPTIONS with Origin and Access-Control-Request-Method (CORS on).
  bool is_preflight(const HttpRequest& req) const;
  // Its answer: 204 with the allowed methods and the requested headers, or a 400 for an origin not allowed.
  HttpResponse preflight(const HttpRequest& req) const;
  // Headers for a response to a request from `origin` ("" = not a browser's cross-origin request).
  HeaderList response_headers(const std::string& origin) const;

 private:
  std::vector<std::string> origins_;
};

}  // namespace kvserve::http
