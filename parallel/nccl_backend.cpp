// The NCCL backend lives in its own translation unit: it needs USE_C10D_NCCL and nccl.h (CMake
// defines KVSERVE_HAVE_NCCL when both are found), and GPU-free builds leave it out.
#include "parallel/c10d_backends.h"

#include "common/check.h"

#ifdef KVSERVE_HAVE_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace kvserve::parallel::detail {

#ifdef KVSERVE_HAVE_NCCL
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                   std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
}
bool nccl_compiled() { return true; }
#else
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                                   std::chrono::milliseconds) {
  KV_FAIL("this kvserve build has no NCCL backend (configure with KVSERVE_WITH_CUDA=ON on a CUDA torch wheel)");
}
bool nccl_compiled() { return false; }
#endif

}  // namespace kvserve::parallel::detail
