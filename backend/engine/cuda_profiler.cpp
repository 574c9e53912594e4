#include "backend/engine/cuda_profiler.h"

#include "common/check.h"

#ifdef KVSERVE_HAVE_CUDA_PROFILER
#include <c10/cuda/CUDAGuard.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>
#endif

namespace kvserve {

#ifdef KVSERVE_HAVE_CUDA_PROFILER
namespace {

// Synchronizes `device` and then calls `call` (cudaProfilerStart or Stop) with it current.
void sync_then(const c10::Device& device, cudaError_t (*call)(), const char* what) {
  KV_CHECK(device.is_cuda(), what << " needs a CUDA device, not " << device.str());
  const c10::cuda::CUDAGuard guard(device);
  cudaError_t err = cudaDeviceSynchronize();
  KV_CHECK(err == cudaSuccess, what << ": cudaDeviceSynchronize failed: " << cudaGetErrorString(err));
  err = call();
  KV_CHECK(err == cudaSuccess, what << " failed: " << cudaGetErrorString(err));
}

}  // namespace

bool cuda_profiler_supported() { return true; }
void cuda_profiler_start(const c10::Device& device) { sync_then(device, &cudaProfilerStart, "cudaProfilerStart"); }
void cuda_profiler_stop(const c10::Device& device) { sync_then(device, &cudaProfilerStop, "cudaProfilerStop"); }
#else
bool cuda_profiler_supported() { return false; }
void cuda_profiler_start(const c10::Device& device) {
  KV_FAIL("cannot open a CUDA profiler range on " << device.str() << ": this build has no CUDA runtime (no CUDA kernels)");
}
void cuda_profiler_stop(const c10::Device& device) {
  KV_FAIL("cannot close a CUDA profiler range on " << device.str() << ": this build has no CUDA runtime (no CUDA kernels)");
}
#endif

}  // namespace kvserve
