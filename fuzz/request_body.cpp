// /v1/completions and /v1/chat/completions bodies: every byte string is either a ParsedRequest
// within the limits or an ApiError(400) naming the problem.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz/fuzz_common.h"
#include "http/request_parser.h"

using kvserve::http::ApiError;
using kvserve::http::ParsedRequest;

namespace {

void check(const ParsedRequest& r, const kvserve::http::ParserLimits& lim) {
  // What the parser accepted must be within the limits the rest of the server relies on.
  if (r.n < 1 || r.n > lim.max_n) std::abort();
  // 0 only for a completion's echo (the prompt alone).
  if (r.sampling.max_tokens < (r.echo ? 0 : 1) || r.sampling.max_tokens > lim.max_tokens) std::abort();
  if (static_cast<int64_t>(r.bad_words.size()) > lim.max_bad_words) std::abort();
  if (static_cast<int64_t>(r.sampling.logit_bias.size()) > lim.max_logit_bias) std::abort();
  for (const auto& [t, b] : r.sampling.logit_bias)
    if (t < 0 || !(b >= -100.0 && b <= 100.0)) std::abort();
  for (int64_t t : r.sampling.allowed_token_ids)
    if (t < 0) std::abort();
  if (r.sampling.prompt_logprobs > lim.max_logprobs || (r.stream && r.sampling.prompt_logprobs >= 0 && !r.echo)) std::abort();
  if (static_cast<int64_t>(r.sampling.stop.size()) > lim.max_stop) std::abort();
  if (r.sampling.logprobs > lim.max_logprobs || r.top_logprobs > lim.max_logprobs) std::abort();
  if (static_cast<int64_t>(r.prompts.size()) > lim.max_prompts) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  const kvserve::http::ParserLimits lim;
  kvfuzz::expect_only<ApiError>([&] { check(kvserve::http::parse_completion_request(body, lim), lim); });
  kvfuzz::expect_only<ApiError>([&] {
    ParsedRequest r = kvserve::http::parse_chat_request(body, lim);
    check(r, lim);
    if (!r.messages.is_array() || r.messages.empty()) std::abort();
  });
  return 0;
}
