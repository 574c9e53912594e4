#pragma once
// ApiError: an OpenAI-style error response ({"error": {"message", "type", "param", "code"}}).
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>

namespace kvserve::http {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string type = {}, std::string code = {})
      : std::runtime_error(message), status_(status), param_(std::move(param)), type_(std::move(type)), code_(std::move(code)) {
    if (type_.empty()) type_ = default_type(status_);
  }

  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& type() const { return type_; }
  const std::string& code() const { return code_; }

  nlohmann::json to_json() const {
    nlohmann::json err = {{"message", what()}, {"type", type_}, {"param", nullptr}, {"code", nullptr}};
    if (!param_.empty()) err["param"] = param_;
    if (!code_.empty()) err["code"] = code_;
    return {{"error", err}};
  }

  static std::string default_type(int status) {
    switch (status) {
      case 400: case 404: case 405: case 413: return "invalid_request_error";
      case 401: return "authentication_error";
      case 429: return "rate_limit_exceeded";
      case 503: return "service_unavailable";
      default: return status >= 500 ? "server_error" : "invalid_request_error";
    }
  }

 private:
  int status_;
  std::string param_;
  std::string type_;
  std::string code_;
};

// Serialises JSON for the wire: invalid UTF-8 (e.g. a token that is half a character) is replaced
// rather than throwing.
inline std::string dump_json(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace kvserve::http
