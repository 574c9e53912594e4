// Chat templates (Jinja). Two ways in, picked by byte 0:
//  - even: the input is a template source (from a checkpoint's tokenizer_config.json); it parses
//    or throws TemplateError, and renders a fixed conversation or throws TemplateError;
//  - odd: the input is a /v1/chat/completions body (what every client controls); when the request
//    parser accepts it, one of the real templates in tests/reference/templates renders its messages
//    and chat_template_kwargs the way http/engine_backend.cpp builds the context.
// Step, output and recursion limits keep every render bounded; anything but TemplateError escaping
// is a bug.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "fuzz/fuzz_common.h"
#include "http/request_parser.h"

namespace {

const std::vector<std::unique_ptr<kvserve::ChatTemplate>>& real_templates() {
  static auto* all = [] {
    auto* v = new std::vector<std::unique_ptr<kvserve::ChatTemplate>>();
    for (const char* name : {"llama3", "llama2", "llama31_tools", "mistral_v03_tools", "qwen25_tools", "deepseek_v3",
                             "gemma", "phi3", "zephyr", "features"})
      v->push_back(std::make_unique<kvserve::ChatTemplate>(
          kvfuzz::read_source_file(std::string("tests/reference/templates/") + name + ".jinja")));
    return v;
  }();
  return *all;
}

nlohmann::ordered_json context(nlohmann::ordered_json messages) {
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = std::move(messages);
  ctx["add_generation_prompt"] = true;
  ctx["bos_token"] = "<s>";
  ctx["eos_token"] = "</s>";
  return ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    kvfuzz::expect_only<kvserve::TemplateError>([&] {
      kvserve::ChatTemplate t(rest);
      auto msgs = nlohmann::ordered_json::parse(
          R"([{"role":"system","content":"Be brief."},{"role":"user","content":"Hi {{ there }}"},)"
          R"({"role":"assistant","content":"Hello."},{"role":"user","content":"Bye"}])");
      (void)t.render(context(std::move(msgs)));
    });
    return 0;
  }
  const auto& all = real_templates();
  const kvserve::ChatTemplate& t = *all[(data[0] >> 1) % all.size()];
  kvserve::http::ParsedRequest req;
  try {
    req = kvserve::http::parse_chat_request(rest);
  } catch (const kvserve::http::ApiError&) {
    return 0;  // answered 400 before any template runs (the request_body target covers this)
  }
  nlohmann::json ctx = nlohmann::json::object();
  for (auto it = req.chat_template_kwargs.begin(); it != req.chat_template_kwargs.end(); ++it) ctx[it.key()] = it.value();
  ctx["messages"] = req.messages;
  ctx["add_generation_prompt"] = req.add_generation_prompt;
  ctx["bos_token"] = "<s>";
  ctx["eos_token"] = "</s>";
  kvfuzz::expect_only<kvserve::TemplateError>([&] { (void)t.render(ctx); });
  return 0;
}
