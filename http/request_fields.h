#pragma once
// The request-field table: every field of vLLM's CompletionRequest and ChatCompletionRequest (plus
// OpenAI's and vLLM's older names), marked supported or refused per endpoint, so that no field is
// silently ignored. docs/api.md shows the same table (a test keeps the two equal).
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "http/request_parser.h"

namespace kvserve::http {

// How one endpoint treats a field.
enum class FieldSupport {
  kSupported,
  kRefused,  // a 400 naming it, unless its value is null or one of the field's no-op values
  kUnknown,  // a field of the other endpoint only: a 400 naming it (known, and meaningless here)
};

// One request field.
struct RequestField {
  const char* name;
  FieldSupport completions;
  FieldSupport chat;
  const char* no_ops;  // JSON array of the values a refused field may have (its defaults), "" = none
  const char* note;    // for the docs: what kvserve does with it, or why it is refused
};

const std::vector<RequestField>& request_fields();

// Throws ApiError(400), param = the field, for the first field of `body` (in key order) the endpoint
// refuses or that belongs to the other endpoint, or, when `strict`, that is in no table at all.
// Otherwise (vLLM's default) fields in no table are erased from `body` and returned, so that nothing
// downstream reads them. Null values always pass.
std::vector<std::string> check_request_fields(nlohmann::json& body, Endpoint endpoint, bool strict);

// The table as the markdown rows of docs/api.md ("| `name` | completions | chat | note |").
std::string request_fields_markdown();

}  // namespace kvserve::http
