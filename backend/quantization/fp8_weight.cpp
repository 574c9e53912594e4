#include "backend/quantization/fp8_weight.h"

#include "common/check.h"

#ifdef KVSERVE_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "backend/cuda/fp8_quant.cuh"
#endif

namespace kvserve {

namespace {
constexpr double kE4m3Max = 448.0;

#ifdef KVSERVE_HAVE_CUDA_KERNELS
// The fused kernel (backend/cuda/fp8_quant.cuh) for a CUDA matrix whose rows are contiguous; false
// leaves the torch chain to it.
bool quantize_rows_fused(const torch::Tensor& x, torch::Tensor& q, torch::Tensor& scale) {
  if (!x.is_cuda() || x.dim() != 2 || x.stride(1) != 1 || x.size(0) == 0 || x.size(1) == 0) return false;
  fp8_kernels::DType dtype;
  switch (x.scalar_type()) {
    case torch::kFloat32: dtype = fp8_kernels::DType::kFloat32; break;
    case torch::kBFloat16: dtype = fp8_kernels::DType::kBFloat16; break;
    case torch::kFloat16: dtype = fp8_kernels::DType::kFloat16; break;
    default: return false;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  q = torch::empty(x.sizes(), x.options().dtype(torch::kFloat8_e4m3fn));
  scale = torch::empty({x.size(0), 1}, x.options().dtype(torch::kFloat32));
  const cudaError_t err = fp8_kernels::launch_fp8_quantize_rows(x.data_ptr(), x.stride(0), dtype, x.size(0), x.size(1),
                                                                q.data_ptr(), scale.data_ptr<float>(),
                                                                at::cuda::getCurrentCUDAStream(x.device().index()));
  KV_CHECK(err == cudaSuccess, "fp8 activation quantization on " << x.device() << ": " << cudaGetErrorString(err));
  return true;
}
#endif
}  // namespace

torch::Tensor fp8_quantize_rows(const torch::Tensor& x, torch::Tensor& scale) {
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  if (torch::Tensor q; quantize_rows_fused(x, q, scale)) return q;
#endif
  const auto xf = x.to(torch::kFloat32);
  const auto amax = xf.abs().amax({1}, /*keepdim=*/true);
  // A zero row would divide by zero; any scale gives it zeros.
  scale = torch::where(amax > 0, amax / kE4m3Max, torch::ones_like(amax));
  return (xf / scale).clamp(-kE4m3Max, kE4m3Max).to(torch::kFloat8_e4m3fn);
}

bool Fp8Weight::fits(int64_t rows, int64_t cols) { return rows > 0 && cols > 0 && rows % 16 == 0 && cols % 16 == 0; }

Fp8Weight Fp8Weight::quantize(const torch::Tensor& w, const std::string& what) {
  KV_CHECK(w.dim() == 2, what << ": an fp8 weight must be a matrix, got " << w.sizes());
  KV_CHECK(fits(w.size(0), w.size(1)), what << ": fp8 needs both dimensions to be multiples of 16 (at::_scaled_mm), got "
                                            << w.sizes());
  Fp8Weight f;
  torch::Tensor s;
  f.w_ = fp8_quantize_rows(w, s).contiguous();
  f.scale_ = s.t().contiguous();  // [1, N]: _scaled_mm's row-wise scale of its second operand
  return f;
}

Fp8Weight Fp8Weight::stack(const std::vector<Fp8Weight>& parts) {
  KV_CHECK(!parts.empty(), "internal: stacking no fp8 weights");
  if (parts.size() == 1) return parts.front();
  std::vector<torch::Tensor> ws, ss;
  for (const Fp8Weight& p : parts) {
    KV_CHECK(p.cols() == parts.front().cols(), "internal: stacking fp8 weights of " << p.cols() << " and "
                                                                                   << parts.front().cols() << " columns");
    ws.push_back(p.w_);
    ss.push_back(p.scale_);
  }
  Fp8Weight f;
  f.w_ = torch::cat(ws);
  f.scale_ = torch::cat(ss, 1);
  return f;
}

torch::Tensor Fp8Weight::dequantize(torch::Dtype dtype) const {
  return (w_.to(torch::kFloat32) * scale_.t()).to(dtype);
}

torch::Tensor Fp8Weight::dequantize_rows(const torch::Tensor& ids, torch::Dtype dtype) const {
  return (w_.index_select(0, ids).to(torch::kFloat32) * scale_.t().index_select(0, ids)).to(dtype);
}

torch::Tensor Fp8Weight::matmul(const torch::Tensor& x, const torch::Tensor& b) const {
  const int64_t K = cols();
  KV_CHECK(x.size(-1) == K, "internal: fp8 product of x " << x.sizes() << " with a weight of " << K << " columns");
  auto out_shape = x.sizes().vec();
  out_shape.back() = rows();
  const auto x2 = x.reshape({-1, K});
  torch::Tensor sx;
  const auto xq = fp8_quantize_rows(x2, sx);
  // Row-wise scales: CUDA's kernel writes bfloat16 only; libtorch's CPU one float32 as well.
  const auto out = x.is_cuda() ? torch::kBFloat16 : torch::kFloat32;
  auto y = at::_scaled_mm(xq, w_.t(), sx, scale_, /*bias=*/std::nullopt, /*scale_result=*/std::nullopt, out);
  if (b.defined()) y = y.to(torch::kFloat32).add_(b.to(torch::kFloat32));
  return y.to(x.scalar_type()).view(out_shape);
}

}  // namespace kvserve
