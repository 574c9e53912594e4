#pragma once
// The structured-output fields of a request body, as OpenAI and vLLM spell them: response_format
// (json_object, json_schema), guided_json / guided_regex / guided_choice / guided_grammar and
// structured_outputs {json, regex, choice, grammar, json_object}.
#include <nlohmann/json.hpp>

#include <string_view>

#include "backend/sampling/structured_output_spec.h"

namespace kvserve::http {

// The one constraint the body asks for (kind kNone when none). At most one of the fields may ask
// for one; every problem is an ApiError(400) naming the field.
StructuredOutputSpec parse_structured_output(const nlohmann::json& body);
// A JSON object's keys come back sorted from nlohmann::json; a schema's properties must keep the
// order the client wrote (the output's keys follow it): re-reads spec's schema from the body text.
void keep_schema_key_order(StructuredOutputSpec& spec, std::string_view body);

}  // namespace kvserve::http
