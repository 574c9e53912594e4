#pragma once
// Communicator: process groups over torch c10d (Gloo on CPU, NCCL on CUDA) with a TCPStore
// rendezvous; the rest of kvserve sees only ProcessGroup's few operations, never c10d headers.
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/check.h"
#include "parallel/dist_env.h"

namespace kvserve::parallel {

// A collective or point-to-point transfer failed: a peer died, hung past the timeout, or the
// connection broke. The job cannot continue; the message names the operation, group and ranks.
class CommError : public KvError {
 public:
  using KvError::KvError;
};

struct CommOptions {
  std::chrono::milliseconds timeout{20000};  // every collective and the rendezvous
  // Address this rank's Gloo device binds to; empty = 127.0.0.1 when MASTER_ADDR is a loopback
  // address, else the interface named by GLOO_SOCKET_IFNAME or the host's name.
  std::string gloo_host;
};

// One process group: a fixed, ordered set of global ranks. Operations block until done (sends
// are queued and finished by wait_sends) and throw CommError on failure.
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }  // within the group
  int size() const { return static_cast<int>(ranks_.size()); }
  const std::vector<int>& ranks() const { return ranks_; }  // global ranks, group order

  virtual void all_reduce_sum(torch::Tensor& t) = 0;
  // Every member's tensor (same shape) concatenated along dim 0 in group order.
  virtual torch::Tensor all_gather(const torch::Tensor& t) = 0;
  virtual void broadcast(torch::Tensor& t, int root) = 0;  // root: group rank
  virtual void barrier() = 0;
  // Tensors of any shape and dtype; dst/src are group ranks. The shape travels with the data.
  virtual void send_tensor(const torch::Tensor& t, int dst, int tag) = 0;
  virtual torch::Tensor recv_tensor(int src, int tag, const torch::Device& device) = 0;
  virtual void wait_sends() = 0;
  // Collectives (all-reduce, all-gather, broadcast, barrier) this member has run in the group: how
  // chatty a protocol is, measured.
  int64_t collectives() const { return collectives_.load(); }

 protected:
  ProcessGroup(std::string name, int rank, std::vector<int> ranks, bool nccl)
      : name_(std::move(name)), rank_(rank), ranks_(std::move(ranks)), nccl_(nccl) {}
  std::string name_;
  int rank_;
  std::vector<int> ranks_;
  bool nccl_;
  std::atomic<int64_t> collectives_{0};
};

class Communicator {
 public:
  // Rendezvous of the whole job at MASTER_ADDR:MASTER_PORT (rank 0 hosts the TCPStore); the
  // world group is Gloo (control messages travel on the CPU even on GPU jobs).
  static std::shared_ptr<Communicator> connect(const DistEnv& env, const CommOptions& options = {});
  virtual ~Communicator() = default;

  const DistEnv& env() const { return env_; }
  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }
  ProcessGroup& world() { return *world_; }
  // A group of `ranks` (global, ascending); every member calls it with the same name and ranks.
  // backend "gloo" (CPU tensors) or "nccl" (CUDA tensors on this rank's current device).
  virtual std::shared_ptr<ProcessGroup> new_group(const std::string& name, const std::vector<int>& ranks,
                                                  const std::string& backend) = 0;

 protected:
  DistEnv env_;
  std::shared_ptr<ProcessGroup> world_;
};

// True when this build has the NCCL backend compiled in (CUDA builds).
bool nccl_available();

}  // namespace kvserve::parallel
