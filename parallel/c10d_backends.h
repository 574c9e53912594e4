#pragma once
// Internal to parallel/: builds c10d backends; only communicator.cpp and nccl_backend.cpp see c10d.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace kvserve::parallel::detail {

// ProcessGroupNCCL over `store` (already prefixed for the group); throws when this build lacks NCCL.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                   std::chrono::milliseconds timeout);
bool nccl_compiled();

}  // namespace kvserve::parallel::detail
