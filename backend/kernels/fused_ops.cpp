#include "backend/kernels/fused_ops.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "backend/kernels/fused_ops_cpu.h"
#include "cache_manager/paged_attention_cuda.h"
#include "common/check.h"

#ifdef KVSERVE_HAVE_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "backend/cuda/fused_ops.cuh"
#endif

namespace kvserve::fused {
namespace {

// The CPU's default level: 1 ran decode 1.03-1.06x faster than the chains and keeps their bits (so
// transformers' logits, bit for bit); 2 was 1.03-1.10x but moves the last fp32 bit (docs/benchmarks.md,
// "Fused elementwise ops on the CPU").
constexpr int kCpuDefault = 1;

// A level 0, 1 or 2 from the environment variable `name`, `fallback` when it is unset; `meaning`
// says what each value selects, for the error.
int level_from_env(const char* name, int fallback, const char* meaning) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  KV_CHECK(std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0 || std::strcmp(v, "2") == 0,
           name << " is '" << v << "': " << meaning);
  return *v - '0';
}

// The vectorized kernels unless set: they passed every CUDA test and ran 1.12-1.14x faster than level 1
// on an H100 (docs/gpu.md, 2026-11-27, commit aad57f2); the torch op chains stay as the A/B baseline.
std::atomic<int>& level_setting() {
  static std::atomic<int> level{
      level_from_env("KVSERVE_FUSED_OPS", 2, "0 (torch op chains), 1 (fused kernels) or 2 (their vectorized variants)")};
  return level;
}

// kCpuDefault unless KVSERVE_FUSED_OPS_CPU says otherwise.
std::atomic<int>& cpu_level_setting() {
  static std::atomic<int> level{level_from_env(
      "KVSERVE_FUSED_OPS_CPU", kCpuDefault,
      "0 (torch op chains), 1 (fused CPU loops with the chains' bits) or 2 (all fused CPU loops)")};
  return level;
}

bool kernel_dtype(torch::ScalarType t) {
  return t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kFloat16;
}

#ifdef KVSERVE_HAVE_CUDA_KERNELS
fused_kernels::DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kBFloat16: return fused_kernels::DType::kBFloat16;
    case torch::kFloat16: return fused_kernels::DType::kFloat16;
    default: return fused_kernels::DType::kFloat32;
  }
}

// The launchers report cudaGetLastError(), which also returns a stale cudaErrorNotReady left by an
// earlier event or stream query of anyone in this thread (torch clears those itself; not everyone
// does). A launch never fails with it, so it is not this kernel's error.
void check_launch(cudaError_t err, const char* what) {
  KV_CHECK(err == cudaSuccess || err == cudaErrorNotReady,
           "fused " << what << " kernel launch failed: " << cudaGetErrorString(err));
}
#endif

// A 2-D view's rows are addressable with one stride when its last dimension is contiguous.
bool rows_strided(const torch::Tensor& t) { return t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1); }
#ifdef KVSERVE_HAVE_CUDA_KERNELS
// Elements between consecutive rows of such a view (a one-row view's stride may be anything).
int64_t row_stride(const torch::Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(1); }
#endif

// w is a norm weight the fused ops take for activations x: one vector of x's dtype and width.
bool norm_weight_fits(const torch::Tensor& x, const torch::Tensor& w) {
  return w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.dim() == 1 && x.dim() >= 1 &&
         x.size(-1) == w.size(0) && w.device() == x.device();
}

// The angles are one row of D per qkv row (no broadcast), contiguous, in qkv's dtype and place.
bool angles_fit(const torch::Tensor& qkv, const RopeAngles& a, int64_t N, int64_t D) {
  for (const torch::Tensor* t : {&a.cos, &a.sin})
    if (t->scalar_type() != qkv.scalar_type() || t->numel() != N * D || !t->is_contiguous() || t->device() != qkv.device())
      return false;
  return true;
}

torch::Tensor rms_norm_chain(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  // As transformers: normalise in fp32, cast back, then scale.
  auto xf = x.to(torch::kFloat32);
  auto var = xf.pow(2).mean(-1, true);
  return w * (xf * torch::rsqrt(var + eps)).to(x.scalar_type());
}

}  // namespace

bool compiled() {
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  return true;
#else
  return false;
#endif
}

int level() { return level_setting().load(std::memory_order_relaxed); }

void set_level(int l) {
  KV_CHECK(l >= 0 && l <= 2, "fused ops level " << l << " is not 0, 1 or 2");
  level_setting().store(l, std::memory_order_relaxed);
  cuda::set_append_vectorized(l >= 2);  // the K/V append's copy belongs to the same level
}

bool active(const torch::Tensor& x) {
  return compiled() && x.is_cuda() && kernel_dtype(x.scalar_type()) && level() > 0;
}

int cpu_level() { return cpu_level_setting().load(std::memory_order_relaxed); }

void set_cpu_level(int l) {
  KV_CHECK(l >= 0 && l <= 2, "fused ops CPU level " << l << " is not 0, 1 or 2");
  cpu_level_setting().store(l, std::memory_order_relaxed);
}

bool cpu_active(const torch::Tensor& x) { return cpu::supports(x) && x.numel() > 0 && cpu_level() > 0; }

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  if (active(x) && norm_weight_fits(x, w)) {
    const int64_t cols = x.size(-1);
    const torch::Tensor x2 = x.reshape({-1, cols});  // a view where possible
    if (rows_strided(x2)) {
      const c10::cuda::CUDAGuard guard(x.device());
      torch::Tensor out = torch::empty({x2.size(0), cols}, x.options());
      fused_kernels::RmsNormArgs a;
      a.x = x2.data_ptr();
      a.out = out.data_ptr();
      a.w = w.data_ptr();
      a.rows = x2.size(0);
      a.cols = cols;
      a.x_stride = row_stride(x2);
      a.eps = static_cast<float>(eps);
      a.dtype = dtype_of(x);
      a.vectorized = level() >= 2;
      check_launch(fused_kernels::launch_rms_norm(a, at::cuda::getCurrentCUDAStream(x.device().index())), "rms_norm");
      return out.view(x.sizes());
    }
  }
#endif
  if (cpu_active(x) && norm_weight_fits(x, w)) {
    const torch::Tensor x2 = x.reshape({-1, x.size(-1)});  // a view where possible
    if (rows_strided(x2)) return cpu::rms_norm(x2, w, eps, /*exact=*/cpu_level() < 2).view(x.sizes());
  }
  return rms_norm_chain(x, w, eps);
}

std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                     const torch::Tensor& w, double eps) {
  KV_CHECK(x.sizes() == delta.sizes(), "internal: residual add of " << delta.sizes() << " to " << x.sizes());
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  if (active(x) && x.dim() == 2 && delta.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type() &&
      w.is_contiguous() && w.dim() == 1 && x.size(1) == w.size(0) && rows_strided(x) && rows_strided(delta) &&
      delta.device() == x.device()) {
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0), cols = x.size(1);
    torch::Tensor x_out = torch::empty({rows, cols}, x.options());
    torch::Tensor out = torch::empty({rows, cols}, x.options());
    fused_kernels::RmsNormArgs a;
    a.x = x.data_ptr();
    a.delta = delta.data_ptr();
    a.x_out = x_out.data_ptr();
    a.out = out.data_ptr();
    a.w = w.data_ptr();
    a.rows = rows;
    a.cols = cols;
    a.x_stride = row_stride(x);
    a.delta_stride = row_stride(delta);
    a.eps = static_cast<float>(eps);
    a.dtype = dtype_of(x);
    a.vectorized = level() >= 2;
    check_launch(fused_kernels::launch_rms_norm(a, at::cuda::getCurrentCUDAStream(x.device().index())), "add_rms_norm");
    return {x_out, out};
  }
#endif
  if (cpu_active(x) && x.dim() == 2 && delta.scalar_type() == x.scalar_type() && delta.device() == x.device() &&
      norm_weight_fits(x, w) && rows_strided(x) && rows_strided(delta))
    return cpu::add_rms_norm(x, delta, w, eps, /*exact=*/cpu_level() < 2);
  torch::Tensor sum = x + delta;
  torch::Tensor normed = rms_norm_chain(sum, w, eps);
  return {sum, normed};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_qkv(const torch::Tensor& qkv, const RopeAngles& angles,
                                                                 int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t N = qkv.size(0), H = q_heads, KV = kv_heads, D = head_dim;
  KV_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * KV) * D,
           "internal: qkv " << qkv.sizes() << " is not [N, (" << H << " + 2 * " << KV << ") * " << D << "]");
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  if (active(qkv) && rows_strided(qkv) && D % 2 == 0 && angles_fit(qkv, angles, N, D)) {
    const c10::cuda::CUDAGuard guard(qkv.device());
    torch::Tensor q = torch::empty({N, H, D}, qkv.options());
    torch::Tensor k = torch::empty({N, KV, D}, qkv.options());
    torch::Tensor v = torch::empty({N, KV, D}, qkv.options());
    fused_kernels::RopeQkvArgs a;
    a.qkv = qkv.data_ptr();
    a.qkv_stride = row_stride(qkv);
    a.cos = angles.cos.data_ptr();
    a.sin = angles.sin.data_ptr();
    a.q = q.data_ptr();
    a.k = k.data_ptr();
    a.v = v.data_ptr();
    a.rows = N;
    a.q_heads = H;
    a.kv_heads = KV;
    a.head_dim = D;
    a.dtype = dtype_of(qkv);
    a.vectorized = level() >= 2;
    check_launch(fused_kernels::launch_rope_qkv(a, at::cuda::getCurrentCUDAStream(qkv.device().index())), "rope_qkv");
    return {q, k, v};
  }
#endif
  if (cpu_active(qkv) && rows_strided(qkv) && D % 2 == 0 && angles_fit(qkv, angles, N, D))
    return cpu::rope_qkv(qkv, angles.cos, angles.sin, H, KV, D);
  auto q = Rope::apply(qkv.narrow(1, 0, H * D).view({N, H, D}), angles).contiguous();
  auto k = Rope::apply(qkv.narrow(1, H * D, KV * D).view({N, KV, D}), angles).contiguous();
  auto v = qkv.narrow(1, (H + KV) * D, KV * D).view({N, KV, D}).contiguous();
  return {q, k, v};
}

torch::Tensor silu_mul(const torch::Tensor& gu, int64_t inter) {
  KV_CHECK(gu.dim() == 2 && gu.size(1) == 2 * inter, "internal: gate/up " << gu.sizes() << " is not [N, 2 * " << inter << "]");
#ifdef KVSERVE_HAVE_CUDA_KERNELS
  if (active(gu) && rows_strided(gu)) {
    const c10::cuda::CUDAGuard guard(gu.device());
    torch::Tensor out = torch::empty({gu.size(0), inter}, gu.options());
    fused_kernels::SiluMulArgs a;
    a.gu = gu.data_ptr();
    a.gu_stride = row_stride(gu);
    a.out = out.data_ptr();
    a.rows = gu.size(0);
    a.inter = inter;
    a.dtype = dtype_of(gu);
    check_launch(fused_kernels::launch_silu_mul(a, at::cuda::getCurrentCUDAStream(gu.device().index())), "silu_mul");
    return out;
  }
#endif
  if (cpu_active(gu) && cpu_level() >= 2 && rows_strided(gu)) return cpu::silu_mul(gu, inter);
  return torch::silu(gu.narrow(-1, 0, inter)) * gu.narrow(-1, inter, inter);
}

}  // namespace kvserve::fused
