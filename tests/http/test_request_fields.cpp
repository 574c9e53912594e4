// The request-field table: every refused or unknown field is a 400 naming it, no-op values and
// nulls pass, supported fields parse, and docs/api.md shows the table as the code has it.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "http/request_fields.h"

using namespace kvserve::http;
using nlohmann::json;

namespace {

json base(Endpoint e) {
  return e == Endpoint::kChatCompletions ? json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}}
                                         : json{{"prompt", "hi"}};
}

ParsedRequest parse(Endpoint e, const json& body, bool strict = false) {
  ParserLimits limits;
  limits.strict_fields = strict;
  return e == Endpoint::kChatCompletions ? parse_chat_json(body, limits) : parse_completion_json(body, limits);
}

ApiError error_of(Endpoint e, const json& body, bool strict = false) {
  try {
    parse(e, body, strict);
  } catch (const ApiError& err) {
    return err;
  }
  ADD_FAILURE() << "accepted: " << body.dump();
  return ApiError(0, "");
}

}  // namespace

TEST(RequestFields, EveryRefusedOrUnknownFieldIs400NamingIt) {
  int refused = 0;
  for (Endpoint e : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    for (const auto& f : request_fields()) {
      const FieldSupport s = e == Endpoint::kChatCompletions ? f.chat : f.completions;
      if (s == FieldSupport::kSupported) continue;
      json body = base(e);
      body[f.name] = json{{"kvserve_test", true}};  // no field's no-op value
      ApiError err = error_of(e, body);
      EXPECT_EQ(err.status(), 400) << f.name;
      EXPECT_EQ(err.param(), f.name) << err.what();
      EXPECT_NE(std::string(err.what()).find(f.name), std::string::npos) << err.what();
      EXPECT_EQ(err.to_json()["error"]["param"], f.name);
      refused += s == FieldSupport::kRefused;
    }
  }
  EXPECT_GT(refused, 40);
  ApiError unknown = error_of(Endpoint::kCompletions, {{"prompt", "hi"}, {"temprature", 0.5}}, /*strict=*/true);
  EXPECT_EQ(unknown.param(), "temprature");
  EXPECT_NE(std::string(unknown.what()).find("unknown field 'temprature'"), std::string::npos);
}

TEST(RequestFields, UnknownFieldsAreIgnoredAndNamedUnlessStrict) {
  // As vLLM: Hugging Face generation keys are ignored; refused fields and the other endpoint's
  // fields (kvserve knows them, and they mean nothing here) still fail.
  json chat = base(Endpoint::kChatCompletions);
  chat["max_new_tokens"] = 64;
  chat["num_beams"] = 4;
  chat["temperature"] = 0.5;
  const ParsedRequest r = parse(Endpoint::kChatCompletions, chat);
  EXPECT_EQ(r.ignored_fields, (std::vector<std::string>{"max_new_tokens", "num_beams"}));
  EXPECT_DOUBLE_EQ(r.sampling.temperature, 0.5);
  EXPECT_EQ(error_of(Endpoint::kChatCompletions, chat, /*strict=*/true).param(), "max_new_tokens");
  json other = chat;
  other["kv_context"] = "a document";
  EXPECT_EQ(error_of(Endpoint::kChatCompletions, other).param(), "kv_context");
  chat["use_beam_search"] = true;  // known and not honoured: a 400 either way
  EXPECT_EQ(error_of(Endpoint::kChatCompletions, chat).param(), "use_beam_search");
  json completion = base(Endpoint::kCompletions);
  completion["do_sample"] = false;
  EXPECT_EQ(parse(Endpoint::kCompletions, completion).ignored_fields, (std::vector<std::string>{"do_sample"}));
  completion["messages"] = json::array();
  EXPECT_EQ(error_of(Endpoint::kCompletions, completion).param(), "messages");
  EXPECT_TRUE(parse(Endpoint::kCompletions, base(Endpoint::kCompletions)).ignored_fields.empty());
}

TEST(RequestFields, StreamOptions) {
  auto so = [](const json& options) {
    json body = base(Endpoint::kChatCompletions);
    body["stream"] = true;
    body["stream_options"] = options;
    return body;
  };
  ParsedRequest r = parse(Endpoint::kChatCompletions, so({{"include_usage", true}, {"continuous_usage_stats", true}}));
  EXPECT_TRUE(r.include_usage && r.continuous_usage);
  r = parse(Endpoint::kChatCompletions, so({{"continuous_usage_stats", true}}));  // include_usage defaults on (vLLM)
  EXPECT_TRUE(r.include_usage && r.continuous_usage);
  r = parse(Endpoint::kChatCompletions, so({{"include_usage", false}, {"continuous_usage_stats", true}}));
  EXPECT_FALSE(r.include_usage || r.continuous_usage);
  r = parse(Endpoint::kChatCompletions, so(json::object()));
  EXPECT_FALSE(r.include_usage || r.continuous_usage);
  // Unknown keys inside stream_options are a 400 even when unknown top-level fields are ignored.
  ApiError e = error_of(Endpoint::kChatCompletions, so({{"bogus_key", 1}}));
  EXPECT_EQ(e.param(), "stream_options.bogus_key");
  EXPECT_EQ(error_of(Endpoint::kChatCompletions, so({{"continuous_usage_stats", 1}})).param(),
            "stream_options.continuous_usage_stats");
}

TEST(RequestFields, NoOpValuesAndNullsPass) {
  for (Endpoint e : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    for (const auto& f : request_fields()) {
      const FieldSupport s = e == Endpoint::kChatCompletions ? f.chat : f.completions;
      json body = base(e);
      if (std::string(f.name) == "prompt" || std::string(f.name) == "messages") continue;  // required
      body[f.name] = nullptr;
      EXPECT_NO_THROW(parse(e, body)) << f.name;
      if (s != FieldSupport::kRefused || !*f.no_ops) continue;
      for (const auto& v : json::parse(f.no_ops)) {
        body[f.name] = v;
        EXPECT_NO_THROW(parse(e, body)) << f.name << " = " << v.dump();
      }
    }
  }
}

TEST(RequestFields, LogitEditsParse) {
  auto r = parse_completion_request(
      R"({"prompt":"x","logit_bias":{"5":-100,"17":2.5},"allowed_token_ids":[3,5,8],"bad_words":["foo"," bar baz"]})");
  EXPECT_EQ(r.sampling.logit_bias, (std::vector<std::pair<int64_t, double>>{{5, -100.0}, {17, 2.5}}));
  EXPECT_EQ(r.sampling.allowed_token_ids, (std::vector<int64_t>{3, 5, 8}));
  EXPECT_EQ(r.bad_words, (std::vector<std::string>{"foo", " bar baz"}));
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt":"x","logit_bias":{"a":1}})", "logit_bias"},
           {R"({"prompt":"x","logit_bias":{"-1":1}})", "logit_bias"},
           {R"({"prompt":"x","logit_bias":{"3":101}})", "logit_bias"},
           {R"({"prompt":"x","logit_bias":{"3":"1"}})", "logit_bias.3"},
           {R"({"prompt":"x","logit_bias":[1]})", "logit_bias"},
           {R"({"prompt":"x","allowed_token_ids":[]})", "allowed_token_ids"},
           {R"({"prompt":"x","allowed_token_ids":[1,-2]})", "allowed_token_ids[1]"},
           {R"({"prompt":"x","bad_words":"foo"})", "bad_words"},
           {R"({"prompt":"x","bad_words":["ok","  "]})", "bad_words[1]"},
           {R"({"prompt":"x","prompt_logprobs":2,"stream":true})", "prompt_logprobs"},
           {R"({"prompt":"x","prompt_logprobs":-1})", "prompt_logprobs"},
           {R"({"prompt":"x","max_tokens":0})", "max_tokens"},
           {R"({"messages":[{"role":"user","content":"x"}],"max_tokens":0})", "max_tokens"},
       }) {
    ApiError e(0, "");
    try {
      if (body.find("messages") != std::string::npos) parse_chat_request(body);
      else parse_completion_request(body);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const ApiError& err) {
      e = err;
    }
    EXPECT_EQ(e.status(), 400) << body;
    EXPECT_EQ(e.param(), param) << body << ": " << e.what();
  }
}

TEST(RequestFields, EchoAndPromptLogprobs) {
  auto r = parse_completion_request(R"({"prompt":"x","echo":true,"max_tokens":0,"logprobs":2})");
  EXPECT_EQ(r.max_tokens, 0);
  EXPECT_EQ(r.sampling.prompt_logprobs, 2);  // as vLLM: echo with logprobs scores the prompt
  auto p = parse_chat_request(R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":0,"add_special_tokens":true})");
  EXPECT_EQ(p.sampling.prompt_logprobs, 0);
  EXPECT_EQ(p.add_special_tokens, true);
  EXPECT_EQ(parse_completion_request(R"({"prompt":"x"})").sampling.prompt_logprobs, -1);
}

TEST(RequestFields, DocsTableIsCurrent) {
  std::ifstream in(std::string(KVSERVE_SOURCE_DIR) + "/docs/api.md");
  ASSERT_TRUE(in) << "docs/api.md is missing";
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_NE(ss.str().find(request_fields_markdown()), std::string::npos)
      << "docs/api.md does not hold the field table as http/request_fields.cpp has it; paste:\n"
      << request_fields_markdown();
}
