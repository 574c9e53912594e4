// The OpenAI-compatible routes: request -> engine requests -> JSON or SSE, with metrics.
#include "http/openai_service.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <random>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include "backend/sampling/logits_processors.h"
#include "backend/sampling/grammar_compiler.h"
#include "common/check.h"
#include "http/tokenize_routes.h"

namespace kvserve::http {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

const char* kvserve_version() { return "0.1.0"; }

HttpResponse error_response(const ApiError& error) {
  HttpResponse r;
  r.status = error.status();
  r.body = dump_json(error.to_json());
  return r;
}

namespace {


// `text` tokenized as two pieces split at character `at`, the first with the special tokens a prompt
// starts with: a context tokenized alone, so that every prompt starting with it gets the same
// tokens. `min_each`: the least tokens either piece may have, else nullopt. Returns the tokens and
// the first piece's count.
std::optional<std::pair<std::vector<int64_t>, int64_t>> tokenize_split(const ServingBackend& backend,
                                                                      const std::string& text, size_t at, bool special,
                                                                      int64_t min_each) {
  std::vector<int64_t> ids = backend.encode(text.substr(0, at), special);
  const auto rest = backend.encode(text.substr(at), false);
  const auto context = static_cast<int64_t>(ids.size());
  if (context < min_each || static_cast<int64_t>(rest.size()) < min_each) return std::nullopt;
  ids.insert(ids.end(), rest.begin(), rest.end());
  return std::make_pair(std::move(ids), context);
}

// The chat's context (ParsedRequest::context_end_message, else every message before the last user
// message) rendered on its own; when the whole rendering starts with it, the prompt becomes its
// tokens followed by the rest's and `context` their count. Otherwise nothing changes.
bool split_chat_context(const ServingBackend& backend, const ParsedRequest& req, const std::string& text,
                        std::vector<int64_t>& prompt, int64_t& context) {
  size_t end = 0;
  if (req.context_end_message) {
    end = *req.context_end_message + 1;
  } else {
    for (size_t i = req.messages.size(); i-- > 0;) {
      if (req.messages[i].value("role", "") == "user") {
        end = i;
        break;
      }
    }
  }
  if (end == 0) return false;
  ParsedRequest head = req;
  head.messages = nlohmann::json::array();
  for (size_t i = 0; i < end && i < req.messages.size(); ++i) head.messages.push_back(req.messages[i]);
  head.add_generation_prompt = false;
  head.continue_final_message = false;
  std::string prefix;
  try {
    prefix = backend.render_chat(head);
  } catch (const ApiError&) {
    return false;  // a template that refuses a conversation ending there: see protect_question
  }
  if (prefix.empty() || prefix.size() >= text.size() || text.compare(0, prefix.size(), prefix) != 0) return false;
  auto split = tokenize_split(backend, text, prefix.size(), req.add_special_tokens.value_or(false), 1);
  if (!split) return false;
  std::tie(prompt, context) = std::move(*split);
  return true;
}

// The text of the last user message (its string, or its last text part): a one-message prompt.
std::string last_user_text(const ParsedRequest& req) {
  for (size_t i = req.messages.size(); i-- > 0;) {
    const auto& m = req.messages[i];
    if (m.value("role", "") != "user") continue;
    const auto c = m.find("content");
    if (c == m.end()) return "";
    if (c->is_string()) return c->get<std::string>();
    if (c->is_array())
      for (size_t k = c->size(); k-- > 0;)
        if ((*c)[k].value("type", "") == "text" && (*c)[k].contains("text") && (*c)[k]["text"].is_string())
          return (*c)[k]["text"].get<std::string>();
    return "";
  }
  return "";
}

// A prompt with no context boundary (one user message, a completion without kv_context) under a
// `compress: context` policy: everything before its question is the context, so the question stays
// whole instead of being compressed with the document. The question is the last paragraph of
// `turn` (the last user message or the completion's prompt text, after its last blank line) when
// that is at least `window` tokens, else the prompt's last `window` tokens. Split on the text, the
// context is tokenized alone, as a chat's is, so later questions about the same text find it
// cached. Returns false (nothing protected) for prompts under 2 x window tokens.
bool protect_question(const ServingBackend& backend, const std::string& text, const std::string& turn, bool special,
                      int64_t window, std::vector<int64_t>& prompt, int64_t& context) {
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (window <= 0 || n < 2 * window) return false;
  const size_t last = turn.find_last_not_of(" \t\r\n");
  const size_t blank = last == std::string::npos ? std::string::npos : turn.rfind("\n\n", last);
  if (!text.empty() && blank != std::string::npos) {
    const std::string question = turn.substr(blank + 2, last + 1 - (blank + 2));
    const size_t at = question.empty() ? std::string::npos : text.rfind(question);
    if (at != std::string::npos && at > 0) {
      if (auto split = tokenize_split(backend, text, at, special, window)) {
        std::tie(prompt, context) = std::move(*split);
        return true;
      }
    }
  }
  context = n - window;
  return true;
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

HttpResponse json_response(int status, const json& body) {
  HttpResponse r;
  r.status = status;
  r.body = dump_json(body);
  return r;
}

json utf8_bytes(const std::string& s) {
  json arr = json::array();
  for (unsigned char c : s) arr.push_back(static_cast<int>(c));
  return arr;
}

// Token ids of logit_bias and allowed_token_ids must be in the vocabulary; bad_words become vLLM's
// token sequences.
void check_logit_edits(ParsedRequest& req, const ServingBackend& backend) {
  const int64_t vocab = backend.vocab_size();
  auto in_vocab = [&](int64_t t, const char* param) {
    if (t >= vocab)
      throw ApiError(400, "token id " + std::to_string(t) + " in '" + param + "' is outside the vocabulary (" +
                              std::to_string(vocab) + ")", param);
  };
  for (const auto& [t, b] : req.sampling.logit_bias) in_vocab(t, "logit_bias");
  for (int64_t t : req.sampling.allowed_token_ids) in_vocab(t, "allowed_token_ids");
  req.sampling.bad_words_ids =
      bad_words_token_ids(req.bad_words, [&](const std::string& w) { return backend.encode(w, false); });
  for (const auto& w : req.sampling.bad_words_ids)
    for (int64_t t : w) in_vocab(t, "bad_words");
}

ApiError unauthorized() {
  return ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", "", "", "invalid_api_key");
}

std::string sse(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

// The 503 of an unhealthy engine says why (the dead rank), as the requests it failed did.
std::string unhealthy(const ServingBackend& b) {
  const std::string why = b.unhealthy_reason();
  return why.empty() ? "the engine is unhealthy" : "the engine is unhealthy: " + why;
}

// Per choice (one engine request) state.
struct Choice {
  std::string request_id;
  size_t prompt_index = 0;
  std::string text;
  int64_t completion_tokens = 0;
  bool finished = false;
  bool first_token_seen = false;
  std::string finish_reason;
  std::string error;
  bool request_error = false;  // the engine can never serve this request (too big for its KV pool)
  bool unavailable = false;    // the engine failed for good (a rank died): 503, retry elsewhere
  int64_t kept_kv = 0;
  int64_t full_kv = 0;
  std::string kv_cache_dtype;  // the dtype its KV was stored in (its policy's or ladder rung's)
  int64_t kept_head_min = 0, kept_head_max = 0;  // per (layer, KV head)
  double kept_head_mean = 0.0;
  int64_t cached_tokens = 0;  // prompt tokens from the prefix cache
  std::vector<int64_t> token_ids;  // return_token_ids
  bool prompt_ids_sent = false;    // stream: the first chunk carried prompt_token_ids
  Clock::time_point last_token;
  // logprobs, accumulated for non-streaming responses
  json chat_logprobs = json::array();  // chat: content entries
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(), text_offset = json::array();
  size_t text_bytes = 0;  // completions text_offset
  bool prompt_seen = false;  // the first event (which carries prompt_logprobs) arrived
  bool echoed = false;       // stream: the echoed prompt was sent
  json prompt_logprobs;      // vLLM's [null, {id: {logprob, rank, decoded_token}}, ...]
  json echo_logprobs;        // completions echo + logprobs: the prompt's part of `logprobs`
  std::shared_ptr<ToolCallStream> tool_stream;  // chat with tools: content held once a call may start
};

// One HTTP generation request: n choices per prompt, possibly streamed.
struct Exchange {
  std::mutex mu;
  std::shared_ptr<ResponseChannel> channel;
  std::shared_ptr<ServingBackend> backend;
  std::shared_ptr<ServerMetrics> metrics;
  std::shared_ptr<std::atomic<int64_t>> in_flight;
  ParsedRequest req;
  bool chat = false;
  std::string id;
  std::string model;
  std::string policy;
  std::string rollout_rule;  // "" = no rollout rules configured
  std::string context_boundary;  // "" = the policy does not compress contexts alone
  int retry_after_s = 1;         // Retry-After of a 503 (ServiceOptions::retry_after_s)
  int64_t created = 0;
  Clock::time_point arrival;
  std::vector<Choice> choices;
  std::vector<int64_t> prompt_tokens;  // per prompt
  std::vector<std::vector<int64_t>> prompt_ids;  // per prompt, with return_token_ids
  std::vector<std::string> echo_text;  // per prompt (completions echo)
  std::vector<std::string> first_token_text;  // per prompt: the token echo's logprobs start with
  bool echo_only = false;  // echo with max_tokens 0: the one token generated is not returned
  ToolCallFormat tool_format = ToolCallFormat::kHermes;
  size_t remaining = 0;
  bool started = false;  // stream headers sent (events before that are buffered)
  bool done = false;     // the response is complete (or failed); later events are ignored
  bool aborted = false;
  std::vector<std::string> pending;  // stream chunks produced before `started`
  HeaderList headers;

  bool counted = true;  // still counted in the service's in-flight total

  ~Exchange() { release(); }
  // The exchange no longer needs the engine (finished, failed or aborted).
  void release() {
    if (counted) {
      counted = false;
      in_flight->fetch_sub(1);
    }
  }

  // Prompt and completion tokens so far, over every prompt and choice.
  std::pair<int64_t, int64_t> token_counts() const {
    int64_t prompt = 0, completion = 0;
    for (int64_t p : prompt_tokens) prompt += p;
    for (const auto& c : choices) completion += c.completion_tokens;
    return {prompt, completion};
  }

  json usage() const {
    const auto [prompt, completion] = token_counts();
    int64_t kept = 0, full = 0, head_min = 0, head_max = 0, head_n = 0;
    double head_mean = 0.0;
    // A prompt's n choices share it: its cached tokens are the most any of them found.
    std::vector<int64_t> cached(prompt_tokens.size(), 0);
    for (const auto& c : choices) {
      kept += c.kept_kv;
      full += c.full_kv;
      head_min = head_n ? std::min(head_min, c.kept_head_min) : c.kept_head_min;
      head_max = std::max(head_max, c.kept_head_max);
      head_mean += c.kept_head_mean;
      ++head_n;
      if (c.prompt_index < cached.size()) cached[c.prompt_index] = std::max(cached[c.prompt_index], c.cached_tokens);
    }
    int64_t cached_total = 0;
    for (int64_t n : cached) cached_total += n;
    // Prompts of one request may fall on different rungs of a kv_dtype ladder: each dtype once.
    std::string dtypes;
    for (const auto& c : choices)
      if (!c.kv_cache_dtype.empty() && ("," + dtypes + ",").find("," + c.kv_cache_dtype + ",") == std::string::npos)
        dtypes += (dtypes.empty() ? "" : ",") + c.kv_cache_dtype;
    json out = {{"prompt_tokens", prompt},
                {"completion_tokens", completion},
                {"total_tokens", prompt + completion},
                {"prompt_tokens_details", {{"cached_tokens", cached_total}}},
                {"kv_policy", policy},
                {"kv_kept_tokens", kept},
                {"kv_full_tokens", full},
                // Tokens kept per (layer, KV head): head-wise budgets (head_budgets: adaptive) spread them.
                {"kv_kept_tokens_per_head",
                 {{"min", head_min}, {"mean", head_n ? head_mean / static_cast<double>(head_n) : 0.0}, {"max", head_max}}}};
    if (!dtypes.empty()) out["kv_cache_dtype"] = dtypes;
    if (!rollout_rule.empty()) out["kv_rollout_rule"] = rollout_rule;  // absent without rollout rules
    if (!context_boundary.empty()) out["kv_context_boundary"] = context_boundary;
    return out;
  }

  // A streamed chunk's usage: the counts so far with continuous_usage_stats (vLLM's), null when only
  // the last chunk carries it (include_usage, OpenAI's shape), else none. `opening`: a chat stream's
  // role chunk, which goes before every token chunk (tokens that came first wait in `pending`).
  void add_chunk_usage(json& chunk, bool opening = false) const {
    if (req.continuous_usage) {
      auto [prompt, completion] = token_counts();
      if (opening) completion = 0;
      chunk["usage"] = {{"prompt_tokens", prompt}, {"completion_tokens", completion}, {"total_tokens", prompt + completion}};
    } else if (req.include_usage) {
      chunk["usage"] = nullptr;
    }
  }

  json chunk_base() const {
    return {{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created}, {"model", model}};
  }

  void emit(std::string data) {
    if (started) channel->stream(std::move(data));
    else pending.push_back(std::move(data));
  }

  // Logprobs of one event in the wire format of this endpoint.
  json event_logprobs(const GenerationEvent& ev, Choice& c) const {
    if (chat) {
      json content = json::array();
      for (size_t i = 0; i < ev.chosen.size(); ++i) {
        const auto& t = ev.chosen[i];
        json top = json::array();
        if (i < ev.top_logprobs.size())
          for (const auto& alt : ev.top_logprobs[i])
            top.push_back({{"token", alt.token}, {"logprob", alt.logprob}, {"bytes", utf8_bytes(alt.token)}});
        content.push_back({{"token", t.token}, {"logprob", t.logprob}, {"bytes", utf8_bytes(t.token)}, {"top_logprobs", top}});
      }
      return {{"content", content}};
    }
    json tokens = json::array(), lps = json::array(), tops = json::array(), offsets = json::array();
    for (size_t i = 0; i < ev.chosen.size(); ++i) {
      const auto& t = ev.chosen[i];
      tokens.push_back(t.token);
      lps.push_back(t.logprob);
      json top = json::object();
      if (i < ev.top_logprobs.size())
        for (const auto& alt : ev.top_logprobs[i]) top[alt.token] = alt.logprob;
      tops.push_back(top);
      offsets.push_back(c.text_bytes);
      c.text_bytes += t.token.size();
    }
    return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
  }

  // The prompt's logprobs, from a choice's first event: vLLM's prompt_logprobs, and for an echo with
  // logprobs the prompt's tokens in the completions format (the first without a logprob).
  void take_prompt(Choice& c, const GenerationEvent& ev) {
    c.prompt_seen = true;
    if (req.sampling.prompt_logprobs >= 0) {
      c.prompt_logprobs = json::array({nullptr});
      for (size_t i = 0; i < ev.prompt_chosen.size(); ++i) {
        const auto& t = ev.prompt_chosen[i];
        json entry = {{std::to_string(t.token_id), {{"logprob", t.logprob}, {"rank", t.rank}, {"decoded_token", t.token}}}};
        for (const auto& alt : ev.prompt_top[i])
          if (!entry.contains(std::to_string(alt.token_id)))
            entry[std::to_string(alt.token_id)] = {{"logprob", alt.logprob}, {"rank", alt.rank}, {"decoded_token", alt.token}};
        c.prompt_logprobs.push_back(entry);
      }
    }
    if (chat || !req.echo || !req.want_logprobs) return;
    const std::string& first = first_token_text[c.prompt_index];
    json tokens = json::array({first}), lps = json::array({nullptr}), tops = json::array({nullptr}),
         offsets = json::array({0});
    c.text_bytes = first.size();
    for (size_t i = 0; i < ev.prompt_chosen.size(); ++i) {
      const auto& t = ev.prompt_chosen[i];
      json top = {{t.token, t.logprob}};  // as vLLM: the prompt token, then the top-k
      for (const auto& alt : ev.prompt_top[i]) top[alt.token] = alt.logprob;
      tokens.push_back(t.token);
      lps.push_back(t.logprob);
      tops.push_back(top);
      offsets.push_back(c.text_bytes);
      c.text_bytes += t.token.size();
    }
    c.echo_logprobs = {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
  }

  void on_event(size_t index, const GenerationEvent& event) {
    std::lock_guard<std::mutex> lock(mu);
    Choice& c = choices[index];
    if (c.finished) return;
    if (!c.prompt_seen) take_prompt(c, event);
    GenerationEvent stripped;
    if (echo_only) {  // the token vLLM also generates for an echo of max_tokens 0 is not part of the answer
      stripped.finished = event.finished;
      stripped.finish_reason = event.finish_reason;
      stripped.error = event.error;
      stripped.request_error = event.request_error;
      stripped.kept_kv_tokens = event.kept_kv_tokens;
      stripped.full_kv_tokens = event.full_kv_tokens;
      stripped.kept_head_min = event.kept_head_min;
      stripped.kept_head_max = event.kept_head_max;
      stripped.kept_head_mean = event.kept_head_mean;
    }
    const GenerationEvent& ev = echo_only ? stripped : event;
    const auto now = Clock::now();
    const int64_t ntok = static_cast<int64_t>(ev.token_ids.size());
    if (ntok > 0) {
      if (!c.first_token_seen) {
        c.first_token_seen = true;
        const double ttft = std::chrono::duration<double>(now - arrival).count();
        metrics->observe_ttft(ttft, policy);
        for (int64_t k = 1; k < ntok; ++k) metrics->observe_inter_token(0.0);
      } else {
        const double per = std::chrono::duration<double>(now - c.last_token).count() / static_cast<double>(ntok);
        for (int64_t k = 0; k < ntok; ++k) metrics->observe_inter_token(per);
      }
      c.last_token = now;
    }
    c.completion_tokens = std::max(c.completion_tokens + ntok, ev.completion_tokens);
    c.text += ev.text_delta;
    if (req.return_token_ids) c.token_ids.insert(c.token_ids.end(), ev.token_ids.begin(), ev.token_ids.end());
    json lp = nullptr;
    if (req.want_logprobs && !ev.chosen.empty()) {
      lp = event_logprobs(ev, c);
      if (chat) {
        for (auto& e : lp["content"]) c.chat_logprobs.push_back(e);
      } else {
        for (auto& e : lp["tokens"]) c.tokens.push_back(e);
        for (auto& e : lp["token_logprobs"]) c.token_logprobs.push_back(e);
        for (auto& e : lp["top_logprobs"]) c.top_logprobs.push_back(e);
        for (auto& e : lp["text_offset"]) c.text_offset.push_back(e);
      }
    }
    if (ev.finished) {
      c.finished = true;
      c.finish_reason = ev.finish_reason.empty() ? "stop" : ev.finish_reason;
      c.error = ev.error;
      c.request_error = ev.request_error;
      c.unavailable = ev.unavailable;
      c.kept_kv = ev.kept_kv_tokens;
      c.full_kv = ev.full_kv_tokens;
      c.kv_cache_dtype = ev.kv_cache_dtype;
      c.kept_head_min = ev.kept_head_min;
      c.kept_head_max = ev.kept_head_max;
      c.kept_head_mean = ev.kept_head_mean;
      c.cached_tokens = ev.cached_tokens;
      metrics->request_finished(c.finish_reason, policy, c.kept_kv, c.full_kv, rollout_rule,
                                {c.kept_head_min, c.kept_head_mean, c.kept_head_max});
    }
    if (done) return;
    if (req.stream) stream_event(index, ev, lp);
    if (ev.finished && --remaining == 0) finish();
  }

  void stream_event(size_t index, const GenerationEvent& ev, const json& lp) {
    Choice& c = choices[index];
    if (!chat && req.echo && !c.echoed) {
      c.echoed = true;
      json choice = {{"index", index}, {"text", echo_text[c.prompt_index]}, {"finish_reason", nullptr},
                     {"logprobs", req.want_logprobs ? c.echo_logprobs : json(nullptr)}};
      json chunk = chunk_base();
      chunk["choices"] = json::array({choice});
      add_chunk_usage(chunk);
      emit(sse(chunk));
    }
    const std::string text = c.tool_stream ? c.tool_stream->feed(ev.text_delta) : ev.text_delta;
    const bool ids = req.return_token_ids && !ev.token_ids.empty();
    const bool has_content = !text.empty() || !lp.is_null() || ids;
    if (has_content) {
      json choice = {{"index", index}, {"logprobs", lp}, {"finish_reason", nullptr}};
      if (chat) choice["delta"] = {{"content", text}};
      else choice["text"] = text;
      if (req.return_token_ids) {
        // As vLLM: each chunk's tokens, and the prompt's with a choice's first chunk.
        choice["token_ids"] = ev.token_ids;
        if (!c.prompt_ids_sent) choice["prompt_token_ids"] = prompt_ids[c.prompt_index];
        c.prompt_ids_sent = true;
      }
      json chunk = chunk_base();
      chunk["choices"] = json::array({choice});
      add_chunk_usage(chunk);
      emit(sse(chunk));
    }
    if (ev.finished) {
      if (c.finish_reason == "error") {
        emit(sse(failure(c).to_json()));
        return;
      }
      if (c.tool_stream) {
        // What was held: the rest of the content, then each call as one tool_calls delta.
        const ToolCallOutput out = c.tool_stream->finish();
        json delta = json::object();
        if (!out.content.empty()) delta["content"] = out.content;
        if (!out.calls.empty()) {
          delta["tool_calls"] = tool_calls_json(out.calls, /*with_index=*/true);
          c.finish_reason = "tool_calls";
        }
        if (!delta.empty()) {
          json chunk = chunk_base();
          chunk["choices"] = json::array({{{"index", index}, {"delta", delta}, {"logprobs", nullptr}, {"finish_reason", nullptr}}});
          add_chunk_usage(chunk);
          emit(sse(chunk));
        }
      }
      json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", wire_finish_reason(c.finish_reason)}};
      if (chat) choice["delta"] = json::object();
      else choice["text"] = "";
      json chunk = chunk_base();
      chunk["choices"] = json::array({choice});
      add_chunk_usage(chunk);
      emit(sse(chunk));
    }
  }

  // A request the engine can never serve is the client's to fix (vLLM answers an over-long prompt
  // with 400); anything else that fails a generation is the server's.
  static ApiError failure(const Choice& c) {
    if (c.request_error) return ApiError(400, c.error, "", "invalid_request_error");
    if (c.unavailable) return ApiError(503, c.error, "", "server_error");
    return ApiError(500, "generation failed: " + c.error, "", "server_error");
  }

  static std::string wire_finish_reason(const std::string& r) {
    // OpenAI knows stop | length; vLLM also reports abort.
    return r;
  }

  void finish() {
    done = true;
    // Out of the in-flight count only once the last bytes are handed to the channel: a draining
    // server stops its connections when the count reaches 0, and a stream must not lose its end.
    struct ReleaseAtEnd {
      Exchange* ex;
      ~ReleaseAtEnd() { ex->release(); }
    } release_at_end{this};
    const double e2e = std::chrono::duration<double>(Clock::now() - arrival).count();
    metrics->observe_e2e(e2e, policy);
    if (req.stream) {
      if (req.include_usage) {
        json chunk = chunk_base();
        chunk["choices"] = json::array();
        chunk["usage"] = usage();
        emit(sse(chunk));
      }
      emit("data: [DONE]\n\n");
      if (started) channel->end_stream();
      return;
    }
    for (const auto& c : choices) {
      if (c.finish_reason == "error") {
        HttpResponse r = error_response(failure(c));
        r.headers = headers;
        if (r.status == 503) r.headers.push_back({"Retry-After", std::to_string(retry_after_s)});
        metrics->http_response(r.status);
        channel->respond(std::move(r));
        return;
      }
    }
    json out_choices = json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      const Choice& c = choices[i];
      json choice = {{"index", i}, {"finish_reason", wire_finish_reason(c.finish_reason)}};
      if (chat && c.tool_stream) {
        const ToolCallOutput out = parse_tool_calls(c.text, tool_format);
        choice["message"] = {{"role", "assistant"}, {"content", out.content}};
        if (!out.calls.empty()) {
          choice["message"]["content"] = out.content.empty() ? json(nullptr) : json(out.content);
          choice["message"]["tool_calls"] = tool_calls_json(out.calls, /*with_index=*/false);
          choice["finish_reason"] = "tool_calls";
        }
        choice["logprobs"] = req.want_logprobs ? json{{"content", c.chat_logprobs}} : json(nullptr);
      } else if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", c.text}};
        choice["logprobs"] = req.want_logprobs ? json{{"content", c.chat_logprobs}} : json(nullptr);
      } else {
        std::string text = c.text;
        if (req.echo) text = echo_text[c.prompt_index] + text;
        choice["text"] = text;
        json lp = nullptr;
        if (req.want_logprobs) {
          lp = c.echo_logprobs.is_null() ? json{{"tokens", json::array()}, {"token_logprobs", json::array()},
                                                {"top_logprobs", json::array()}, {"text_offset", json::array()}}
                                         : c.echo_logprobs;
          for (const auto& [key, part] : {std::pair<const char*, const json*>{"tokens", &c.tokens},
                                          {"token_logprobs", &c.token_logprobs},
                                          {"top_logprobs", &c.top_logprobs},
                                          {"text_offset", &c.text_offset}})
            for (const auto& e : *part) lp[key].push_back(e);
        }
        choice["logprobs"] = lp;
        if (req.sampling.prompt_logprobs >= 0) choice["prompt_logprobs"] = c.prompt_logprobs;
        if (req.return_token_ids) choice["prompt_token_ids"] = prompt_ids[c.prompt_index];
      }
      if (req.return_token_ids) choice["token_ids"] = c.token_ids;
      out_choices.push_back(choice);
    }
    json body = {{"id", id}, {"object", chat ? "chat.completion" : "text_completion"}, {"created", created},
                 {"model", model}, {"choices", out_choices}, {"usage", usage()}};
    if (chat) body["system_fingerprint"] = nullptr;
    if (chat && req.sampling.prompt_logprobs >= 0) body["prompt_logprobs"] = choices.front().prompt_logprobs;
    if (chat && req.return_token_ids) body["prompt_token_ids"] = prompt_ids.front();
    HttpResponse r = json_response(200, body);
    r.headers = headers;
    metrics->http_response(200);
    channel->respond(std::move(r));
  }

  // The client left: cancel what still runs.
  void abort() {
    std::vector<std::string> ids;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (done) return;
      aborted = true;
      done = true;
      release();
      for (const auto& c : choices)
        if (!c.finished && !c.request_id.empty()) ids.push_back(c.request_id);
    }
    for (const auto& rid : ids) backend->cancel(rid);
  }
};

bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

}  // namespace

OpenAIService::OpenAIService(ServiceOptions options)
    : options_(std::move(options)), metrics_(std::make_shared<ServerMetrics>(options_.model_name)) {}

void OpenAIService::set_backend(std::shared_ptr<ServingBackend> backend) {
  std::lock_guard<std::mutex> lock(mu_);
  backend_ = std::move(backend);
}

std::shared_ptr<ServingBackend> OpenAIService::backend() const {
  std::lock_guard<std::mutex> lock(mu_);
  return backend_;
}

std::string bearer_token(const HttpRequest& req) {
  std::string auth = req.header("authorization");
  const std::string prefix = "Bearer ";
  if (auth.size() < prefix.size() || !std::equal(prefix.begin(), prefix.end(), auth.begin(), [](char a, char b) {
        return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
      }))
    return {};
  return auth.substr(prefix.size());
}

bool OpenAIService::authorized(const HttpRequest& req) const {
  if (options_.api_key.empty() && options_.api_keys.empty()) return true;
  const std::string token = bearer_token(req);
  if (token.empty()) return false;
  bool ok = !options_.api_key.empty() && constant_time_equal(token, options_.api_key);
  for (const auto& [name, key] : options_.api_keys) ok = constant_time_equal(token, key) || ok;
  return ok;
}

HttpResponse OpenAIService::route_simple(const HttpRequest& req, bool& handled) {
  handled = true;
  const std::string path = req.path();
  auto method_must_be = [&](const char* m) {
    if (req.method != m) {
      ApiError e(405, "method " + req.method + " is not allowed on " + path + " (use " + m + ")");
      HttpResponse r = error_response(e);
      r.headers.push_back({"Allow", m});
      return std::optional<HttpResponse>(r);
    }
    return std::optional<HttpResponse>();
  };
  if (path == "/health") {
    if (auto r = method_must_be("GET")) return *r;
    auto b = backend();
    if (!b) return error_response(ApiError(503, "the model is loading"));
    if (!b->healthy()) return error_response(ApiError(503, unhealthy(*b)));
    if (shutting_down_) return error_response(ApiError(503, "the server is shutting down"));
    HttpResponse r;
    r.content_type = "text/plain";
    r.body = "";
    return r;
  }
  if (path == "/version") {
    if (auto r = method_must_be("GET")) return *r;
    return json_response(200, {{"version", kvserve_version()}});
  }
  if (path == "/metrics") {
    if (auto r = method_must_be("GET")) return *r;
    auto b = backend();
    HttpResponse r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = metrics_->render(b ? std::optional<EngineStats>(b->stats()) : std::nullopt);
    return r;
  }
  if (path == "/v1/models" || path.rfind("/v1/models/", 0) == 0) {
    if (auto r = method_must_be("GET")) return *r;
    if (!authorized(req)) return error_response(unauthorized());
    auto b = backend();
    json model = {{"id", options_.model_name},
                  {"object", "model"},
                  {"created", std::chrono::duration_cast<std::chrono::seconds>(started_.time_since_epoch()).count()},
                  {"owned_by", "kvserve"},
                  {"root", options_.model_name},
                  {"parent", nullptr}};
    if (b) {
      model["max_model_len"] = b->max_model_len();
      model["kv_policies"] = b->policy_names();
      model["default_kv_policy"] = b->default_policy();
      if (const std::string w = b->weight_format(); !w.empty()) model["quantization"] = w;
      if (const std::string sc = b->speculative_config(); !sc.empty()) model["speculative_config"] = json::parse(sc);
    }
    if (path == "/v1/models" ) return json_response(200, {{"object", "list"}, {"data", json::array({model})}});
    std::string id = path.substr(std::string("/v1/models/").size());
    if (id != options_.model_name)
      return error_response(ApiError(404, "the model '" + id + "' does not exist", "model", "", "model_not_found"));
    return json_response(200, model);
  }
  if (path == "/tokenizer_info") {
    if (auto r = method_must_be("GET")) return *r;
    if (!authorized(req)) return error_response(unauthorized());
    auto b = backend();
    if (!b) return error_response(ApiError(503, "the model is loading; retry shortly"));
    return tokenizer_info_route(*b);
  }
  if (path == "/tokenize" || path == "/detokenize") {
    if (auto r = method_must_be("POST")) return *r;
    if (!authorized(req)) return error_response(unauthorized());
    auto b = backend();
    if (!b) return error_response(ApiError(503, "the model is loading; retry shortly"));
    return path == "/tokenize" ? tokenize_route(req, *b, options_.limits) : detokenize_route(req, *b);
  }
  if (path == "/v1/completions" || path == "/v1/chat/completions") {
    if (auto r = method_must_be("POST")) return *r;
    handled = false;
    return {};
  }
  return error_response(ApiError(404, "no route for " + req.method + " " + path, "", "", "not_found"));
}

void OpenAIService::handle(HttpRequest req, std::shared_ptr<ResponseChannel> channel) {
  // 429 and 503 are answers to retry, not failures: Retry-After says when, so that clients back off
  // instead of hammering a full queue.
  auto send = [&](HttpResponse r) {
    if (r.status == 429 || r.status == 503) r.headers.push_back({"Retry-After", std::to_string(options_.retry_after_s)});
    metrics_->http_response(r.status);
    channel->respond(std::move(r));
  };
  try {
    bool handled = false;
    HttpResponse r = route_simple(req, handled);
    if (handled) return send(std::move(r));
    generate(req, req.path() == "/v1/chat/completions" ? Endpoint::kChatCompletions : Endpoint::kCompletions, channel);
  } catch (const ApiError& e) {
    send(error_response(e));
  } catch (const EngineOverloaded& e) {
    // The engine refuses for a full queue (429) but also when it is over capacity (its queue holds
    // more than max_queue_time_s of prefill), stops or fails between the checks in generate() and
    // its submit(): those are 503.
    auto b = backend();
    const bool unavailable = shutting_down_ || !b || !b->healthy();
    const int status = unavailable || e.over_capacity() ? 503 : 429;
    send(error_response(ApiError(status, e.what(), "", "", unavailable ? "" : "engine_overloaded")));
  } catch (const KvError& e) {
    send(error_response(ApiError(400, e.what())));
  } catch (const std::exception& e) {
    send(error_response(ApiError(500, std::string("internal error: ") + e.what())));
  }
}

void OpenAIService::generate(const HttpRequest& http_req, Endpoint endpoint, std::shared_ptr<ResponseChannel> channel) {
  if (!authorized(http_req))
    throw unauthorized();
  auto backend = this->backend();
  if (!backend) throw ApiError(503, "the model is loading; retry shortly");
  if (shutting_down_) throw ApiError(503, "the server is shutting down");
  if (!backend->healthy()) throw ApiError(503, unhealthy(*backend));

  const bool chat = endpoint == Endpoint::kChatCompletions;
  ParsedRequest req = chat ? parse_chat_request(http_req.body, options_.limits)
                           : parse_completion_request(http_req.body, options_.limits);
  if (!req.model.empty() && req.model != options_.model_name)
    throw ApiError(404, "the model '" + req.model + "' does not exist (this server serves '" + options_.model_name + "')",
                   "model", "", "model_not_found");

  // Tokenize every prompt.
  std::vector<std::vector<int64_t>> prompts;
  std::vector<int64_t> contexts;  // per prompt: its leading context tokens (kv_context, a chat's history)
  std::vector<std::string> echo;
  const int64_t vocab = backend->vocab_size();
  if (chat) {
    std::string text = backend->render_chat(req);
    prompts.push_back(backend->encode(text, req.add_special_tokens.value_or(false)));
    contexts.push_back(0);  // split below, once the policy is known
    echo.push_back(text);
  } else {
    // kv_context goes before every prompt; it takes the special tokens a prompt would start with.
    std::vector<int64_t> context_ids;
    std::string context_text;
    if (req.kv_context) {
      const PromptInput& c = *req.kv_context;
      if (c.is_tokens) {
        for (int64_t t : c.token_ids)
          if (t >= vocab) throw ApiError(400, "token id " + std::to_string(t) + " in 'kv_context' is outside the vocabulary (" + std::to_string(vocab) + ")", "kv_context");
        context_ids = c.token_ids;
        context_text = req.echo ? backend->decode(c.token_ids) : std::string();
      } else {
        context_ids = backend->encode(c.text, req.add_special_tokens.value_or(true));
        context_text = c.text;
      }
    }
    for (size_t i = 0; i < req.prompts.size(); ++i) {
      const auto& p = req.prompts[i];
      const std::string param = req.prompts.size() > 1 ? "prompt[" + std::to_string(i) + "]" : "prompt";
      std::vector<int64_t> ids = context_ids;
      if (p.is_tokens) {
        for (int64_t t : p.token_ids)
          if (t >= vocab) throw ApiError(400, "token id " + std::to_string(t) + " in '" + param + "' is outside the vocabulary (" + std::to_string(vocab) + ")", param);
        ids.insert(ids.end(), p.token_ids.begin(), p.token_ids.end());
        echo.push_back(req.echo ? context_text + backend->decode(p.token_ids) : std::string());
      } else {
        const auto more = backend->encode(p.text, req.add_special_tokens.value_or(true) && !req.kv_context);
        ids.insert(ids.end(), more.begin(), more.end());
        echo.push_back(context_text + p.text);
      }
      prompts.push_back(std::move(ids));
      contexts.push_back(static_cast<int64_t>(context_ids.size()));
    }
  }
  check_logit_edits(req, *backend);
  const int64_t max_len = backend->max_model_len();
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::string param = chat ? "messages" : "prompt";
    const int64_t n = static_cast<int64_t>(prompts[i].size());
    if (n == 0) throw ApiError(400, "the prompt is empty", param);
    if (max_len > 0 && n >= max_len)
      throw ApiError(400, "this model's maximum context length is " + std::to_string(max_len) + " tokens, but the prompt has " +
                              std::to_string(n) + " tokens", param);
    if (max_len > 0 && req.max_tokens && n + *req.max_tokens > max_len)
      throw ApiError(400, "this model's maximum context length is " + std::to_string(max_len) + " tokens; the prompt (" +
                              std::to_string(n) + " tokens) plus max_tokens (" + std::to_string(*req.max_tokens) + ") exceeds it",
                     chat && req.max_tokens ? "max_tokens" : "max_tokens");
  }

  // Policy: with rollout rules, their decision (which also rules on the request's kv_policy); else
  // the request's kv_policy, else the resolver's choice, else the default. Resolved once, here at
  // admission: a config reload does not change the policy of a request already admitted.
  const std::string response_id = (chat ? "chatcmpl-" : "cmpl-") + random_hex(24);
  std::string policy, rollout_rule;
  int64_t max_draft_tokens = -1;
  if (options_.rollout_resolver) {
    int64_t longest = 0;
    for (const auto& p : prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
    auto choice = options_.rollout_resolver(http_req, req, longest, response_id);
    policy = choice.policy;
    rollout_rule = choice.rule;
    max_draft_tokens = choice.max_draft_tokens;
  } else {
    policy = req.kv_policy;
    if (policy.empty() && options_.policy_resolver) policy = options_.policy_resolver(http_req, req);
  }
  if (policy.empty()) policy = backend->default_policy();
  if (!backend->has_policy(policy)) {
    std::string names;
    for (const auto& n : backend->policy_names()) names += (names.empty() ? "" : ", ") + n;
    throw ApiError(400, "unknown kv_policy '" + policy + "' (configured: " + names + ")", "kv_policy");
  }

  // A prompt under a policy that compresses contexts alone: the context is a chat's conversation
  // before the last user message (or up to the last cache_control marker), tokenized on its own so
  // that every question about it starts with the same tokens, or a completion's kv_context; without
  // either, everything before the prompt's question (protect_question).
  std::string boundary;
  if (backend->compresses_context(policy)) {
    for (size_t p = 0; p < prompts.size(); ++p) {
      std::string kind = "none";
      if (chat && split_chat_context(*backend, req, echo[0], prompts[0], contexts[0]))
        kind = req.context_end_message ? "cache_control" : "messages";
      else if (!chat && contexts[p] > 0)
        kind = "kv_context";
      else if (protect_question(*backend, chat ? echo[0] : req.prompts[p].is_tokens ? "" : req.prompts[p].text,
                                chat ? last_user_text(req) : req.prompts[p].text,
                                req.add_special_tokens.value_or(!chat), options_.protect_last_tokens, prompts[p], contexts[p]))
        kind = "protected_question";
      metrics_->context_boundary(kind);
      if (p == 0) boundary = kind;
    }
  }

  // Tools: the format the model writes calls in; a forced call is a grammar.
  ToolCallFormat tool_format = ToolCallFormat::kHermes;
  if (chat && req.tools.active()) {
    const auto named = tool_call_format_named(options_.tool_call_parser);
    tool_format = named ? *named : detect_tool_call_format(backend->chat_template());
    if (req.tools.forced()) {
      if (req.structured.active())
        throw ApiError(400, "'tool_choice' forces a tool call; it cannot be combined with '" + req.structured.field + "'",
                       "tool_choice");
      req.structured = forced_tool_call_spec(req.tools, tool_format);
    }
    // Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are special tokens the parser must see.
    if (tool_format != ToolCallFormat::kHermes) req.sampling.skip_special_tokens = false;
  }

  // Structured output: compiled here, on the HTTP thread and before queueing, so that the engine
  // never waits for a compile and a bad schema is a 400.
  if (req.structured.active()) {
    try {
      req.sampling.grammar = backend->compile_grammar(req.structured);
    } catch (const GrammarError& e) {
      throw ApiError(400, e.what(), e.field());
    }
  }

  auto ex = std::make_shared<Exchange>();
  in_flight_->fetch_add(1);
  ex->in_flight = in_flight_;
  ex->channel = channel;
  ex->backend = backend;
  ex->metrics = metrics_;
  ex->chat = chat;
  ex->id = response_id;
  ex->model = options_.model_name;
  ex->policy = policy;
  ex->rollout_rule = rollout_rule;
  ex->context_boundary = boundary;
  ex->retry_after_s = options_.retry_after_s;
  ex->created = unix_now();
  ex->arrival = Clock::now();
  ex->echo_text = echo;
  ex->echo_only = !chat && req.echo && req.max_tokens == 0;
  if (!chat && req.echo)
    for (const auto& p : prompts) ex->first_token_text.push_back(backend->decode({p.front()}));
  ex->tool_format = tool_format;
  ex->headers = {{"X-KV-Policy", policy}, {"X-Request-Id", http_req.header("x-request-id").empty() ? ex->id : http_req.header("x-request-id")}};
  if (!rollout_rule.empty()) ex->headers.push_back({"X-KV-Rollout-Rule", rollout_rule});
  std::string ignored;
  for (const auto& f : req.ignored_fields) ignored += (ignored.empty() ? "" : ", ") + f;
  if (!ignored.empty()) ex->headers.push_back({"X-KV-Ignored-Fields", ignored});
  for (const auto& p : prompts) ex->prompt_tokens.push_back(static_cast<int64_t>(p.size()));
  if (req.return_token_ids) ex->prompt_ids = prompts;
  const size_t total = prompts.size() * static_cast<size_t>(req.n);
  ex->choices.resize(total);
  if (chat && req.tools.active())
    for (auto& c : ex->choices) c.tool_stream = std::make_shared<ToolCallStream>(tool_format, req.tools.forced());
  ex->remaining = total;
  ex->req = std::move(req);
  const ParsedRequest& r = ex->req;
  if (options_.log_requests) {
    std::cerr << "kvserve: " << ex->id << " " << http_req.path() << " prompts=" << prompts.size() << " n=" << r.n
              << " prompt_tokens=" << prompts[0].size() << " max_tokens=" << r.sampling.max_tokens << " policy=" << policy
              << (rollout_rule.empty() ? "" : " rule=" + rollout_rule)
              << (r.stream ? " stream" : "") << (ignored.empty() ? "" : " ignored_fields=" + ignored) << "\n";
  }

  // Every choice, queued together (all or none): they meet the scheduler in the same step. Events
  // may arrive before submit_all returns; they are buffered (stream) or accumulated until the last
  // choice finishes.
  std::vector<Submission> batch;
  for (size_t p = 0; p < prompts.size(); ++p) {
    for (int64_t k = 0; k < r.n; ++k) {
      const size_t index = p * static_cast<size_t>(r.n) + static_cast<size_t>(k);
      GenerationRequest g;
      g.request_id = ex->id + "-" + std::to_string(index);
      g.prompt_ids = prompts[p];
      g.sampling = r.sampling;
      if (g.sampling.seed && k > 0) g.sampling.seed = *g.sampling.seed + static_cast<uint64_t>(k);
      if (ex->echo_only) g.sampling.max_tokens = 1;  // as vLLM: one token is generated and dropped
      if (!r.max_tokens && chat && max_len > 0) g.sampling.max_tokens = max_len - static_cast<int64_t>(prompts[p].size());
      else if (!r.max_tokens && max_len > 0)
        g.sampling.max_tokens = std::min<int64_t>(g.sampling.max_tokens, max_len - static_cast<int64_t>(prompts[p].size()));
      g.kv_policy = policy;
      g.reuse_compressed = r.reuse_compressed;
      g.speculative = r.speculative;
      g.max_draft_tokens = max_draft_tokens;
      g.context_len = contexts[p];
      {
        std::lock_guard<std::mutex> lock(ex->mu);
        ex->choices[index].request_id = g.request_id;
        ex->choices[index].prompt_index = p;
      }
      batch.push_back({std::move(g), [ex, index](const GenerationEvent& ev) { ex->on_event(index, ev); }});
    }
  }
  try {
    backend->submit_all(std::move(batch));
  } catch (...) {
    std::lock_guard<std::mutex> lock(ex->mu);
    ex->done = true;
    ex->release();
    throw;
  }
  // A stream's status is sent now; a JSON response's when it is complete (it may still fail).
  if (r.stream) metrics_->http_response(200);

  std::weak_ptr<Exchange> weak = ex;
  channel->on_abort([weak] {
    if (auto e = weak.lock()) e->abort();
  });
  if (r.stream) {
    std::lock_guard<std::mutex> lock(ex->mu);
    if (ex->aborted) return;
    HeaderList headers = ex->headers;
    headers.push_back({"Cache-Control", "no-cache"});
    channel->begin_stream(200, headers);
    if (chat) {
      for (size_t i = 0; i < total; ++i) {
        json chunk = ex->chunk_base();
        chunk["choices"] = json::array({{{"index", i}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr}, {"finish_reason", nullptr}}});
        ex->add_chunk_usage(chunk, /*opening=*/true);
        channel->stream(sse(chunk));
      }
    }
    ex->started = true;
    for (auto& chunk : ex->pending) channel->stream(std::move(chunk));
    ex->pending.clear();
    if (ex->done && !ex->aborted) channel->end_stream();
  }
}

}  // namespace kvserve::http
