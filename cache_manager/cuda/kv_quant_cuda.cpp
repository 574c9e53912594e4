#include "cache_manager/kv_quant_cuda.h"

#include <cmath>
#include <vector>

#include "cache_manager/kernel_dtype.h"
#include "cache_manager/paged_attention_cuda.h"
#include "common/check.h"

#ifdef KVSERVE_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "cache_manager/cuda/kv_quant_kernels.cuh"
#include "cache_manager/cuda/kv_quant_launch.h"
#endif

namespace kvserve::cuda {
namespace {

void check_float(const char* what, const torch::Tensor& x) {
  KV_CHECK(is_cuda_kernel_dtype(x.scalar_type()),
           what << ": rows must be float32, bfloat16 or float16, got " << x.scalar_type());
}

#ifndef KVSERVE_HAVE_CUDA_KERNELS
[[noreturn]] void no_kernels(const char* what) {
  KV_FAIL(what << ": kvserve was built without CUDA kernels (configure with KVSERVE_WITH_CUDA=ON and nvcc "
                  "available)");
}
#endif

}  // namespace

torch::Tensor kv_quant_encode(const torch::Tensor& x, KvQuant q, bool rotate) {
  constexpr const char* what = "cuda kv_quant_encode";
  KV_CHECK(x.dim() >= 1, what << ": x must be [..., D], got " << x.sizes());
  check_float(what, x);
  const int64_t D = x.size(-1);
  check_kv_quant_head_dim(q, D, what);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = kv_quant_row_bytes(q, D);
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  no_kernels(what);
#else
  KV_CHECK(x.is_cuda(), what << ": x must be on a CUDA device, got " << x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty(shape, x.options().dtype(torch::kUInt8));
  const cudaError_t err = cuda_kernels::launch_kv_quant_encode(
      xc.data_ptr(), quant_kernel_dtype(xc.scalar_type()), D == 0 ? 0 : xc.numel() / D, D, quant_format(q), rotate,
      kv_quant_rotation_scale(), out.data_ptr<uint8_t>(), at::cuda::getCurrentCUDAStream(x.device().index()));
  KV_CHECK(err == cudaSuccess, what << ": launch failed: " << cudaGetErrorString(err));
  return out;
#endif
}

torch::Tensor kv_quant_decode(const torch::Tensor& rows, KvQuant q, int64_t head_dim, torch::ScalarType out_dtype,
                              bool rotate) {
  constexpr const char* what = "cuda kv_quant_decode";
  check_kv_quant_head_dim(q, head_dim, what);
  const int64_t rb = kv_quant_row_bytes(q, head_dim);
  KV_CHECK(rows.dim() >= 1 && rows.size(-1) == rb && rows.scalar_type() == torch::kUInt8,
           what << ": rows must be uint8 [..., " << rb << "], got " << rows.scalar_type() << " " << rows.sizes());
  KV_CHECK(out_dtype == torch::kFloat32 || out_dtype == torch::kBFloat16 || out_dtype == torch::kFloat16,
           what << ": the output must be float32, bfloat16 or float16, got " << out_dtype);
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = head_dim;
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  no_kernels(what);
#else
  KV_CHECK(rows.is_cuda(), what << ": rows must be on a CUDA device, got " << rows.device());
  const c10::cuda::CUDAGuard guard(rows.device());
  const torch::Tensor rc = rows.contiguous();
  torch::Tensor out = torch::empty(shape, rows.options().dtype(out_dtype));
  const cudaError_t err = cuda_kernels::launch_kv_quant_decode(
      rc.data_ptr<uint8_t>(), rc.numel() / rb, head_dim, quant_format(q), rotate, kv_quant_rotation_scale(), out.data_ptr(),
      quant_kernel_dtype(out_dtype), at::cuda::getCurrentCUDAStream(rows.device().index()));
  KV_CHECK(err == cudaSuccess, what << ": launch failed: " << cudaGetErrorString(err));
  return out;
#endif
}

torch::Tensor kv_quant_rotate(const torch::Tensor& x) {
  constexpr const char* what = "cuda kv_quant_rotate";
  KV_CHECK(x.dim() >= 1 && x.size(-1) % kKvQuantGroup == 0,
           what << ": x must be [..., D] with D a multiple of " << kKvQuantGroup << ", got " << x.sizes());
  check_float(what, x);
#ifndef KVSERVE_HAVE_CUDA_KERNELS
  no_kernels(what);
#else
  KV_CHECK(x.is_cuda(), what << ": x must be on a CUDA device, got " << x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty_like(xc);
  const int64_t D = x.size(-1);
  const cudaError_t err =
      cuda_kernels::launch_kv_rotate(xc.data_ptr(), out.data_ptr(), quant_kernel_dtype(xc.scalar_type()),
                                     D == 0 ? 0 : xc.numel() / D, D, kv_quant_rotation_scale(),
                                     at::cuda::getCurrentCUDAStream(x.device().index()));
  KV_CHECK(err == cudaSuccess, what << ": launch failed: " << cudaGetErrorString(err));
  return out;
#endif
}

}  // namespace kvserve::cuda
