#include "cli/serve/signal_waiter.h"
#include "common/log.h"

#include <pthread.h>

#include <iostream>

namespace kvserve::cli {

SignalWaiter::SignalWaiter() {
  sigemptyset(&set_);
  sigaddset(&set_, SIGINT);
  sigaddset(&set_, SIGTERM);
  sigaddset(&set_, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &set_, nullptr);
  thread_ = std::thread([this] {
    int sig = 0;
    while (sigwait(&set_, &sig) == 0) {
      if (sig == SIGINT || sig == SIGTERM) break;
      if (sig == SIGHUP) {
        std::function<void()> hup;
        {
          std::lock_guard<std::mutex> lock(mu_);
          hup = on_hup_;
        }
        if (hup) hup();
        else KV_LOG("SIGHUP while loading; ignored");
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      signal_ = sig;
    }
    cv_.notify_all();
    if (on_signal_ && !stopping_) on_signal_(sig);
  });
}

SignalWaiter::~SignalWaiter() {
  if (thread_.joinable()) {
    stopping_ = true;
    if (!received()) pthread_kill(thread_.native_handle(), SIGTERM);
    thread_.join();
  }
}

void SignalWaiter::set_reload(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  on_hup_ = std::move(fn);
}

int SignalWaiter::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return signal_ != 0; });
  return signal_;
}

bool SignalWaiter::received() {
  std::lock_guard<std::mutex> lock(mu_);
  return signal_ != 0;
}

}  // namespace kvserve::cli
