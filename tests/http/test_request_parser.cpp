// Request parsing/validation apart from the transport: every bad body is a 400 naming the field.
#include <gtest/gtest.h>

#include "http/request_parser.h"

using namespace kvserve::http;

namespace {

ApiError expect_error(const std::string& body, bool chat) {
  try {
    if (chat) parse_chat_request(body);
    else parse_completion_request(body);
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted: " << body;
  return ApiError(0, "");
}

}  // namespace

TEST(RequestParser, CompletionDefaultsAndFields) {
  auto r = parse_completion_request(R"({"model":"m","prompt":"hi","max_tokens":5,"temperature":0,
    "top_p":0.9,"top_k":40,"min_p":0.05,"seed":7,"presence_penalty":0.5,"frequency_penalty":-0.5,
    "repetition_penalty":1.1,"stop":["\n","END"],"stop_token_ids":[2],"ignore_eos":true,"min_tokens":2,
    "include_stop_str_in_output":true,"skip_special_tokens":false,"n":2,"logprobs":3,"user":"u1",
    "kv_policy":"pyramidkv","stream":true,"stream_options":{"include_usage":true},"echo":false})");
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].text, "hi");
  EXPECT_EQ(r.sampling.max_tokens, 5);
  EXPECT_EQ(r.max_tokens, 5);
  EXPECT_EQ(r.sampling.temperature, 0.0);
  EXPECT_DOUBLE_EQ(r.sampling.top_p, 0.9);
  EXPECT_EQ(r.sampling.top_k, 40);
  EXPECT_DOUBLE_EQ(r.sampling.min_p, 0.05);
  EXPECT_EQ(r.sampling.seed, 7u);
  EXPECT_DOUBLE_EQ(r.sampling.repetition_penalty, 1.1);
  EXPECT_EQ(r.sampling.stop, (std::vector<std::string>{"\n", "END"}));
  EXPECT_EQ(r.sampling.stop_token_ids, (std::vector<int64_t>{2}));
  EXPECT_TRUE(r.sampling.ignore_eos);
  EXPECT_EQ(r.sampling.min_tokens, 2);
  EXPECT_TRUE(r.sampling.include_stop_str_in_output);
  EXPECT_FALSE(r.sampling.skip_special_tokens);
  EXPECT_EQ(r.n, 2);
  EXPECT_EQ(r.sampling.logprobs, 3);
  EXPECT_EQ(r.user, "u1");
  EXPECT_EQ(r.kv_policy, "pyramidkv");
  EXPECT_FALSE(r.reuse_compressed.has_value());
  EXPECT_FALSE(r.return_token_ids);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);

  auto d = parse_completion_request(R"({"prompt":"x"})");
  EXPECT_EQ(d.sampling.max_tokens, 16);
  EXPECT_FALSE(d.max_tokens.has_value());
  EXPECT_EQ(d.sampling.logprobs, -1);
  EXPECT_EQ(d.n, 1);
  EXPECT_FALSE(d.stream);

  auto c = parse_completion_request(R"({"prompt":"x","prefix_reuse":"compressed","return_token_ids":true})");
  EXPECT_EQ(c.reuse_compressed, true);
  EXPECT_TRUE(c.return_token_ids);
  EXPECT_EQ(parse_completion_request(R"({"prompt":"x","prefix_reuse":"exact"})").reuse_compressed, false);
}

TEST(RequestParser, PromptForms) {
  auto a = parse_completion_request(R"({"prompt":[1,2,3]})");
  ASSERT_EQ(a.prompts.size(), 1u);
  EXPECT_TRUE(a.prompts[0].is_tokens);
  EXPECT_EQ(a.prompts[0].token_ids, (std::vector<int64_t>{1, 2, 3}));
  auto b = parse_completion_request(R"({"prompt":["a","b"]})");
  EXPECT_EQ(b.prompts.size(), 2u);
  auto c = parse_completion_request(R"({"prompt":[[1],[2,3]]})");
  EXPECT_EQ(c.prompts.size(), 2u);
  EXPECT_EQ(c.prompts[1].token_ids.size(), 2u);
  auto s = parse_completion_request(R"({"prompt":"x","stop":"\n"})");
  EXPECT_EQ(s.sampling.stop, (std::vector<std::string>{"\n"}));
}

TEST(RequestParser, Chat) {
  auto r = parse_chat_request(R"({"model":"m","messages":[{"role":"system","content":"be brief"},
    {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
    {"role":"assistant","content":null}],"max_completion_tokens":9,"max_tokens":3,"logprobs":true,
    "top_logprobs":2})");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1]["content"], "a\nb");
  EXPECT_EQ(r.messages[2]["content"], "");
  EXPECT_EQ(r.sampling.max_tokens, 9);
  EXPECT_TRUE(r.want_logprobs);
  EXPECT_EQ(r.sampling.logprobs, 2);
  EXPECT_TRUE(r.add_generation_prompt);
  auto l = parse_chat_request(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true})");
  EXPECT_EQ(l.sampling.logprobs, 0);
}

struct BadBody {
  const char* name;
  bool chat;
  const char* body;
  const char* param;     // expected `param` ("" = none)
  const char* fragment;  // in the message
};

class BadRequestBody : public ::testing::TestWithParam<BadBody> {};

TEST_P(BadRequestBody, Is400NamingTheField) {
  const auto& c = GetParam();
  ApiError e = expect_error(c.body, c.chat);
  EXPECT_EQ(e.status(), 400) << c.name;
  EXPECT_EQ(e.param(), c.param) << c.name << ": " << e.what();
  EXPECT_NE(std::string(e.what()).find(c.fragment), std::string::npos) << c.name << ": " << e.what();
  auto j = e.to_json();
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_TRUE(j["error"].contains("message"));
  EXPECT_TRUE(j["error"].contains("code"));
}

const BadBody kBad[] = {
    {"empty", false, "", "", "empty"},
    {"malformed", false, R"({"prompt": "x",)", "prompt", "invalid JSON"},
    {"not_object", false, "[1,2]", "", "must be a JSON object"},
    {"invalid_utf8", false, "{\"prompt\": \"\xff\xfe\"}", "prompt", "UTF-8"},
    {"lone_surrogate", true, R"({"messages":[{"role":"user","content":"\ud800"}]})", "content", "surrogate"},
    {"number_overflow", false, R"({"prompt":"x","max_tokens":1e400})", "max_tokens", "overflow"},
    {"missing_prompt", false, R"({"model":"m"})", "prompt", "'prompt' is required"},
    {"missing_messages", true, R"({"model":"m"})", "messages", "'messages' is required"},
    {"prompt_type", false, R"({"prompt":5})", "prompt", "must be a string"},
    {"prompt_empty_list", false, R"({"prompt":[]})", "prompt", "must not be empty"},
    {"prompt_bad_token", false, R"({"prompt":[1,"a"]})", "prompt[1]", "integer"},
    {"prompt_neg_token", false, R"({"prompt":[1,-3]})", "prompt[1]", "between"},
    {"max_tokens_string", false, R"({"prompt":"x","max_tokens":"10"})", "max_tokens", "must be an integer, got a string"},
    {"max_tokens_huge", false, R"({"prompt":"x","max_tokens":99999999999999999999999})", "max_tokens", "between"},
    {"max_tokens_zero", false, R"({"prompt":"x","max_tokens":0})", "max_tokens", "between 1"},
    {"max_tokens_frac", false, R"({"prompt":"x","max_tokens":2.5})", "max_tokens", "integer"},
    {"temperature_type", true, R"({"messages":[{"role":"user","content":"x"}],"temperature":"hot"})", "temperature", "a number"},
    {"temperature_range", true, R"({"messages":[{"role":"user","content":"x"}],"temperature":7})", "temperature", "<= 2"},
    {"top_p_zero", false, R"({"prompt":"x","top_p":0})", "top_p", "> 0"},
    {"n_zero", false, R"({"prompt":"x","n":0})", "n", "between 1"},
    {"n_huge", false, R"({"prompt":"x","n":1000})", "n", "between 1"},
    {"stop_type", false, R"({"prompt":"x","stop":5})", "stop", "string or an array"},
    {"stop_item", false, R"({"prompt":"x","stop":["a",1]})", "stop[1]", "a string"},
    {"stop_empty", false, R"({"prompt":"x","stop":""})", "stop", "empty"},
    {"stream_type", false, R"({"prompt":"x","stream":"yes"})", "stream", "boolean"},
    {"stream_options_no_stream", false, R"({"prompt":"x","stream_options":{"include_usage":true}})", "stream_options", "only allowed"},
    {"include_usage_type", false, R"({"prompt":"x","stream":true,"stream_options":{"include_usage":1}})", "stream_options.include_usage", "boolean"},
    {"logprobs_range", false, R"({"prompt":"x","logprobs":50})", "logprobs", "between"},
    {"chat_logprobs_type", true, R"({"messages":[{"role":"user","content":"x"}],"logprobs":3})", "logprobs", "boolean"},
    {"top_logprobs_without", true, R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":3})", "top_logprobs", "requires"},
    {"messages_type", true, R"({"messages":"hi"})", "messages", "an array"},
    {"messages_empty", true, R"({"messages":[]})", "messages", "must not be empty"},
    {"message_not_object", true, R"({"messages":["hi"]})", "messages[0]", "an object"},
    {"message_no_role", true, R"({"messages":[{"content":"x"}]})", "messages[0].role", "required"},
    {"message_bad_role", true, R"({"messages":[{"role":"king","content":"x"}]})", "messages[0].role", "must be one of"},
    {"message_no_content", true, R"({"messages":[{"role":"user"}]})", "messages[0].content", "required"},
    {"message_content_type", true, R"({"messages":[{"role":"user","content":5}]})", "messages[0].content", "a string or an array"},
    {"message_image", true, R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", "messages[0].content[0].type", "not supported"},
    {"kv_policy_type", false, R"({"prompt":"x","kv_policy":3})", "kv_policy", "a string"},
    {"kv_policy_empty", false, R"({"prompt":"x","kv_policy":""})", "kv_policy", "empty"},
    {"prefix_reuse_value", false, R"({"prompt":"x","prefix_reuse":"lossy"})", "prefix_reuse", "\"exact\" or \"compressed\""},
    {"prefix_reuse_type", true, R"({"messages":[{"role":"user","content":"x"}],"prefix_reuse":true})", "prefix_reuse", "a string"},
    {"return_token_ids_type", false, R"({"prompt":"x","return_token_ids":1})", "return_token_ids", "boolean"},
    {"min_gt_max", false, R"({"prompt":"x","max_tokens":2,"min_tokens":5})", "min_tokens", "exceed"},
    {"tools", true, R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})", "tools[0].function", "must be an object"},
    {"response_format", true, R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"xml"}})", "response_format.type", "unsupported"},
    {"seed_type", false, R"({"prompt":"x","seed":"abc"})", "seed", "integer"},
    {"best_of", false, R"({"prompt":"x","best_of":3})", "best_of", "not supported"},
    {"stop_token_ids_type", false, R"({"prompt":"x","stop_token_ids":"2"})", "stop_token_ids", "array"},
    {"user_type", false, R"({"prompt":"x","user":1})", "user", "a string"},
};

INSTANTIATE_TEST_SUITE_P(Table, BadRequestBody, ::testing::ValuesIn(kBad),
                         [](const ::testing::TestParamInfo<BadBody>& info) { return std::string(info.param.name); });
