#pragma once
// POST /tokenize and /detokenize in vLLM's shapes: a prompt or chat messages -> {count,
// max_model_len, tokens, token_strs}; token ids -> {prompt}.
#include "http/http_types.h"
#include "http/request_parser.h"
#include "http/serving_backend.h"

namespace kvserve::http {

HttpResponse tokenize_route(const HttpRequest& req, const ServingBackend& backend, const ParserLimits& limits);
HttpResponse detokenize_route(const HttpRequest& req, const ServingBackend& backend);
// GET /tokenizer_info in vLLM's shape: the tokenizer's config (special tokens as strings, without
// added_tokens_decoder) plus tokenizer_class and the chat template, which is what
// lm-evaluation-harness's tokenizer_backend=remote reads (with /tokenize and /detokenize).
HttpResponse tokenizer_info_route(const ServingBackend& backend);

}  // namespace kvserve::http
