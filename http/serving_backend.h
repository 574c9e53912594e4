#pragma once
// ServingBackend: what the HTTP layer needs from a loaded model (engine + tokenizer + chat
// template). The real one wraps kvserve::Engine (engine_backend.cpp); tests can supply their own.
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/engine/engine.h"
#include "backend/engine/engine_types.h"

namespace kvserve {
class Tokenizer;
}

namespace kvserve::http {

struct ParsedRequest;

class ServingBackend {
 public:
  virtual ~ServingBackend() = default;
  // Queues a request; throws KvError (bad request -> 400) or EngineOverloaded (-> 429).
  // `on_event` runs on the engine's thread and must not block.
  virtual void submit(GenerationRequest request, EventCallback on_event) = 0;
  // Queues several requests together, all or none (Engine::submit_all). By default one by one,
  // cancelling those queued when a later one throws.
  virtual void submit_all(std::vector<Submission> batch);
  virtual void cancel(const std::string& request_id) = 0;
  virtual EngineStats stats() const = 0;
  virtual bool healthy() const = 0;
  // Why it is not healthy (a dead rank, named by the job), or "".
  virtual std::string unhealthy_reason() const { return ""; }
  virtual bool has_policy(const std::string& name) const = 0;
  virtual std::vector<std::string> policy_names() const = 0;
  virtual std::string default_policy() const = 0;
  // Whether `policy` compresses a prompt's context alone (`compress: context`, kvzip's default).
  virtual bool compresses_context(const std::string& policy) const {
    (void)policy;
    return false;
  }
  virtual std::vector<int64_t> encode(const std::string& text, bool add_special_tokens) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  // The vocabulary's strings of `ids` (e.g. "Ġhello"), as /tokenize's return_token_strs shows them.
  virtual std::vector<std::string> token_strings(const std::vector<int64_t>& ids) const = 0;
  // Renders the chat template for a chat request; throws ApiError(400) when the template fails.
  virtual std::string render_chat(const ParsedRequest& request) const = 0;
  // The chat template's text ("" when none): where the tool-call format is detected.
  virtual std::string chat_template() const { return ""; }
  // The tokenizer's tokenizer_config.json text ("{}" when it has none), for GET /tokenizer_info.
  virtual std::string tokenizer_config() const { return "{}"; }
  virtual int64_t max_model_len() const = 0;
  virtual int64_t vocab_size() const = 0;
  // How the served weights are stored ("float32", "q4_1+q8_0" ...), for /v1/models.
  virtual std::string weight_format() const { return ""; }
  // The speculative_config in effect as JSON ("" = none), for /v1/models.
  virtual std::string speculative_config() const { return ""; }
  // Compiles a request's structured-output spec (response_format, guided_*, tool_choice) on the
  // caller's thread, before the request is queued; throws GrammarError naming the field.
  virtual std::shared_ptr<const StructuredGrammar> compile_grammar(const StructuredOutputSpec& spec);
  // Stops the engine: drain = finish in-flight work, else abort it.
  virtual void shutdown(bool drain) = 0;
};

// The backend over a real Engine (which must outlive nothing: the backend owns it).
std::shared_ptr<ServingBackend> make_engine_backend(std::unique_ptr<Engine> engine,
                                                    std::shared_ptr<const Tokenizer> tokenizer,
                                                    int64_t max_model_len, std::string default_policy);

}  // namespace kvserve::http
