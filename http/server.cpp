// Boost.Beast/Asio transport for the OpenAI service.
#include "http/server.h"

#include "http/cors.h"

#include <sys/socket.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <deque>
#include <iostream>
#include <list>
#include <mutex>
#include <optional>

namespace kvserve::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

std::chrono::steady_clock::duration seconds(double s) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

std::string reason_phrase(int status) {
  auto r = bhttp::obsolete_reason(bhttp::int_to_status(static_cast<unsigned>(status)));
  return r.empty() ? std::string("Unknown") : std::string(r);
}

std::string serialize_head(int status, const std::string& content_type, const HeaderList& headers, bool keep_alive,
                           std::optional<size_t> content_length) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) + "\r\n";
  out += "Server: kvserve\r\n";
  if (!content_type.empty()) out += "Content-Type: " + content_type + "\r\n";
  for (const auto& [k, v] : headers) {
    // Header values must not carry CR/LF (they come from request headers at most).
    std::string clean;
    for (char c : v)
      if (c != '\r' && c != '\n') clean += c;
    out += k + ": " + clean + "\r\n";
  }
  if (content_length) out += "Content-Length: " + std::to_string(*content_length) + "\r\n";
  else out += "Transfer-Encoding: chunked\r\n";
  out += keep_alive ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
  out += "\r\n";
  return out;
}

bool has_header(const HeaderList& headers, const std::string& name) {
  return std::any_of(headers.begin(), headers.end(), [&](const auto& h) { return beast::iequals(h.first, name); });
}

std::string chunk(const std::string& data) {
  char size[32];
  std::snprintf(size, sizeof size, "%zx\r\n", data.size());
  return size + data + "\r\n";
}

}  // namespace

class Session;

struct HttpServer::Impl : std::enable_shared_from_this<HttpServer::Impl> {
  ServerOptions options;
  std::shared_ptr<OpenAIService> service;
  asio::io_context ioc;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  tcp::acceptor acceptor{ioc};
  std::vector<std::thread> threads;
  std::atomic<int64_t> connections{0};
  std::atomic<bool> accepting{false};
  std::atomic<bool> stopping{false};
  std::mutex sessions_mu;
  std::list<std::weak_ptr<Session>> sessions;
  // After a failed accept (EMFILE when a flood exhausts the descriptors) the pending connection
  // stays in the backlog, so accepting again at once would spin: wait a little first.
  std::optional<asio::steady_timer> accept_retry;

  void do_accept();
  void count(const char* reason) { service->metrics().connection_closed(reason); }
};

// The per-exchange handle given to the service; it outlives nothing it must not.
class Channel : public ResponseChannel, public std::enable_shared_from_this<Channel> {
 public:
  Channel(std::weak_ptr<Session> session, uint64_t generation) : session_(std::move(session)), gen_(generation) {}
  void respond(HttpResponse response) override;
  void begin_stream(int status, HeaderList headers) override;
  void stream(std::string data) override;
  void end_stream() override;
  void on_abort(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (ended_) return;
    if (aborted_) {
      lock.unlock();
      fn();
      return;
    }
    abort_fn_ = std::move(fn);
  }
  // The client left or the request timed out.
  void fire_abort() {
    std::function<void()> fn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_ || ended_) return;
      aborted_ = true;
      fn = std::move(abort_fn_);
    }
    if (fn) fn();
  }
  void mark_ended() {
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
    abort_fn_ = nullptr;
  }

 private:
  template <typename F>
  void post(F&& f);
  std::weak_ptr<Session> session_;
  uint64_t gen_;
  std::mutex mu_;
  std::function<void()> abort_fn_;
  bool aborted_ = false;
  bool ended_ = false;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket&& socket, std::shared_ptr<HttpServer::Impl> server)
      : stream_(std::move(socket)), server_(std::move(server)), request_timer_(stream_.get_executor()),
        linger_timer_(stream_.get_executor()) {
    beast::error_code ec;
    auto ep = stream_.socket().remote_endpoint(ec);
    if (!ec) remote_ = ep.address().to_string() + ":" + std::to_string(ep.port());
    ++server_->connections;
  }
  ~Session() { --server_->connections; }

  void start(bool over_capacity) {
    if (over_capacity) {
      // Answer without reading the request: the client learns to back off, and lingering (not a
      // reset) lets it read the answer even though its request bytes are never consumed.
      server_->count("over_capacity");
      HttpResponse r = error_response(ApiError(503, "too many open connections (" +
                                                        std::to_string(server_->options.max_concurrent_connections) +
                                                        "); retry later"));
      r.headers.push_back({"Retry-After", std::to_string(server_->options.retry_after_s)});
      begin_local_exchange("-");
      keep_alive_ = false;
      linger_ = true;
      linger_s_ = 1;
      respond_impl(gen_, std::move(r));
      return;
    }
    do_read();
  }

  // Called on the strand by Channel.
  void respond_impl(uint64_t gen, HttpResponse r) {
    if (gen != gen_ || !in_exchange_ || head_sent_ || closed_) return;
    head_sent_ = true;
    exchange_done_ = true;
    status_ = r.status;
    enqueue(serialize_head(r.status, r.content_type, exchange_headers(std::move(r.headers)), keep_alive_, r.body.size()) + r.body);
  }
  void begin_stream_impl(uint64_t gen, int status, const HeaderList& headers) {
    if (gen != gen_ || !in_exchange_ || head_sent_ || closed_) return;
    head_sent_ = true;
    status_ = status;
    enqueue(serialize_head(status, "text/event-stream; charset=utf-8", exchange_headers(headers), keep_alive_, std::nullopt));
  }
  // Every response carries X-Request-Id (the service's, else the client's, else a new one) and, for
  // an allowed browser origin, the CORS headers.
  HeaderList exchange_headers(HeaderList h) const {
    if (!has_header(h, "X-Request-Id")) h.push_back({"X-Request-Id", request_id_});
    for (auto& c : cors_.response_headers(origin_))
      if (!has_header(h, c.first)) h.push_back(std::move(c));
    return h;
  }
  void stream_impl(uint64_t gen, const std::string& data) {
    if (gen != gen_ || !in_exchange_ || !head_sent_ || exchange_done_ || closed_ || data.empty()) return;
    enqueue(chunk(data));
  }
  void end_stream_impl(uint64_t gen) {
    if (gen != gen_ || !in_exchange_ || !head_sent_ || exchange_done_ || closed_) return;
    exchange_done_ = true;
    enqueue("0\r\n\r\n");
  }

  // A response already complete is written out first (its last write closes the connection, the
  // server being stopped); anything else is closed now, which aborts its request.
  void close_from_server() {
    asio::post(stream_.get_executor(), [self = shared_from_this()] {
      if (self->in_exchange_ && self->exchange_done_ && (self->writing_ || !self->pending_.empty())) return;
      self->do_close();
    });
  }

  beast::tcp_stream& stream() { return stream_; }

 private:
  // Three read phases with their own deadlines: waiting for a request (idle_timeout_s), its request
  // line and headers once the first byte came (header_timeout_s: a slowloris client trickling bytes
  // cannot hold the connection longer), and its body (idle_timeout_s in all).
  enum class Phase { kIdle, kHeader, kBody };

  void do_read() {
    if (closed_) return;
    if (server_->stopping) return do_close();
    parser_.emplace();
    parser_->body_limit(static_cast<uint64_t>(server_->options.max_body_bytes));
    parser_->header_limit(64 * 1024);
    if (buffer_.size() > 0) return read_header();  // a pipelined request is already here
    phase_ = Phase::kIdle;
    stream_.expires_after(seconds(server_->options.idle_timeout_s));
    stream_.async_read_some(buffer_.prepare(4096), [self = shared_from_this()](beast::error_code ec, size_t n) {
      if (ec) return self->on_read_error(ec);
      self->buffer_.commit(n);
      self->read_header();
    });
  }

  void read_header() {
    phase_ = Phase::kHeader;
    stream_.expires_after(seconds(server_->options.header_timeout_s));
    bhttp::async_read_header(stream_, buffer_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return on_read_error(ec);
    auto& req = parser_->get();
    if (auto cl = parser_->content_length(); cl && *cl > static_cast<uint64_t>(server_->options.max_body_bytes))
      return on_read_error(bhttp::error::body_limit);
    auto expect = req[bhttp::field::expect];
    if (beast::iequals(expect, "100-continue")) {
      auto msg = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
      asio::async_write(stream_, asio::buffer(*msg), [self = shared_from_this(), msg](beast::error_code ec2, size_t) {
        if (ec2) return self->do_close();
        self->read_body();
      });
      return;
    }
    read_body();
  }

  void read_body() {
    phase_ = Phase::kBody;
    stream_.expires_after(seconds(server_->options.idle_timeout_s));
    bhttp::async_read(stream_, buffer_, *parser_,
                      [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

  void on_read_error(beast::error_code ec) {
    if (ec == bhttp::error::body_limit) {
      // Answer 413, then drain what the client still sends so it can read the answer.
      begin_local_exchange("-");
      keep_alive_ = false;
      linger_ = true;
      respond_impl(gen_, error_response(ApiError(413, "the request body exceeds the limit of " +
                                                          std::to_string(server_->options.max_body_bytes) + " bytes")));
      return;
    }
    // Beast closes the socket when a deadline passes, so a timed-out read ends without an answer
    // (as nginx's client_header_timeout does); the counter tells operators it happened.
    if (ec == beast::error::timeout)
      server_->count(phase_ == Phase::kIdle ? "idle_timeout" : phase_ == Phase::kHeader ? "header_timeout" : "body_timeout");
    if (ec == bhttp::error::end_of_stream || ec == beast::error::timeout || ec == asio::error::operation_aborted ||
        ec == asio::error::connection_reset || ec == asio::error::eof) {
      return do_close();
    }
    // A malformed request line or header. Linger as after a 413: unread request bytes would turn
    // the close into a reset that can destroy the answer before the client reads it.
    begin_local_exchange("-");
    keep_alive_ = false;
    linger_ = true;
    linger_s_ = 1;
    respond_impl(gen_, error_response(ApiError(400, "malformed HTTP request: " + ec.message())));
  }

  void begin_local_exchange(const std::string& what) {
    ++gen_;
    request_id_ = random_hex(32);
    origin_.clear();
    in_exchange_ = true;
    head_sent_ = false;
    exchange_done_ = false;
    method_target_ = what;
    t_start_ = Clock::now();
    stream_.expires_never();
  }

  void on_read(beast::error_code ec) {
    if (ec) return on_read_error(ec);
    auto msg = parser_->release();
    HttpRequest req;
    req.method = std::string(msg.method_string());
    req.target = std::string(msg.target());
    for (const auto& f : msg) {
      std::string name(f.name_string());
      for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      req.headers[name] = std::string(f.value());
    }
    req.body = std::move(msg.body());
    req.remote = remote_;
    keep_alive_ = msg.keep_alive() && !server_->stopping;
    begin_local_exchange(req.method + " " + req.target);
    if (!req.header("x-request-id").empty()) request_id_ = req.header("x-request-id");
    origin_ = req.header("origin");
    channel_ = std::make_shared<Channel>(weak_from_this(), gen_);
    if (cors_.is_preflight(req)) {
      // Answered here: a preflight carries no credentials and never reaches the API.
      respond_impl(gen_, cors_.preflight(req));
      return;
    }
    arm_request_timer();
    watch_disconnect();
    auto channel = channel_;
    server_->service->handle(std::move(req), channel);
  }

  void arm_request_timer() {
    request_timer_.expires_after(seconds(server_->options.request_timeout_s));
    request_timer_.async_wait([self = shared_from_this(), gen = gen_](beast::error_code ec) {
      if (ec || gen != self->gen_ || !self->in_exchange_ || self->closed_) return;
      if (self->exchange_done_) return;
      if (self->channel_) self->channel_->fire_abort();
      self->server_->count("request_timeout");
      if (!self->head_sent_) {
        self->keep_alive_ = false;
        self->respond_impl(gen, error_response(ApiError(408, "the request took longer than the server's request timeout")));
      } else {
        self->do_close();
      }
    });
  }

  // Notices a client that closes its connection while its request is still being worked on.
  void watch_disconnect() {
    stream_.socket().async_wait(tcp::socket::wait_read, [self = shared_from_this(), gen = gen_](beast::error_code ec) {
      if (ec || gen != self->gen_ || !self->in_exchange_ || self->exchange_done_ || self->closed_) return;
      char c;
      ssize_t n = ::recv(self->stream_.socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        self->do_close();  // aborts the exchange
      }
      // n > 0: the client sent more (a pipelined request); it is read after this response.
    });
  }

  void enqueue(std::string data) {
    pending_ += data;
    do_write();
  }

  void do_write() {
    if (writing_ || pending_.empty() || closed_) return;
    writing_ = true;
    inflight_ = std::move(pending_);
    pending_.clear();
    // A client that stops reading fills the socket buffers and stalls this write; closing it at the
    // deadline aborts its request, which frees its KV blocks.
    stream_.expires_after(seconds(server_->options.write_timeout_s));
    asio::async_write(stream_, asio::buffer(inflight_), [self = shared_from_this()](beast::error_code ec, size_t) {
      self->on_write(ec);
    });
  }

  void on_write(beast::error_code ec) {
    writing_ = false;
    if (ec == beast::error::timeout) server_->count("write_timeout");
    if (ec) return do_close();
    stream_.expires_never();
    if (!pending_.empty()) return do_write();
    if (exchange_done_ && in_exchange_) finish_exchange();
  }

  void finish_exchange() {
    in_exchange_ = false;
    request_timer_.cancel();
    if (channel_) channel_->mark_ended();
    channel_.reset();
    if (server_->options.log_requests) {
      double dt = std::chrono::duration<double>(Clock::now() - t_start_).count();
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.3fs", dt);
      std::cerr << "kvserve: " << remote_ << " \"" << method_target_ << "\" " << status_ << " " << buf << "\n";
    }
    if (linger_) return linger_close();
    if (!keep_alive_ || server_->stopping) return do_close();
    do_read();
  }

  // Half-close, then discard input for a while so that the client sees our response, not a reset.
  void linger_close() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    linger_timer_.expires_after(std::chrono::seconds(linger_s_));
    linger_timer_.async_wait([self = shared_from_this()](beast::error_code e) {
      if (!e) self->do_close();
    });
    linger_read();
  }
  void linger_read() {
    discard_.resize(64 * 1024);
    stream_.expires_never();
    stream_.socket().async_read_some(asio::buffer(discard_), [self = shared_from_this()](beast::error_code ec, size_t n) {
      self->lingered_ += n;
      if (ec || self->lingered_ > (size_t{256} << 20)) return self->do_close();
      self->linger_read();
    });
  }

  void do_close() {
    if (closed_) return;
    closed_ = true;
    if (channel_) channel_->fire_abort();
    request_timer_.cancel();
    linger_timer_.cancel();
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.socket().close(ec);
    if (in_exchange_ && server_->options.log_requests && method_target_ != "-") {
      double dt = std::chrono::duration<double>(Clock::now() - t_start_).count();
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.3fs", dt);
      std::cerr << "kvserve: " << remote_ << " \"" << method_target_ << "\" " << (head_sent_ ? status_ : 499)
                << " " << buf << " (connection closed)\n";
    }
    in_exchange_ = false;
    channel_.reset();
  }

  beast::tcp_stream stream_;
  std::shared_ptr<HttpServer::Impl> server_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  asio::steady_timer request_timer_;
  asio::steady_timer linger_timer_;
  std::string remote_ = "?";
  std::shared_ptr<Channel> channel_;
  uint64_t gen_ = 0;
  bool keep_alive_ = true;
  bool in_exchange_ = false;
  bool head_sent_ = false;
  bool exchange_done_ = false;
  bool closed_ = false;
  bool writing_ = false;
  bool linger_ = false;
  int linger_s_ = 5;
  size_t lingered_ = 0;
  Phase phase_ = Phase::kIdle;
  std::string pending_, inflight_, discard_;
  int status_ = 0;
  std::string method_target_;
  Clock::time_point t_start_;
  CorsPolicy cors_{server_->options.allowed_origins};
  std::string request_id_, origin_;  // of the current exchange
};

template <typename F>
void Channel::post(F&& f) {
  auto s = session_.lock();
  if (!s) return;
  asio::post(s->stream().get_executor(), [s, f = std::forward<F>(f)]() mutable { f(*s); });
}

void Channel::respond(HttpResponse response) {
  mark_ended();
  post([gen = gen_, r = std::move(response)](Session& s) mutable { s.respond_impl(gen, std::move(r)); });
}
void Channel::begin_stream(int status, HeaderList headers) {
  post([gen = gen_, status, h = std::move(headers)](Session& s) { s.begin_stream_impl(gen, status, h); });
}
void Channel::stream(std::string data) {
  post([gen = gen_, d = std::move(data)](Session& s) { s.stream_impl(gen, d); });
}
void Channel::end_stream() {
  mark_ended();
  post([gen = gen_](Session& s) { s.end_stream_impl(gen); });
}

void HttpServer::Impl::do_accept() {
  acceptor.async_accept(asio::make_strand(ioc), [self = shared_from_this()](beast::error_code ec, tcp::socket socket) {
    if (!self->accepting) return;
    if (!ec) {
      const bool over = self->connections.load() >= self->options.max_concurrent_connections;
      auto session = std::make_shared<Session>(std::move(socket), self);
      {
        std::lock_guard<std::mutex> lock(self->sessions_mu);
        self->sessions.remove_if([](const std::weak_ptr<Session>& w) { return w.expired(); });
        self->sessions.push_back(session);
      }
      asio::dispatch(session->stream().get_executor(), [session, over] { session->start(over); });
    } else if (ec != asio::error::operation_aborted) {
      self->count("accept_error");
      if (!self->accept_retry) self->accept_retry.emplace(self->ioc);
      self->accept_retry->expires_after(std::chrono::milliseconds(50));
      self->accept_retry->async_wait([self](beast::error_code) {
        if (self->accepting) self->do_accept();
      });
      return;
    }
    self->do_accept();
  });
}

HttpServer::HttpServer(ServerOptions options, std::shared_ptr<OpenAIService> service)
    : options_(std::move(options)), service_(std::move(service)), impl_(std::make_shared<Impl>()) {
  impl_->options = options_;
  impl_->service = service_;
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::start() {
  beast::error_code ec;
  auto address = asio::ip::make_address(options_.host, ec);
  if (ec) throw std::runtime_error("invalid listen address '" + options_.host + "': " + ec.message());
  tcp::endpoint ep(address, static_cast<unsigned short>(options_.port));
  const std::string where = options_.host + ":" + std::to_string(options_.port);
  impl_->acceptor.open(ep.protocol(), ec);
  if (!ec) impl_->acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor.bind(ep, ec);
  if (ec) throw std::runtime_error("cannot listen on " + where + ": " + ec.message());
  impl_->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error("cannot listen on " + where + ": " + ec.message());
  bound_port_ = impl_->acceptor.local_endpoint().port();
  impl_->accepting = true;
  impl_->work.emplace(impl_->ioc.get_executor());
  impl_->do_accept();
  for (int i = 0; i < std::max(1, options_.threads); ++i) impl_->threads.emplace_back([impl = impl_] { impl->ioc.run(); });
}

void HttpServer::stop_accepting() {
  if (!impl_->accepting.exchange(false)) return;
  asio::post(impl_->ioc, [impl = impl_] {
    beast::error_code ec;
    impl->acceptor.close(ec);
  });
}

void HttpServer::stop() {
  if (impl_->threads.empty()) return;
  stop_accepting();
  impl_->stopping = true;
  {
    std::lock_guard<std::mutex> lock(impl_->sessions_mu);
    for (auto& w : impl_->sessions)
      if (auto s = w.lock()) s->close_from_server();
  }
  impl_->work.reset();
  // Give queued closes a moment, then stop the loop.
  auto deadline = Clock::now() + std::chrono::seconds(2);
  while (impl_->connections.load() > 0 && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  impl_->ioc.stop();
  for (auto& t : impl_->threads)
    if (t.joinable()) t.join();
  impl_->threads.clear();
}

int64_t HttpServer::open_connections() const { return impl_->connections.load(); }

}  // namespace kvserve::http
