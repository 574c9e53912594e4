#include "backend/quantization/int4_weight.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <atomic>

#include "common/check.h"
#include "common/env_int.h"
#include "common/log.h"

#ifdef KVSERVE_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "backend/cuda/int4_dequant.cuh"
#endif

namespace kvserve {

namespace {

// Products of more rows than this expand the weight to bfloat16 and run one GEMM (tinygemm's tiles
// are shaped for a few rows); KVSERVE_INT4_DENSE_ROWS sets it (0: tinygemm for every product).
int64_t dense_rows() {
  static const int64_t rows = env_int("KVSERVE_INT4_DENSE_ROWS", 64);
  return rows;
}

// Cleared when the load-time probe finds the expansion kernel disagreeing with tinygemm.
std::atomic<bool> g_expand_ok{true};

bool can_expand(const torch::Tensor& packed) {
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  return packed.is_cuda() && g_expand_ok.load();
#else
  (void)packed;
  return false;
#endif
}

// k tiles of 16 columns the kernel loads back to back (4, 8 or 16 bytes a lane): the most K allows.
int64_t inner_k_tiles(int64_t cols) { return cols % 128 == 0 ? 8 : cols % 64 == 0 ? 4 : 2; }

// The codes, scales and zeros of w [N, K] (before packing): q int32 [N, K] in [0, 15], scale and
// zero bfloat16 [N, K / group].
struct Codes {
  torch::Tensor q, scale, zero;
};

Codes quantize_codes(const torch::Tensor& w, int64_t group) {
  const int64_t N = w.size(0), K = w.size(1);
  const auto wg = w.to(torch::kFloat32).reshape({N, K / group, group});
  const auto lo = wg.amin({2}), hi = wg.amax({2});
  // Sixteen steps from the group's minimum to its maximum; code 8 stands for the zero.
  const auto scale = ((hi - lo) / 15.0).to(torch::kBFloat16);
  const auto zero = (lo + 8.0 * scale.to(torch::kFloat32)).to(torch::kBFloat16);
  const auto s = scale.to(torch::kFloat32), z = zero.to(torch::kFloat32);
  // A constant group (s = 0) is all code 8: its value is the zero.
  const auto div = torch::where(s > 0, s, torch::ones_like(s));
  const auto q = ((wg - z.unsqueeze(2)) / div.unsqueeze(2)).round().add_(8).clamp_(0, 15).to(torch::kInt32);
  return {q.reshape({N, K}).contiguous(), scale, zero};
}

}  // namespace

bool Int4Weight::fits(int64_t rows, int64_t cols) { return rows > 0 && cols > 0 && rows % 8 == 0 && cols % 32 == 0; }

int64_t Int4Weight::group_for(int64_t cols) { return cols % 128 == 0 ? 128 : cols % 64 == 0 ? 64 : 32; }

Int4Weight Int4Weight::quantize(const torch::Tensor& w, const std::string& what) {
  KV_CHECK(w.dim() == 2, what << ": an int4 weight must be a matrix, got " << w.sizes());
  KV_CHECK(fits(w.size(0), w.size(1)), what << ": int4 needs rows a multiple of 8 and columns a multiple of 32 "
                                            << "(the tinygemm kernel's tiles), got " << w.sizes());
  KV_CHECK(w.is_cpu() || w.is_cuda(), what << ": int4 weights live on the CPU or a CUDA device, not " << w.device());
  KV_CHECK(w.is_cuda() || w.size(0) % 16 == 0, what << ": the CPU's int4 reference kernel needs rows a multiple of 16, got "
                                                   << w.sizes());
  const int64_t group = group_for(w.size(1));
  const Codes c = quantize_codes(w, group);
  return from_codes(c.q, c.scale, c.zero, group, what);
}

Int4Weight Int4Weight::from_codes(const torch::Tensor& q, const torch::Tensor& scale, const torch::Tensor& zero,
                                  int64_t group, const std::string& what) {
  KV_CHECK(q.dim() == 2 && fits(q.size(0), q.size(1)),
           what << ": int4 needs rows a multiple of 8 and columns a multiple of 32 (the tinygemm kernel's tiles), got "
                << q.sizes());
  KV_CHECK(q.is_cuda() || q.size(0) % 16 == 0, what << ": the CPU's int4 reference kernel needs rows a multiple of 16, got "
                                                    << q.sizes());
  KV_CHECK((group == 32 || group == 64 || group == 128) && q.size(1) % group == 0,
           what << ": int4 groups are 32, 64 or 128 columns dividing " << q.size(1) << ", got " << group);
  const std::vector<int64_t> groups{q.size(0), q.size(1) / group};
  KV_CHECK(scale.sizes() == groups && zero.sizes() == groups,
           what << ": int4 scales and zeros must be " << groups << ", got " << scale.sizes() << " and " << zero.sizes());
  Int4Weight f;
  f.rows_ = q.size(0);
  f.cols_ = q.size(1);
  f.group_ = group;
  // Two codes a byte, the even column in the high nibble (the CUDA packing kernel's input order).
  const auto qi = q.to(torch::kInt32);
  const auto hi = qi.slice(1, 0, f.cols_, 2), lo = qi.slice(1, 1, f.cols_, 2);
  const auto bytes = hi.bitwise_left_shift(4).bitwise_or_(lo).to(torch::kUInt8).contiguous();
  // The CPU keeps these bytes (its kernel's packing groups rows, so stacked parts could not be
  // concatenated) and packs them at each product: a reference path.
  f.packed_ = q.is_cuda() ? at::_convert_weight_to_int4pack(bytes, inner_k_tiles(f.cols_)) : bytes;
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(q.device());
  f.scales_zeros_ = torch::stack({scale.to(opts).t(), zero.to(opts).t()}, 2).contiguous();  // [K / group, N, 2]
  return f;
}

Int4Weight Int4Weight::stack(const std::vector<Int4Weight>& parts) {
  KV_CHECK(!parts.empty(), "internal: stacking no int4 weights");
  if (parts.size() == 1) return parts.front();
  std::vector<torch::Tensor> ps, ss;
  Int4Weight f = parts.front();
  f.rows_ = 0;
  for (const Int4Weight& p : parts) {
    KV_CHECK(p.cols_ == f.cols_, "internal: stacking int4 weights of " << p.cols_ << " and " << f.cols_ << " columns");
    ps.push_back(p.packed_);  // both layouts keep whole rows along dimension 0 (CUDA: tiles of 8 rows)
    ss.push_back(p.scales_zeros_);
    f.rows_ += p.rows_;
  }
  f.packed_ = torch::cat(ps);
  f.scales_zeros_ = torch::cat(ss, 1);
  return f;
}

torch::Tensor Int4Weight::expand() const {
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  KV_CHECK(packed_.is_cuda(), "internal: expanding an int4 weight that is not on a CUDA device");
  const c10::cuda::CUDAGuard guard(packed_.device());
  auto out = torch::empty({rows_, cols_}, torch::TensorOptions().dtype(torch::kBFloat16).device(packed_.device()));
  const cudaError_t err = int4_kernels::launch_int4_dequant(
      packed_.data_ptr<int32_t>(), scales_zeros_.data_ptr(), out.data_ptr(), rows_, cols_, group_,
      static_cast<int>(packed_.size(3) * 2), at::cuda::getCurrentCUDAStream(packed_.device().index()));
  KV_CHECK(err == cudaSuccess, "int4 weight expansion on " << packed_.device() << ": " << cudaGetErrorString(err));
  return out;
#else
  KV_FAIL("internal: int4 weight expansion needs kvserve's CUDA kernels");
#endif
}

torch::Tensor Int4Weight::dequantize(torch::Dtype dtype) const {
  if (can_expand(packed_)) return expand().to(dtype);
  const auto eye = torch::eye(cols_, torch::TensorOptions().dtype(torch::kFloat32).device(packed_.device()));
  return matmul(eye).t().to(dtype);
}

torch::Tensor Int4Weight::matmul(const torch::Tensor& x, const torch::Tensor& b) const {
  KV_CHECK(x.size(-1) == cols_, "internal: int4 product of x " << x.sizes() << " with a weight of " << cols_ << " columns");
  auto out_shape = x.sizes().vec();
  out_shape.back() = rows_;
  const auto x2 = x.reshape({-1, cols_});
  torch::Tensor y;
  if (x.is_cuda()) {
    const auto xb = x2.to(torch::kBFloat16).contiguous();
    const int64_t most = dense_rows();
    if (most > 0 && xb.size(0) > most && can_expand(packed_)) {
      y = torch::matmul(xb, expand().t());  // prefill: one bf16 GEMM over the expanded weight
    } else {
      y = at::_weight_int4pack_mm(xb, packed_, group_, scales_zeros_);
    }
  } else {
    const auto xc = x2.contiguous();
    const auto codes = torch::stack({packed_.bitwise_right_shift(4), packed_.bitwise_and(15)}, 2).reshape({rows_, cols_});
    const auto packed = at::_convert_weight_to_int4pack_for_cpu(codes.to(torch::kInt32), inner_k_tiles(cols_));
    y = at::_weight_int4pack_mm_for_cpu(xc, packed, group_, scales_zeros_.to(xc.scalar_type()));
  }
  if (b.defined()) y = y.to(torch::kFloat32).add_(b.to(torch::kFloat32));
  return y.to(x.scalar_type()).view(out_shape);
}

namespace {

// How far a product of `M` rows lands outside what 4-bit rounding allows against the float weight it
// came from (<= 0 when inside): each weight within half a step of its code's value, plus the bfloat16
// roundings of the zero, of the dequantized weight and of the output.
double probe_excess(const torch::Device& device, int64_t M) {
  // A generator of its own: the probe leaves the global random state alone.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const int64_t N = 64, K = 256;
  const auto w = torch::randn({N, K}, gen).to(device);
  const auto x = torch::randn({M, K}, gen).to(torch::kBFloat16).to(torch::kFloat32).to(device);  // exact in bf16
  const Int4Weight f = Int4Weight::quantize(w, "int4 probe");
  const auto y = f.matmul(x).to(torch::kFloat64).cpu();
  const auto ref = torch::matmul(x.to(torch::kFloat64), w.to(torch::kFloat64).t()).cpu();
  const auto sz = f.scales_and_zeros().to(torch::kFloat64).cpu();
  const auto s = sz.select(2, 0), z = sz.select(2, 1);  // [K / group, N]
  const auto per_weight = s / 2 + (z.abs() + 8 * s) * (1.0 / 128);
  const auto xa = x.abs().to(torch::kFloat64).cpu().reshape({M, K / f.group(), f.group()}).sum(2);  // [M, K / group]
  const auto bound = torch::matmul(xa, per_weight) + ref.abs() / 128 + 1e-3;
  return ((y - ref).abs() - bound).max().item<double>();
}

}  // namespace

void Int4Weight::check_device(const torch::Device& device) {
  const double over = probe_excess(device, 4);
  KV_CHECK(over <= 0, "int4 weights on " << device << ": the tinygemm product is off by " << over
                                         << " beyond what 4-bit rounding allows (a kernel or layout mismatch)");
  if (!device.is_cuda() || !g_expand_ok.load() || dense_rows() <= 0) return;
  // Many-row products expand the weight with kvserve's own kernel: if it disagrees, keep tinygemm.
  const double dense_over = probe_excess(device, dense_rows() + 1);
  if (dense_over > 0) {
    g_expand_ok = false;
    KV_LOG("int4 weights on " << device << ": the bf16 expansion for many-row products is off by " << dense_over
                              << "; every product stays on tinygemm (slower prefill)");
  }
}

}  // namespace kvserve
