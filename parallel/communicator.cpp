#include "parallel/communicator.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <cstdlib>

#include "parallel/c10d_backends.h"

namespace kvserve::parallel {

bool nccl_available() { return detail::nccl_compiled(); }

namespace {

// Runs a c10d call and its wait; any failure becomes a CommError naming what was attempted.
template <typename F>
void run_op(const std::string& what, const std::string& group, int global_rank, F&& f) {
  try {
    auto work = f();
    if (work) work->wait();
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (auto nl = msg.find("\nException raised from"); nl != std::string::npos) msg.resize(nl);
    throw CommError("rank " + std::to_string(global_rank) + ": " + what + " in process group '" + group +
                    "' failed (a peer rank died, hung or lost its connection): " + msg);
  }
}

constexpr int kMaxDims = 6;

class C10dGroup final : public ProcessGroup {
 public:
  C10dGroup(std::string name, int rank, std::vector<int> ranks, bool nccl, int global_rank,
            c10::intrusive_ptr<c10d::Backend> backend)
      : ProcessGroup(std::move(name), rank, std::move(ranks), nccl), global_rank_(global_rank),
        backend_(std::move(backend)) {}
  ~C10dGroup() override {
    try {
      wait_sends();
    } catch (...) {
    }
  }

  void all_reduce_sum(torch::Tensor& t) override {
    if (size() == 1) return;
    KV_CHECK(t.is_contiguous(), "all_reduce_sum needs a contiguous tensor");
    ++collectives_;
    std::vector<at::Tensor> v{t};
    run_op("all_reduce", name_, global_rank_, [&] { return backend_->allreduce(v); });
  }

  torch::Tensor all_gather(const torch::Tensor& t) override {
    if (size() == 1) return t;
    ++collectives_;
    std::vector<at::Tensor> in{t.contiguous()};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int i = 0; i < size(); ++i) out[0].push_back(torch::empty_like(in[0]));
    run_op("all_gather", name_, global_rank_, [&] { return backend_->allgather(out, in); });
    return torch::cat(out[0], 0);
  }

  void broadcast(torch::Tensor& t, int root) override {
    if (size() == 1) return;
    KV_CHECK(t.is_contiguous(), "broadcast needs a contiguous tensor");
    ++collectives_;
    std::vector<at::Tensor> v{t};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    run_op("broadcast", name_, global_rank_, [&] { return backend_->broadcast(v, o); });
  }

  void barrier() override {
    if (size() == 1) return;
    if (nccl_) {  // NCCL's barrier needs a device; a tiny all-reduce does the same job
      auto t = torch::zeros({1}, torch::TensorOptions().device(torch::kCUDA));
      all_reduce_sum(t);
      return;
    }
    ++collectives_;
    run_op("barrier", name_, global_rank_, [&] { return backend_->barrier(); });
  }

  void send_tensor(const torch::Tensor& t, int dst, int tag) override {
    KV_CHECK(t.dim() <= kMaxDims, "send_tensor: at most " << kMaxDims << " dimensions");
    auto header = torch::zeros({2 + kMaxDims}, torch::kInt64);
    auto h = header.accessor<int64_t, 1>();
    h[0] = t.dim();
    h[1] = static_cast<int64_t>(t.scalar_type());
    for (int64_t i = 0; i < t.dim(); ++i) h[2 + i] = t.size(i);
    if (nccl_) header = header.to(t.device());
    post_send(header, dst, 2 * tag);
    if (t.numel() > 0) post_send(t.contiguous(), dst, 2 * tag + 1);
  }

  torch::Tensor recv_tensor(int src, int tag, const torch::Device& device) override {
    auto header = torch::zeros({2 + kMaxDims}, torch::TensorOptions().dtype(torch::kInt64).device(nccl_ ? device : torch::kCPU));
    recv_into(header, src, 2 * tag);
    header = header.cpu();
    auto h = header.accessor<int64_t, 1>();
    KV_CHECK(h[0] >= 0 && h[0] <= kMaxDims, "recv_tensor: malformed header from rank " << ranks_[src]);
    std::vector<int64_t> shape(h.data() + 2, h.data() + 2 + h[0]);
    auto t = torch::empty(shape, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(h[1])).device(nccl_ ? device : torch::kCPU));
    if (t.numel() > 0) recv_into(t, src, 2 * tag + 1);
    return t.to(device);
  }

  void wait_sends() override {
    auto pending = std::move(sends_);
    sends_.clear();
    for (auto& [work, keep] : pending) {
      run_op("send", name_, global_rank_, [&] { return work; });
    }
  }

 private:
  void post_send(torch::Tensor t, int dst, int tag) {
    std::vector<at::Tensor> v{t};
    c10::intrusive_ptr<c10d::Work> work;
    run_op("send", name_, global_rank_, [&] {
      work = backend_->send(v, dst, tag);
      return c10::intrusive_ptr<c10d::Work>();  // waited in wait_sends
    });
    sends_.emplace_back(work, t);
  }
  void recv_into(torch::Tensor& t, int src, int tag) {
    std::vector<at::Tensor> v{t};
    run_op("recv", name_, global_rank_, [&] { return backend_->recv(v, src, tag); });
  }

  int global_rank_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  std::vector<std::pair<c10::intrusive_ptr<c10d::Work>, torch::Tensor>> sends_;  // keeps buffers alive
};

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

class C10dCommunicator final : public Communicator {
 public:
  C10dCommunicator(const DistEnv& env, const CommOptions& options) : options_(options) {
    validate(env);
    env_ = env;
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(env.master_port);
    so.isServer = env.rank == 0;
    so.numWorkers = env.world_size;
    so.waitWorkers = true;
    so.timeout = options.timeout;
    try {
      store_ = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    } catch (const std::exception& e) {
      std::string msg = e.what();
      if (auto nl = msg.find("\nException raised from"); nl != std::string::npos) msg.resize(nl);
      throw CommError("rank " + std::to_string(env.rank) + ": rendezvous at " + env.master_addr + ":" +
                      std::to_string(env.master_port) + " failed: " + msg);
    }
    std::vector<int> all(static_cast<size_t>(env.world_size));
    for (int i = 0; i < env.world_size; ++i) all[static_cast<size_t>(i)] = i;
    world_ = new_group("world", all, "gloo");
  }

  std::shared_ptr<ProcessGroup> new_group(const std::string& name, const std::vector<int>& ranks,
                                          const std::string& backend) override {
    KV_CHECK(!ranks.empty() && std::is_sorted(ranks.begin(), ranks.end()), "process group '" << name << "': ranks must be ascending");
    auto it = std::find(ranks.begin(), ranks.end(), env_.rank);
    KV_CHECK(it != ranks.end(), "rank " << env_.rank << " creates process group '" << name << "' it is not a member of");
    const int grank = static_cast<int>(it - ranks.begin());
    const int gsize = static_cast<int>(ranks.size());
    auto store = c10::make_intrusive<c10d::PrefixStore>("kvserve/" + name, store_);
    c10::intrusive_ptr<c10d::Backend> b;
    const bool nccl = backend == "nccl";
    KV_CHECK(nccl || backend == "gloo", "unknown process group backend '" << backend << "' (gloo or nccl)");
    try {
      if (nccl) {
        b = detail::make_nccl_backend(store, grank, gsize, options_.timeout);
      } else {
        auto o = c10d::ProcessGroupGloo::Options::create(options_.timeout);
        o->devices.push_back(gloo_device());
        o->threads = 2;
        b = c10::make_intrusive<c10d::ProcessGroupGloo>(store, grank, gsize, o);
      }
    } catch (const KvError&) {
      throw;
    } catch (const std::exception& e) {
      std::string msg = e.what();
      if (auto nl = msg.find("\nException raised from"); nl != std::string::npos) msg.resize(nl);
      throw CommError("rank " + std::to_string(env_.rank) + ": creating process group '" + name + "' failed: " + msg);
    }
    return std::make_shared<C10dGroup>(name, grank, ranks, nccl, env_.rank, b);
  }

 private:
  std::shared_ptr<::gloo::transport::Device> gloo_device() {
    if (!device_) {
      if (!options_.gloo_host.empty()) {
        device_ = c10d::ProcessGroupGloo::createDeviceForHostname(options_.gloo_host);
      } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
        device_ = c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
      } else if (is_loopback(env_.master_addr)) {
        device_ = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
      } else {
        device_ = c10d::ProcessGroupGloo::createDefaultDevice();
      }
    }
    return device_;
  }

  CommOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::shared_ptr<::gloo::transport::Device> device_;
};

}  // namespace

std::shared_ptr<Communicator> Communicator::connect(const DistEnv& env, const CommOptions& options) {
  return std::make_shared<C10dCommunicator>(env, options);
}

}  // namespace kvserve::parallel
