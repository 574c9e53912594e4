// CORS for browser clients, as Starlette's CORSMiddleware (vLLM's) answers them.
#include "http/cors.h"

#include <algorithm>

#include "http/api_error.h"

namespace kvserve::http {

namespace {

// Response headers a browser script may read besides the simple ones.
constexpr const char* kExposed = "X-Request-Id, X-KV-Policy, X-KV-Rollout-Rule, Retry-After";

}  // namespace

bool CorsPolicy::allows(const std::string& origin) const {
  return !origin.empty() && std::any_of(origins_.begin(), origins_.end(),
                                        [&](const std::string& o) { return o == "*" || o == origin; });
}

bool CorsPolicy::is_preflight(const HttpRequest& req) const {
  return enabled() && req.method == "OPTIONS" && !req.header("origin").empty() &&
         !req.header("access-control-request-method").empty();
}

HttpResponse CorsPolicy::preflight(const HttpRequest& req) const {
  const std::string origin = req.header("origin");
  if (!allows(origin)) {
    HttpResponse r;
    r.status = 400;
    r.body = dump_json(ApiError(400, "disallowed CORS origin '" + origin + "' (server.allowed_origins)").to_json());
    return r;
  }
  HttpResponse r;
  r.status = 204;
  r.content_type.clear();
  r.headers = {{"Access-Control-Allow-Origin", origin},
               {"Access-Control-Allow-Methods", "GET, POST, OPTIONS"},
               {"Access-Control-Max-Age", "600"},
               {"Vary", "Origin"}};
  const std::string asked = req.header("access-control-request-headers");
  if (!asked.empty()) r.headers.push_back({"Access-Control-Allow-Headers", asked});
  return r;
}

HeaderList CorsPolicy::response_headers(const std::string& origin) const {
  if (!allows(origin)) return {};
  return {{"Access-Control-Allow-Origin", origin}, {"Access-Control-Expose-Headers", kExposed}, {"Vary", "Origin"}};
}

}  // namespace kvserve::http
