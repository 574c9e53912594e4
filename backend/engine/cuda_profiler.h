#pragma once
// The CUDA profiler's capture range (cudaProfilerStart/Stop), so that `ncu --profile-from-start off`
// and `nsys --capture-range=cudaProfilerApi` record only the steps a benchmark brackets, not the KV
// fill, the warm-up or a graph capture before them.
#include <c10/core/Device.h>

namespace kvserve {

// Whether this build can open a profiler range (it has the CUDA runtime: a CUDA kernels build).
bool cuda_profiler_supported();
// Waits for `device` to finish its queued work, then opens the range: the kernels recorded are those
// launched from here on, none queued before.
void cuda_profiler_start(const c10::Device& device);
// Waits for `device` to finish what was launched in the range, then closes it.
void cuda_profiler_stop(const c10::Device& device);

}  // namespace kvserve
