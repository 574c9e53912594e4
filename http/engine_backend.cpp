// The ServingBackend over the real Engine, Tokenizer and ChatTemplate.
#include <memory>

#include "backend/engine/engine.h"
#include "backend/model/decoder_model.h"
#include "backend/sampling/grammar_compiler.h"
#include "http/request_parser.h"
#include "http/serving_backend.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace kvserve::http {

namespace {

class EngineBackend : public ServingBackend {
 public:
  EngineBackend(std::unique_ptr<Engine> engine, std::shared_ptr<const Tokenizer> tokenizer, int64_t max_model_len,
                std::string default_policy)
      : engine_(std::move(engine)), tokenizer_(std::move(tokenizer)), max_model_len_(max_model_len),
        default_policy_(std::move(default_policy)) {
    const std::string& source = tokenizer_->chat_template();
    if (!source.empty()) {
      try {
        template_ = std::make_unique<ChatTemplate>(source);
      } catch (const std::exception& e) {
        template_error_ = e.what();
      }
    }
  }
  ~EngineBackend() override { engine_->shutdown(false); }

  void submit(GenerationRequest request, EventCallback on_event) override {
    engine_->submit(std::move(request), std::move(on_event));
  }
  void submit_all(std::vector<Submission> batch) override { engine_->submit_all(std::move(batch)); }
  void cancel(const std::string& request_id) override { engine_->cancel(request_id); }
  EngineStats stats() const override { return engine_->stats(); }
  bool healthy() const override { return engine_->healthy(); }
  std::string unhealthy_reason() const override { return engine_->unhealthy_reason(); }
  bool has_policy(const std::string& name) const override { return engine_->has_policy(name); }
  bool compresses_context(const std::string& name) const override { return engine_->compresses_context(name); }
  std::vector<std::string> policy_names() const override { return engine_->policy_names(); }
  std::string default_policy() const override { return default_policy_; }
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens) const override {
    return tokenizer_->encode(text, add_special_tokens);
  }
  std::string decode(const std::vector<int64_t>& ids) const override { return tokenizer_->decode(ids, false); }
  std::vector<std::string> token_strings(const std::vector<int64_t>& ids) const override {
    std::vector<std::string> out;
    for (int64_t id : ids) out.push_back(tokenizer_->id_to_token(id));
    return out;
  }
  int64_t max_model_len() const override { return max_model_len_; }
  int64_t vocab_size() const override { return tokenizer_->vocab_size(); }
  void shutdown(bool drain) override { engine_->shutdown(drain); }
  std::string weight_format() const override { return engine_->model().weight_format(); }
  std::string speculative_config() const override {
    return engine_->speculative().enabled() ? speculative_config_json(engine_->speculative()) : "";
  }
  std::string chat_template() const override { return tokenizer_->chat_template(); }
  std::string tokenizer_config() const override { return tokenizer_->config_json(); }
  std::shared_ptr<const StructuredGrammar> compile_grammar(const StructuredOutputSpec& spec) override {
    return engine_->compile_grammar(spec);
  }

  std::string render_chat(const ParsedRequest& req) const override {
    if (!template_) {
      if (!template_error_.empty())
        throw ApiError(400, "the model's chat template does not parse: " + template_error_, "messages");
      throw ApiError(400, "this model has no chat template (tokenizer_config.json chat_template); use /v1/completions",
                     "messages");
    }
    nlohmann::json ctx = nlohmann::json::object();
    for (auto it = req.chat_template_kwargs.begin(); it != req.chat_template_kwargs.end(); ++it) ctx[it.key()] = it.value();
    ctx["messages"] = template_messages(req.messages);
    if (!req.tools.tools.empty()) ctx["tools"] = req.tools.tools;  // as transformers passes them
    ctx["add_generation_prompt"] = req.add_generation_prompt;
    ctx["bos_token"] = tokenizer_->bos_token();
    ctx["eos_token"] = tokenizer_->eos_token();
    std::string text;
    try {
      text = template_->render(ctx);
    } catch (const TemplateError& e) {
      throw ApiError(400, std::string("chat template error: ") + e.what(), "messages");
    }
    if (req.continue_final_message && !req.messages.empty()) {
      // Cut everything the template appended after the final message's content.
      const auto& last = req.messages.back();
      std::string content = last.value("content", "");
      auto pos = content.empty() ? std::string::npos : text.rfind(content);
      if (pos == std::string::npos)
        throw ApiError(400, "continue_final_message: the final message's content is not in the rendered prompt",
                       "continue_final_message");
      text.resize(pos + content.size());
    }
    return text;
  }

 private:
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  int64_t max_model_len_;
  std::string default_policy_;
  std::unique_ptr<ChatTemplate> template_;
  std::string template_error_;
};

}  // namespace

void ServingBackend::submit_all(std::vector<Submission> batch) {
  std::vector<std::string> ids;
  for (const Submission& s : batch) ids.push_back(s.request.request_id);
  size_t queued = 0;
  try {
    for (; queued < batch.size(); ++queued) submit(std::move(batch[queued].request), std::move(batch[queued].on_event));
  } catch (...) {
    for (size_t i = 0; i < queued; ++i) cancel(ids[i]);
    throw;
  }
}

std::shared_ptr<const StructuredGrammar> ServingBackend::compile_grammar(const StructuredOutputSpec& spec) {
  throw GrammarError(spec.field, "structured outputs are not supported by this backend");
}

std::shared_ptr<ServingBackend> make_engine_backend(std::unique_ptr<Engine> engine,
                                                    std::shared_ptr<const Tokenizer> tokenizer,
                                                    int64_t max_model_len, std::string default_policy) {
  return std::make_shared<EngineBackend>(std::move(engine), std::move(tokenizer), max_model_len,
                                         std::move(default_policy));
}

}  // namespace kvserve::http
