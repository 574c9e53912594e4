// The HTTP transport + OpenAI routes end to end over real sockets, against a scripted backend (no
// model): status codes, JSON and SSE shapes, keep-alive, limits, auth, disconnect -> cancel.
#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <set>
#include <thread>

#include "common/check.h"
#include "http/openai_service.h"
#include "http/server.h"

using namespace kvserve;
using namespace kvserve::http;
using nlohmann::json;
namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;

namespace {

// A fake engine: one worker thread emits one token per tick ("a", "b", "c", ...).
class ScriptedBackend : public ServingBackend {
 public:
  explicit ScriptedBackend(int tick_ms = 1, size_t max_queue = 64) : tick_ms_(tick_ms), max_queue_(max_queue) {
    worker_ = std::thread([this] { run(); });
  }
  ~ScriptedBackend() override { shutdown(false); }

  void submit(GenerationRequest r, EventCallback cb) override {
    if (r.kv_policy != "full" && r.kv_policy != "pyramidkv") KV_FAIL("unknown kv_policy '" << r.kv_policy << "'");
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw EngineOverloaded("shutting down");
    if (active_.size() >= max_queue_) throw EngineOverloaded("too many requests waiting");
    active_.push_back({std::move(r), std::move(cb), 0, false});
    ++submitted_;
    cv_.notify_all();
  }
  void cancel(const std::string& id) override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_.insert(id);
    for (auto& a : active_)
      if (a.req.request_id == id) a.cancel = true;
  }
  EngineStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    EngineStats s;
    s.running = static_cast<int64_t>(active_.size());
    s.kv_blocks_total = 100;
    s.kv_blocks_used = static_cast<int64_t>(active_.size());
    return s;
  }
  bool healthy() const override { return true; }
  bool has_policy(const std::string& n) const override { return n == "full" || n == "pyramidkv"; }
  std::vector<std::string> policy_names() const override { return {"full", "pyramidkv"}; }
  std::string default_policy() const override { return "full"; }
  std::vector<int64_t> encode(const std::string& text, bool add_special) const override {
    std::vector<int64_t> ids;
    if (add_special) ids.push_back(1);
    for (unsigned char c : text) ids.push_back(c + 3);
    return ids;
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string s;
    for (auto id : ids)
      if (id >= 3) s += static_cast<char>(id - 3);
    return s;
  }
  std::vector<std::string> token_strings(const std::vector<int64_t>& ids) const override {
    std::vector<std::string> out;
    for (auto id : ids) out.push_back("<" + std::to_string(id) + ">");
    return out;
  }
  std::string render_chat(const ParsedRequest& req) const override {
    std::string out;
    for (const auto& m : req.messages) {
      if (m["content"] == "RAISE") throw ApiError(400, "chat template error: roles must alternate", "messages");
      out += "<" + m["role"].get<std::string>() + ">" + m["content"].get<std::string>();
    }
    return out + (req.add_generation_prompt ? "<assistant>" : "");
  }
  int64_t max_model_len() const override { return 256; }
  int64_t vocab_size() const override { return 300; }
  void shutdown(bool) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
      cv_.notify_all();
    }
    worker_.join();
  }

  std::set<std::string> cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }
  size_t active() const {
    std::lock_guard<std::mutex> lock(mu_);
    return active_.size();
  }
  int submitted() const {
    std::lock_guard<std::mutex> lock(mu_);
    return submitted_;
  }
  void pause(bool p) {
    std::lock_guard<std::mutex> lock(mu_);
    paused_ = p;
    cv_.notify_all();
  }

 private:
  struct Active {
    GenerationRequest req;
    EventCallback cb;
    int64_t produced;
    bool cancel;
  };
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait_for(lock, std::chrono::milliseconds(tick_ms_));
      if (stopping_) {
        for (auto& a : active_) {
          GenerationEvent ev;
          ev.finished = true;
          ev.finish_reason = "abort";
          a.cb(ev);
        }
        active_.clear();
        return;
      }
      if (paused_) continue;
      for (auto it = active_.begin(); it != active_.end();) {
        GenerationEvent ev;
        ev.prompt_tokens = static_cast<int64_t>(it->req.prompt_ids.size());
        if (it->cancel) {
          ev.finished = true;
          ev.finish_reason = "abort";
        } else {
          const char c = static_cast<char>('a' + it->produced % 26);
          ev.token_ids = {c + 3};
          ev.text_delta = std::string(1, c);
          ++it->produced;
          if (it->req.sampling.logprobs >= 0) {
            ev.chosen.push_back({c + 3, ev.text_delta, -0.5});
            std::vector<TokenLogprob> top;
            for (int64_t k = 0; k < it->req.sampling.logprobs; ++k)
              top.push_back({k + 3, std::string(1, static_cast<char>('A' + k)), -1.0 - static_cast<double>(k)});
            ev.top_logprobs.push_back(top);
          }
          ev.completion_tokens = it->produced;
          if (it->produced >= it->req.sampling.max_tokens) {
            ev.finished = true;
            ev.finish_reason = "length";
            ev.kept_kv_tokens = it->req.kv_policy == "pyramidkv" ? 4 : ev.prompt_tokens;
            ev.full_kv_tokens = ev.prompt_tokens;
          }
        }
        it->cb(ev);
        if (ev.finished) it = active_.erase(it);
        else ++it;
      }
    }
  }

  int tick_ms_;
  size_t max_queue_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Active> active_;
  std::set<std::string> cancelled_;
  bool stopping_ = false;
  bool paused_ = false;
  int submitted_ = 0;
  std::thread worker_;
};

struct Reply {
  int status = 0;
  std::map<std::string, std::string> headers;
  std::string body;
  json j() const { return json::parse(body); }
};

Reply request(int port, const std::string& method, const std::string& target, const std::string& body = "",
              std::map<std::string, std::string> headers = {}) {
  asio::io_context ioc;
  beast::tcp_stream stream(ioc);
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  bhttp::request<bhttp::string_body> req{bhttp::string_to_verb(method), target, 11};
  req.set(bhttp::field::host, "127.0.0.1");
  for (auto& [k, v] : headers) req.set(k, v);
  if (!body.empty() || method == "POST") {
    req.set(bhttp::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
  }
  bhttp::write(stream, req);
  beast::flat_buffer buf;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(64 << 20);
  beast::error_code ec;
  bhttp::read(stream, buf, parser, ec);
  Reply r;
  if (ec) {
    r.status = -1;
    r.body = ec.message();
    return r;
  }
  auto res = parser.release();
  r.status = static_cast<int>(res.result_int());
  for (auto& f : res) r.headers[std::string(f.name_string())] = std::string(f.value());
  r.body = res.body();
  return r;
}

// SSE body -> the JSON payloads (and whether it ended with [DONE]).
std::vector<json> sse_events(const std::string& body, bool* done) {
  std::vector<json> out;
  *done = false;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    size_t end = body.find("\n\n", pos);
    std::string payload = body.substr(pos + 6, end - pos - 6);
    if (payload == "[DONE]") *done = true;
    else out.push_back(json::parse(payload));
    pos = end;
  }
  return out;
}

class ServerTest : public ::testing::Test {
 protected:
  void start(ServiceOptions so = {}, ServerOptions opt = {}, std::shared_ptr<ScriptedBackend> backend = nullptr,
             bool install = true) {
    so.model_name = "tiny";
    so.log_requests = false;
    opt.host = "127.0.0.1";
    opt.port = 0;
    opt.log_requests = false;
    service_ = std::make_shared<OpenAIService>(so);
    backend_ = backend ? backend : std::make_shared<ScriptedBackend>();
    if (install) service_->set_backend(backend_);
    server_ = std::make_unique<HttpServer>(opt, service_);
    server_->start();
    port_ = server_->port();
  }
  void TearDown() override {
    if (server_) server_->stop();
  }
  std::shared_ptr<OpenAIService> service_;
  std::shared_ptr<ScriptedBackend> backend_;
  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
};

}  // namespace

TEST_F(ServerTest, HealthIs503UntilTheModelIsInstalled) {
  start({}, {}, nullptr, /*install=*/false);
  auto r = request(port_, "GET", "/health");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.j()["error"]["type"], "service_unavailable");
  EXPECT_EQ(request(port_, "POST", "/v1/completions", R"({"prompt":"x"})").status, 503);
  service_->set_backend(backend_);
  EXPECT_EQ(request(port_, "GET", "/health").status, 200);
  EXPECT_EQ(request(port_, "GET", "/version").j()["version"], kvserve_version());
}

TEST_F(ServerTest, ModelsListsTheServedModel) {
  start();
  auto r = request(port_, "GET", "/v1/models");
  ASSERT_EQ(r.status, 200);
  EXPECT_EQ(r.j()["data"][0]["id"], "tiny");
  EXPECT_EQ(r.j()["data"][0]["kv_policies"].size(), 2u);
  EXPECT_EQ(request(port_, "GET", "/v1/models/tiny").status, 200);
  EXPECT_EQ(request(port_, "GET", "/v1/models/other").status, 404);
}

TEST_F(ServerTest, CompletionJson) {
  start();
  auto r = request(port_, "POST", "/v1/completions", R"({"model":"tiny","prompt":"hello","max_tokens":5})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = r.j();
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "abcde");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 6);  // BOS + 5 bytes
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);
  EXPECT_EQ(j["usage"]["total_tokens"], 11);
  EXPECT_EQ(j["usage"]["kv_policy"], "full");
  EXPECT_EQ(r.headers["X-KV-Policy"], "full");
}

TEST_F(ServerTest, CompletionStreamWithUsage) {
  start();
  auto r = request(port_, "POST", "/v1/completions",
                   R"({"prompt":"hi","max_tokens":3,"stream":true,"stream_options":{"include_usage":true},"kv_policy":"pyramidkv"})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.headers["Content-Type"].find("text/event-stream"), std::string::npos);
  EXPECT_EQ(r.headers["X-KV-Policy"], "pyramidkv");
  bool done = false;
  auto ev = sse_events(r.body, &done);
  EXPECT_TRUE(done);
  std::string text;
  std::string finish;
  for (auto& e : ev) {
    for (auto& c : e["choices"]) {
      text += c["text"].get<std::string>();
      if (!c["finish_reason"].is_null()) finish = c["finish_reason"];
    }
  }
  EXPECT_EQ(text, "abc");
  EXPECT_EQ(finish, "length");
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back()["choices"].size(), 0u);
  EXPECT_EQ(ev.back()["usage"]["completion_tokens"], 3);
  EXPECT_EQ(ev.back()["usage"]["kv_policy"], "pyramidkv");
}

TEST_F(ServerTest, ChatStreamStartsWithRole) {
  start();
  auto r = request(port_, "POST", "/v1/chat/completions",
                   R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true})");
  ASSERT_EQ(r.status, 200);
  bool done = false;
  auto ev = sse_events(r.body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (auto& e : ev)
    for (auto& c : e["choices"])
      if (c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
  EXPECT_EQ(text, "ab");
}

TEST_F(ServerTest, ChatJsonWithNAndLogprobs) {
  start();
  auto r = request(port_, "POST", "/v1/chat/completions",
                   R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"n":2,"logprobs":true,"top_logprobs":2})");
  ASSERT_EQ(r.status, 200) << r.body;
  auto j = r.j();
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "ab");
  auto& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "a");
  EXPECT_EQ(content[0]["logprob"], -0.5);
  EXPECT_EQ(content[0]["bytes"], json::array({97}));
  EXPECT_EQ(content[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(j["usage"]["completion_tokens"], 4);
  EXPECT_EQ(j["usage"]["prompt_tokens"], std::string("<user>hi<assistant>").size());
}

TEST_F(ServerTest, CompletionLogprobsFormat) {
  start();
  auto r = request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":3,"logprobs":1})");
  ASSERT_EQ(r.status, 200);
  auto lp = r.j()["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], json::array({"a", "b", "c"}));
  EXPECT_EQ(lp["token_logprobs"].size(), 3u);
  EXPECT_EQ(lp["text_offset"], json::array({0, 1, 2}));
  EXPECT_EQ(lp["top_logprobs"][0]["A"], -1.0);
}

TEST_F(ServerTest, ErrorStatusesAreOpenAIShaped) {
  ServiceOptions so;
  start(so);
  auto check = [&](const Reply& r, int status, const std::string& param) {
    EXPECT_EQ(r.status, status) << r.body;
    auto j = r.j();
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_TRUE(j["error"].contains("message"));
    EXPECT_TRUE(j["error"].contains("type"));
    EXPECT_TRUE(j["error"].contains("code"));
    if (!param.empty()) {
      EXPECT_EQ(j["error"]["param"], param) << r.body;
    }
  };
  check(request(port_, "POST", "/v1/completions", "{not json"), 400, "");
  check(request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":"3"})"), 400, "max_tokens");
  check(request(port_, "POST", "/v1/completions", R"({"prompt":"x","kv_policy":"nope"})"), 400, "kv_policy");
  check(request(port_, "POST", "/v1/completions", R"({"prompt":"x","model":"gpt-4"})"), 404, "model");
  check(request(port_, "POST", "/v1/completions", R"({"prompt":[1,2,999]})"), 400, "prompt");
  check(request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1000})"), 400, "max_tokens");
  check(request(port_, "POST", "/v1/chat/completions", R"({"messages":[{"role":"user","content":"RAISE"}]})"), 400, "messages");
  check(request(port_, "GET", "/v1/nothing"), 404, "");
  auto m = request(port_, "GET", "/v1/completions");
  check(m, 405, "");
  EXPECT_EQ(m.headers["Allow"], "POST");
  // The server still serves after all that.
  EXPECT_EQ(request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})").status, 200);
}

TEST_F(ServerTest, ApiKey) {
  ServiceOptions so;
  so.api_key = "sekret";
  start(so);
  auto r = request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})");
  EXPECT_EQ(r.status, 401);
  EXPECT_EQ(r.j()["error"]["code"], "invalid_api_key");
  EXPECT_EQ(request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})", {{"Authorization", "Bearer wrong"}}).status, 401);
  EXPECT_EQ(request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})", {{"Authorization", "Bearer sekret"}}).status, 200);
  EXPECT_EQ(request(port_, "GET", "/v1/models").status, 401);
  EXPECT_EQ(request(port_, "GET", "/health").status, 200);  // health and metrics stay open
}

TEST_F(ServerTest, BodyTooLarge) {
  ServerOptions opt;
  opt.max_body_bytes = 1024;
  start({}, opt);
  std::string big = R"({"prompt":")" + std::string(4000, 'x') + R"("})";
  auto r = request(port_, "POST", "/v1/completions", big);
  EXPECT_EQ(r.status, 413) << r.body;
  EXPECT_EQ(request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})").status, 200);
}

TEST_F(ServerTest, OverloadedIs429) {
  start({}, {}, std::make_shared<ScriptedBackend>(1, 1));
  backend_->pause(true);
  std::thread slow([&] { request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})"); });
  for (int i = 0; i < 200 && backend_->active() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto r = request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1})");
  EXPECT_EQ(r.status, 429) << r.body;
  EXPECT_EQ(r.headers["Retry-After"], "1");
  EXPECT_EQ(r.j()["error"]["code"], "engine_overloaded");
  backend_->pause(false);
  slow.join();
}

TEST_F(ServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  start();
  asio::io_context ioc;
  beast::tcp_stream stream(ioc);
  stream.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port_)));
  for (int i = 0; i < 3; ++i) {
    bhttp::request<bhttp::string_body> req{bhttp::verb::post, "/v1/completions", 11};
    req.set(bhttp::field::host, "x");
    req.body() = R"({"prompt":"x","max_tokens":2,"stream":true})";
    req.prepare_payload();
    bhttp::write(stream, req);
    beast::flat_buffer buf;
    bhttp::response<bhttp::string_body> res;
    bhttp::read(stream, buf, res);
    EXPECT_EQ(res.result_int(), 200u);
    EXPECT_TRUE(res.keep_alive());
    EXPECT_NE(res.body().find("[DONE]"), std::string::npos);
  }
}

TEST_F(ServerTest, ClientDisconnectCancels) {
  start({}, {}, std::make_shared<ScriptedBackend>(5));
  {
    asio::io_context ioc;
    tcp::socket sock(ioc);
    sock.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port_)));
    std::string body = R"({"prompt":"x","max_tokens":200,"stream":true})";
    std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                      std::to_string(body.size()) + "\r\n\r\n" + body;
    asio::write(sock, asio::buffer(req));
    char buf[256];
    sock.read_some(asio::buffer(buf));  // the stream has started
    sock.close();
  }
  for (int i = 0; i < 400 && backend_->active() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(backend_->active(), 0u);
  EXPECT_EQ(backend_->cancelled().size(), 1u);
  // Non-streaming requests are cancelled too.
  {
    asio::io_context ioc;
    tcp::socket sock(ioc);
    sock.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port_)));
    std::string body = R"({"prompt":"x","max_tokens":200})";
    std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) +
                      "\r\n\r\n" + body;
    asio::write(sock, asio::buffer(req));
    for (int i = 0; i < 400 && backend_->active() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    sock.close();
  }
  for (int i = 0; i < 400 && backend_->active() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(backend_->active(), 0u);
  EXPECT_EQ(backend_->cancelled().size(), 2u);
}

TEST_F(ServerTest, MetricsAfterTraffic) {
  start();
  request(port_, "POST", "/v1/completions", R"({"prompt":"hello","max_tokens":2,"kv_policy":"pyramidkv"})");
  auto r = request(port_, "GET", "/metrics");
  ASSERT_EQ(r.status, 200);
  EXPECT_NE(r.body.find("kvserve:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1"), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("kvserve:kv_kept_tokens_total{model_name=\"tiny\",policy=\"pyramidkv\"} 4"), std::string::npos);
  EXPECT_NE(r.body.find("kvserve:time_to_first_token_seconds_count{model_name=\"tiny\"} 1"), std::string::npos);
  // Queue time comes from the engine (EngineOptions::on_queue_time), which the scripted backend
  // lacks; the HTTP layer must not fill it with time to first token.
  EXPECT_NE(r.body.find("kvserve:request_queue_time_seconds_count{model_name=\"tiny\"} 0"), std::string::npos);
  EXPECT_NE(r.body.find("kvserve:kv_cache_blocks_used{model_name=\"tiny\"} 0"), std::string::npos);
}

TEST_F(ServerTest, ManyConcurrentStreams) {
  start();
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int i = 0; i < 32; ++i) {
    clients.emplace_back([&] {
      auto r = request(port_, "POST", "/v1/completions",
                       R"({"prompt":"x","max_tokens":8,"stream":true,"stream_options":{"include_usage":true}})");
      bool done = false;
      auto ev = sse_events(r.body, &done);
      if (r.status == 200 && done && !ev.empty() && ev.back()["usage"]["completion_tokens"] == 8) ++ok;
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), 32);
}

TEST_F(ServerTest, ShutdownRefusesNewWork) {
  start();
  service_->begin_shutdown();
  auto r = request(port_, "POST", "/v1/completions", R"({"prompt":"x"})");
  EXPECT_EQ(r.status, 503);
  EXPECT_EQ(r.headers["Retry-After"], "1");
  EXPECT_EQ(request(port_, "GET", "/health").status, 503);
}

TEST_F(ServerTest, PolicyResolverPicksThePolicyUnlessTheRequestNamesOne) {
  ServiceOptions so;
  so.policy_resolver = [](const HttpRequest& http, const ParsedRequest&) {
    return http.header("x-tenant") == "beta" ? std::string("pyramidkv") : std::string();
  };
  start(so);
  const std::string body = R"({"prompt":"x","max_tokens":1})";
  EXPECT_EQ(request(port_, "POST", "/v1/completions", body, {{"X-Tenant", "beta"}}).headers["X-KV-Policy"], "pyramidkv");
  EXPECT_EQ(request(port_, "POST", "/v1/completions", body).headers["X-KV-Policy"], "full");
  EXPECT_EQ(request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":1,"kv_policy":"full"})",
                    {{"X-Tenant", "beta"}}).headers["X-KV-Policy"], "full");
}

TEST_F(ServerTest, OverCapacityConnectionGets503WithRetryAfter) {
  ServerOptions opt;
  opt.max_concurrent_connections = 2;
  opt.retry_after_s = 7;
  start({}, opt);
  asio::io_context ioc;
  std::vector<tcp::socket> held;
  for (int i = 0; i < 2; ++i) {
    held.emplace_back(ioc);
    held.back().connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port_)));
  }
  for (int i = 0; i < 200 && server_->open_connections() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto r = request(port_, "GET", "/health");
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_EQ(r.headers["Retry-After"], "7");
  EXPECT_NE(r.body.find("too many open connections (2)"), std::string::npos) << r.body;
  held.clear();
  for (int i = 0; i < 400 && server_->open_connections() > 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(request(port_, "GET", "/health").status, 200);
  EXPECT_NE(request(port_, "GET", "/metrics").body.find("reason=\"over_capacity\"} 1"), std::string::npos);
}

// A client trickling its headers is closed header_timeout_s after its first byte, while a silent
// keep-alive connection is governed by the (longer) idle timeout.
TEST_F(ServerTest, HeaderTimeoutClosesSlowlorisButNotAnIdleConnection) {
  ServerOptions opt;
  opt.header_timeout_s = 0.3;
  opt.idle_timeout_s = 10;
  start({}, opt);
  asio::io_context ioc;
  tcp::socket idle(ioc), slow(ioc);
  const tcp::endpoint ep(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port_));
  idle.connect(ep);
  slow.connect(ep);
  const std::string head = "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ";
  const auto t0 = std::chrono::steady_clock::now();
  boost::system::error_code ec;
  double cut = -1;
  for (int i = 0; i < 200 && cut < 0; ++i) {
    asio::write(slow, asio::buffer(i < static_cast<int>(head.size()) ? head.substr(i, 1) : std::string("a")), ec);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    slow.non_blocking(true);
    char c;
    slow.read_some(asio::buffer(&c, 1), ec);
    slow.non_blocking(false);
    if (ec && ec != asio::error::would_block) cut = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  EXPECT_GE(cut, 0.25);
  EXPECT_LT(cut, 2.0);
  // The idle connection outlived the header timeout and still serves a request.
  const std::string req = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
  asio::write(idle, asio::buffer(req));
  char buf[64] = {};
  idle.read_some(asio::buffer(buf, sizeof buf - 1));
  EXPECT_EQ(std::string(buf).rfind("HTTP/1.1 200", 0), 0u) << buf;
  EXPECT_NE(request(port_, "GET", "/metrics").body.find("reason=\"header_timeout\"} 1"), std::string::npos);
}

namespace {

// Sends raw bytes on a fresh connection and returns everything the server answers until it closes.
std::string raw_exchange(int port, const std::string& bytes) {
  asio::io_context ioc;
  tcp::socket sock(ioc);
  sock.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
  boost::system::error_code ec;
  asio::write(sock, asio::buffer(bytes), ec);
  std::string out;
  char buf[4096];
  for (;;) {
    size_t n = sock.read_some(asio::buffer(buf), ec);
    if (ec) break;
    out.append(buf, n);
  }
  return out;
}

}  // namespace

TEST_F(ServerTest, GarbageRequestLineAndHugeHeadersGet400AndAClose) {
  start();
  std::string r = raw_exchange(port_, "\x01\x02 nonsense \xff\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r;
  EXPECT_NE(r.find("malformed HTTP request"), std::string::npos) << r;
  EXPECT_NE(r.find("Connection: close"), std::string::npos);
  r = raw_exchange(port_, "GET /health HTTP/1.1\r\nX-Big: " + std::string(100 * 1024, 'a') + "\r\n\r\n");
  EXPECT_EQ(r.rfind("HTTP/1.1 400", 0), 0u) << r.substr(0, 200);
  EXPECT_EQ(request(port_, "GET", "/health").status, 200);
}

// A request still running at request_timeout_s: 408 before any byte of the answer, and the engine
// request is cancelled.
TEST_F(ServerTest, RequestTimeoutAnswers408AndCancels) {
  ServerOptions opt;
  opt.request_timeout_s = 0.3;
  start({}, opt, std::make_shared<ScriptedBackend>(1));
  backend_->pause(true);
  auto r = request(port_, "POST", "/v1/completions", R"({"prompt":"x","max_tokens":5})");
  EXPECT_EQ(r.status, 408) << r.body;
  EXPECT_NE(r.body.find("request timeout"), std::string::npos) << r.body;
  for (int i = 0; i < 400 && backend_->cancelled().empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(backend_->cancelled().size(), 1u);
  backend_->pause(false);
  EXPECT_NE(request(port_, "GET", "/metrics").body.find("reason=\"request_timeout\"} 1"), std::string::npos);
}

// A body that stops arriving: closed idle_timeout_s after the headers, counted as body_timeout.
TEST_F(ServerTest, SlowBodyIsClosedAtTheIdleTimeout) {
  ServerOptions opt;
  opt.idle_timeout_s = 0.4;
  start({}, opt);
  const auto t0 = std::chrono::steady_clock::now();
  std::string r = raw_exchange(port_, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro");
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r, "");  // closed without an answer
  EXPECT_GE(took, 0.35);
  EXPECT_LT(took, 3.0);
  EXPECT_EQ(backend_->submitted(), 0);
  EXPECT_NE(request(port_, "GET", "/metrics").body.find("reason=\"body_timeout\"} 1"), std::string::npos);
}
