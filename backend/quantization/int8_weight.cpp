#include "backend/quantization/int8_weight.h"

#include <ATen/CPUGeneratorImpl.h>

#include "backend/quantization/gguf_cuda_forms.h"
#include "common/check.h"
#include "common/env_int.h"
#include "ggml.h"

#ifdef KVSERVE_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "backend/cuda/int8_gemv.cuh"
#endif

namespace kvserve {

namespace {

// Products of more rows than this expand the weight and run one GEMM (the kernel reads the codes
// once per 8 rows); KVSERVE_INT8_DENSE_ROWS sets it (0: the kernel for every product).
int64_t dense_rows() {
  static const int64_t rows = env_int("KVSERVE_INT8_DENSE_ROWS", 16);
  return rows;
}

#ifdef KVSERVE_HAVE_CUDA_KERNELS
// y [M, N] = x Wᵀ by kvserve's kernel; x [M, K] on the weight's device.
torch::Tensor kernel_product(const torch::Tensor& x_in, const torch::Tensor& codes, const torch::Tensor& scales,
                             int64_t group) {
  int8_kernels::DType dtype;
  switch (x_in.scalar_type()) {
    case torch::kFloat32: dtype = int8_kernels::DType::kFloat32; break;
    case torch::kBFloat16: dtype = int8_kernels::DType::kBFloat16; break;
    case torch::kFloat16: dtype = int8_kernels::DType::kFloat16; break;
    default: KV_FAIL("int8 weights multiply float32, bfloat16 or float16 activations, got " << x_in.scalar_type());
  }
  auto x = x_in.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();  // a view's offset: the kernel loads 16 bytes
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = torch::empty({x.size(0), codes.size(0)}, x.options());
  const cudaError_t err = int8_kernels::launch_int8_weight_product(
      x.data_ptr(), dtype, x.size(0), x.size(1), codes.data_ptr<int8_t>(), scales.data_ptr<float>(), codes.size(0),
      group, y.data_ptr(), at::cuda::getCurrentCUDAStream(x.device().index()));
  KV_CHECK(err == cudaSuccess, "int8 weight product on " << x.device() << ": " << cudaGetErrorString(err));
  return y;
}
#endif

}  // namespace

bool Int8Weight::fits(int64_t rows, int64_t cols) { return rows > 0 && cols > 0 && cols % 32 == 0; }

int64_t Int8Weight::group_for(int64_t cols) { return cols % 128 == 0 ? 128 : cols % 64 == 0 ? 64 : 32; }

Int8Weight Int8Weight::quantize(const torch::Tensor& w, const std::string& what) {
  KV_CHECK(w.dim() == 2, what << ": an int8 weight must be a matrix, got " << w.sizes());
  KV_CHECK(fits(w.size(0), w.size(1)), what << ": int8 needs columns a multiple of 32 (its smallest scale group), got "
                                            << w.sizes());
  KV_CHECK(w.is_cpu() || w.is_cuda(), what << ": int8 weights live on the CPU or a CUDA device, not " << w.device());
  const int64_t N = w.size(0), K = w.size(1);
  Int8Weight f;
  f.group_ = group_for(K);
  const auto wg = w.to(torch::kFloat32).reshape({N, K / f.group_, f.group_});
  const auto scale = wg.abs().amax({2}) / 127.0f;  // [N, K / group] float32
  // An all-zero group (scale 0) is all code 0.
  const auto div = torch::where(scale > 0, scale, torch::ones_like(scale));
  f.codes_ = (wg / div.unsqueeze(2)).round().clamp_(-127, 127).to(torch::kInt8).reshape({N, K}).contiguous();
  f.scales_ = scale.contiguous();
  return f;
}

Int8Weight Int8Weight::from_q8_0(const QuantizedWeight& q) {
  KV_CHECK(q.single_type() == GGML_TYPE_Q8_0, "internal: an int8 weight from " << q.type_names() << " blocks, not q8_0");
  GgufGroups g = gguf_groups(q, "q8_0");
  return from_codes(std::move(g.codes), std::move(g.scale), g.group, "q8_0");
}

Int8Weight Int8Weight::from_codes(torch::Tensor codes, torch::Tensor scales, int64_t group, const std::string& what,
                                  torch::Tensor offsets) {
  KV_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8, what << ": int8 codes must be an int8 matrix, got "
                                                                         << codes.sizes() << " " << codes.scalar_type());
  const int64_t N = codes.size(0), K = codes.size(1);
  KV_CHECK(group > 0 && group % 16 == 0 && K % group == 0 && K % 32 == 0,
           what << ": int8 scale groups must be a multiple of 16 columns dividing " << K
                << " (itself a multiple of 32), got " << group);
  KV_CHECK(scales.sizes() == torch::IntArrayRef({N, K / group}) && scales.scalar_type() == torch::kFloat32,
           what << ": int8 scales must be float32 [" << N << ", " << K / group << "], got " << scales.sizes() << " "
                << scales.scalar_type());
  KV_CHECK(!offsets.defined() || (offsets.sizes() == scales.sizes() && offsets.scalar_type() == torch::kFloat32),
           what << ": int8 offsets must be float32 " << scales.sizes() << ", got " << offsets.sizes() << " "
                << offsets.scalar_type());
  Int8Weight f;
  f.group_ = group;
  f.codes_ = codes.contiguous();
  f.scales_ = scales.to(codes.device()).contiguous();
  if (offsets.defined()) f.offsets_ = offsets.to(codes.device()).contiguous();
  return f;
}

Int8Weight Int8Weight::regrouped(int64_t group) const {
  KV_CHECK(group > 0 && group % 16 == 0 && group_ % group == 0,
           "internal: int8 scale groups of " << group_ << " columns cannot become groups of " << group);
  if (group == group_) return *this;
  Int8Weight f = *this;
  f.group_ = group;
  f.scales_ = scales_.repeat_interleave(group_ / group, 1).contiguous();
  if (offsets_.defined()) f.offsets_ = offsets_.repeat_interleave(group_ / group, 1).contiguous();
  return f;
}

Int8Weight Int8Weight::to(const torch::Device& device) const {
  Int8Weight f = *this;
  f.codes_ = codes_.to(device);
  f.scales_ = scales_.to(device);
  if (offsets_.defined()) f.offsets_ = offsets_.to(device);
  return f;
}

Int8Weight Int8Weight::stack(const std::vector<Int8Weight>& parts) {
  KV_CHECK(!parts.empty(), "internal: stacking no int8 weights");
  if (parts.size() == 1) return parts.front();
  std::vector<torch::Tensor> cs, ss, os;
  bool affine = false;
  for (const Int8Weight& p : parts) {
    KV_CHECK(p.cols() == parts.front().cols() && p.group_ == parts.front().group_,
             "internal: stacking int8 weights of " << p.cols() << " columns in groups of " << p.group_ << " and "
                                                   << parts.front().cols() << " in groups of " << parts.front().group_);
    cs.push_back(p.codes_);
    ss.push_back(p.scales_);
    affine = affine || p.offsets_.defined();
  }
  Int8Weight f;
  f.group_ = parts.front().group_;
  f.codes_ = torch::cat(cs);
  f.scales_ = torch::cat(ss);
  if (affine) {  // a symmetric part's offsets are zero
    for (const Int8Weight& p : parts) os.push_back(p.offsets_.defined() ? p.offsets_ : torch::zeros_like(p.scales_));
    f.offsets_ = torch::cat(os);
  }
  return f;
}

namespace {
// codes [n, K] times their scales [n, K / group], plus the offsets where there are any, in fp32 (fp64
// when asked for: exact) and then `dtype`.
torch::Tensor expand(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& offsets,
                     int64_t group, torch::Dtype dtype) {
  const int64_t n = codes.size(0), K = codes.size(1);
  const auto work = dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  auto v = codes.to(work).view({n, K / group, group}) * scales.to(work).unsqueeze(2);
  if (offsets.defined()) v = v + offsets.to(work).unsqueeze(2);
  return v.view({n, K}).to(dtype);
}
}  // namespace

torch::Tensor Int8Weight::dequantize(torch::Dtype dtype) const { return expand(codes_, scales_, offsets_, group_, dtype); }

torch::Tensor Int8Weight::dequantize_rows(const torch::Tensor& ids, torch::Dtype dtype) const {
  return expand(codes_.index_select(0, ids), scales_.index_select(0, ids),
                offsets_.defined() ? offsets_.index_select(0, ids) : torch::Tensor(), group_, dtype);
}

torch::Tensor Int8Weight::matmul(const torch::Tensor& x, const torch::Tensor& b) const {
  const int64_t K = cols();
  KV_CHECK(x.size(-1) == K, "internal: int8 product of x " << x.sizes() << " with a weight of " << K << " columns");
  auto out_shape = x.sizes().vec();
  out_shape.back() = rows();
  const auto x2 = x.reshape({-1, K});
  torch::Tensor y;
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  const int64_t most = dense_rows();
  if (x.is_cuda() && x2.size(0) > 0 && (most <= 0 || x2.size(0) <= most)) {
    y = kernel_product(x2, codes_, scales_, group_);
    // An affine weight: each output gains sum over groups of (x's sum over the group) x offset, one
    // small GEMM in fp32 (K / group columns).
    if (offsets_.defined()) {
      const auto sums = x2.to(torch::kFloat32).view({x2.size(0), K / group_, group_}).sum(2);
      y = y.to(torch::kFloat32).add_(torch::matmul(sums, offsets_.t())).to(x2.scalar_type());
    }
  }
#endif
  // Prefill (and the CPU's reference): one GEMM over the expanded weight in x's dtype.
  if (!y.defined()) {
    const auto dtype = x.is_cuda() ? x.scalar_type() : torch::kFloat32;
    y = torch::matmul(x2.to(dtype), dequantize(dtype).t());
  }
  if (b.defined()) y = y.to(torch::kFloat32).add_(b.to(torch::kFloat32));
  return y.to(x.scalar_type()).view(out_shape);
}

namespace {

// How far products of `M` rows land outside what `dtype` allows against fp64 over the stored codes
// (<= 0 when inside): the output's rounding, and, where the weight is expanded to `dtype` for a GEMM,
// each weight's rounding, bounded together by a unit of `dtype` times sum |x| |w|.
// An affine weight (offsets per group, as a GGUF's Q5_K becomes) is probed with `affine`.
double probe_excess(const torch::Device& device, int64_t M, torch::Dtype dtype, bool affine) {
  // A generator of its own: the probe leaves the global random state alone.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const int64_t N = 72, K = 384;  // N not a multiple of the kernel's 8 rows a block; K of 128 but not of 512
  const auto w = torch::randn({N, K}, gen).to(device);
  const auto x = torch::randn({M, K}, gen).to(dtype).to(device);
  Int8Weight f = Int8Weight::quantize(w, "int8 probe");
  if (affine) {
    f = Int8Weight::from_codes(f.codes(), f.scales(), f.group(), "int8 probe",
                               torch::randn(f.scales().sizes(), gen).to(device));
  }
  const auto y = f.matmul(x).to(torch::kFloat64).cpu();
  const auto x64 = x.to(torch::kFloat64).cpu(), w64 = f.dequantize(torch::kFloat64).cpu();
  const auto ref = torch::matmul(x64, w64.t());
  const double unit = dtype == torch::kBFloat16 ? 1.0 / 128 : dtype == torch::kFloat16 ? 1.0 / 1024 : 1e-5;
  const auto bound = (ref.abs() + torch::matmul(x64.abs(), w64.abs().t())) * unit + 1e-3;
  return ((y - ref).abs() - bound).max().item<double>();
}

}  // namespace

void Int8Weight::check_device(const torch::Device& device) {
  for (const torch::Dtype dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32}) {
    for (const int64_t M : {int64_t{1}, int64_t{3}, int64_t{11}, dense_rows() + 1}) {
      if (M <= 0) continue;
      for (const bool affine : {false, true}) {
        const double over = probe_excess(device, M, dtype, affine);
        KV_CHECK(over <= 0, "int8 weights on " << device << ": a product of " << M << " " << dtype << " rows"
                                               << (affine ? " with offsets" : "") << " is off by " << over
                                               << " beyond fp32 sums (a kernel mismatch)");
      }
    }
  }
}

}  // namespace kvserve
