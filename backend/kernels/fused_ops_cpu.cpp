#include "backend/kernels/fused_ops_cpu.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common/check.h"

// The build targets AVX2 + FMA on x86-64 (top CMakeLists.txt); other targets get 8 scalar lanes.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVSERVE_FUSED_CPU_AVX2 1
#endif

// Exactness rests on every product and sum being rounded on its own, as the chain's separate ops
// round them: this file is built with -ffp-contract=off (backend/CMakeLists.txt), so that no
// multiply-add is fused behind the code's back.

namespace kvserve::fused::cpu {
namespace {

constexpr int64_t kLanes = 8;
// Rows go to at::parallel_for only when a task gets at least this many elements: below it the
// threads' start-up costs more than the loop (a decode step's rows are all one task).
constexpr int64_t kParallelElems = int64_t{1} << 15;

#ifdef KVSERVE_FUSED_CPU_AVX2

// Eight fp32 lanes: the loops' only arithmetic type.
struct F8 {
  __m256 v;
};
inline F8 splat(float f) { return {_mm256_set1_ps(f)}; }
inline F8 operator+(F8 a, F8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline F8 operator*(F8 a, F8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline F8 operator/(F8 a, F8 b) { return {_mm256_div_ps(a.v, b.v)}; }
inline F8 operator-(F8 a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f))}; }

// Eight fp64 lanes: RMSNorm's sum of squares, which the chain adds pairwise in fp32 (close to the
// exact sum) and a long fp32 run per lane would not.
struct D8 {
  __m256d lo, hi;
};
inline D8 zero_d8() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
inline D8 operator+(D8 a, F8 b) {
  return {_mm256_add_pd(a.lo, _mm256_cvtps_pd(_mm256_castps256_ps128(b.v))),
          _mm256_add_pd(a.hi, _mm256_cvtps_pd(_mm256_extractf128_ps(b.v, 1)))};
}
inline D8 operator+(D8 a, D8 b) { return {_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)}; }
inline double hsum(D8 a) {
  const __m256d v = _mm256_add_pd(a.lo, a.hi);
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
  return _mm_cvtsd_f64(s);
}

inline F8 load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline void store(float* p, F8 a) { _mm256_storeu_ps(p, a.v); }
// bf16 is fp32's upper half.
inline F8 load(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
// Round to nearest even, NaN to 0x7FC0: c10::BFloat16's rounding, which torch's CPU ops use.
inline void store(c10::BFloat16* p, F8 a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
// fp16 through c10::Half's own conversions: the build does not assume F16C, and fp16 on a CPU is rare.
inline F8 load(const c10::Half* p) {
  alignas(32) float f[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) f[i] = static_cast<float>(p[i]);
  return {_mm256_load_ps(f)};
}
inline void store(c10::Half* p, F8 a) {
  alignas(32) float f[kLanes];
  _mm256_store_ps(f, a.v);
  for (int64_t i = 0; i < kLanes; ++i) p[i] = c10::Half(f[i]);
}

// e^x within ~2 ulp on [-86, 88.7], +inf above, e^-86 below: enough for silu's 1 + e^-x, whose
// torch counterpart (a 1-ulp exp) it must match to fp32 rounding. x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its Taylor series to r^7 (truncation 5e-9 relative), times 2^n built in the exponent bits.
inline F8 exp8(F8 x) {
  const __m256 xc = _mm256_max_ps(_mm256_min_ps(x.v, _mm256_set1_ps(89.0f)), _mm256_set1_ps(-86.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln2 in two parts, the first with few enough bits that n times it is exact.
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145751953125f), xc);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  // 2^(n - 1) * 2: n reaches 128 near the top, which overflows to +inf this way instead of wrapping
  // the exponent field; n - 1 >= -125 keeps 2^(n - 1) normal.
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
  return {_mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(2.0f))};
}

#else  // the portable lanes

struct F8 {
  float v[kLanes];
};
template <class Op> inline F8 lanewise(F8 a, F8 b, Op op) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] = op(a.v[i], b.v[i]);
  return a;
}
inline F8 splat(float f) {
  F8 r;
  for (float& x : r.v) x = f;
  return r;
}
inline F8 operator+(F8 a, F8 b) { return lanewise(a, b, [](float x, float y) { return x + y; }); }
inline F8 operator*(F8 a, F8 b) { return lanewise(a, b, [](float x, float y) { return x * y; }); }
inline F8 operator/(F8 a, F8 b) { return lanewise(a, b, [](float x, float y) { return x / y; }); }
inline F8 operator-(F8 a) { return lanewise(a, a, [](float x, float) { return -x; }); }
struct D8 {
  double v[kLanes];
};
inline D8 zero_d8() { return D8{}; }
inline D8 operator+(D8 a, F8 b) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline D8 operator+(D8 a, D8 b) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline double hsum(D8 a) {
  double s = 0;
  for (double x : a.v) s += x;
  return s;
}
template <class T> inline F8 load(const T* p) {
  F8 r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
template <class T> inline void store(T* p, F8 a) {
  for (int64_t i = 0; i < kLanes; ++i) p[i] = static_cast<T>(a.v[i]);
}
inline F8 exp8(F8 x) {
  for (float& v : x.v) v = std::exp(v);
  return x;
}

#endif

// The first n <= 8 elements at p, zeros in the lanes past them.
template <class T> inline F8 load_n(const T* p, int64_t n) {
  if (n == kLanes) return load(p);
  T buf[kLanes] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * sizeof(T));
  return load(buf);
}
template <class T> inline void store_n(T* p, F8 a, int64_t n) {
  if (n == kLanes) return store(p, a);
  T buf[kLanes];
  store(buf, a);
  std::memcpy(p, buf, static_cast<size_t>(n) * sizeof(T));
}
// a as a torch op of dtype T leaves it: rounded to T (and widened back for the next op).
template <class T> inline F8 round_as(F8 a) {
  if constexpr (std::is_same_v<T, float>) {
    return a;
  } else {
    T buf[kLanes];
    store(buf, a);
    return load(buf);
  }
}

// fn(T{}) for the activations' dtype t.
template <class F> void with_dtype(torch::ScalarType t, F&& fn) {
  switch (t) {
    case torch::kFloat32: return fn(float{});
    case torch::kBFloat16: return fn(c10::BFloat16{});
    case torch::kFloat16: return fn(c10::Half{});
    default: KV_FAIL("internal: fused CPU op on " << t << " (fp32, bf16 or fp16 only)");
  }
}

// fn(r0, r1) over [0, rows), split over threads when the rows are many (a prefill).
template <class F> void over_rows(int64_t rows, int64_t row_elems, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, kParallelElems / std::max<int64_t>(1, row_elems));
  if (rows <= grain) return fn(0, rows);
  at::parallel_for(0, rows, grain, fn);
}

// The first half of one row of RMSNorm: s is x, or (kAdd) T(x + delta), which is written to sum.
// kSquares writes the fp32 squares s^2 (the chain's pow(2)) to sq for torch's own mean and returns 0;
// otherwise returns their sum, added in fp64 (close to the exact sum, as the chain's pairwise fp32
// sum is, where a long fp32 run per lane would not be).
template <class T, bool kAdd, bool kSquares>
double square_row(const T* x, const T* delta, T* sum, float* sq, int64_t cols) {
  D8 acc0 = zero_d8(), acc1 = zero_d8();
  auto square = [&](int64_t j, int64_t n, D8& acc) {
    F8 s = load_n(x + j, n);
    if constexpr (kAdd) {
      s = round_as<T>(s + load_n(delta + j, n));
      store_n(sum + j, s, n);
    }
    if constexpr (kSquares) {
      store_n(sq + j, s * s, n);
    } else {
      acc = acc + s * s;
    }
  };
  int64_t j = 0;
  for (; j + 2 * kLanes <= cols; j += 2 * kLanes) {  // two sums in flight: the adds' latency bounds the loop
    square(j, kLanes, acc0);
    square(j + kLanes, kLanes, acc1);
  }
  for (; j < cols; j += kLanes) square(j, std::min(kLanes, cols - j), acc0);
  return kSquares ? 0.0 : hsum(acc0 + acc1);
}

// The second half, as the chain rounds it: out = T(w T(s r)) with r = 1 / sqrt(var + eps) in fp32
// (torch's rsqrt is that, correctly rounded).
template <class T> void scale_row(const T* s, const T* w, T* out, int64_t cols, float var, float eps) {
  const F8 r = splat(1.0f / std::sqrt(var + eps));
  for (int64_t j = 0; j < cols; j += kLanes) {
    const int64_t n = std::min(kLanes, cols - j);
    store_n(out + j, load_n(w + j, n) * round_as<T>(load_n(s + j, n) * r), n);
  }
}

// RMSNorm of rows x (kAdd: of T(x + delta), written to sum) into out. exact takes the mean of the
// squares from torch's own reduction, so that out has the chain's bits; else the loops add them.
template <class T, bool kAdd>
void norm_rows(const T* x, int64_t xs, const T* delta, int64_t ds, T* sum, const T* w, T* out, int64_t rows,
               int64_t cols, float eps, bool exact) {
  // Row r of delta and of sum (none without kAdd), and the row that output row r normalises.
  auto delta_row = [&](int64_t r) { return kAdd ? delta + r * ds : nullptr; };
  auto sum_row = [&](int64_t r) { return kAdd ? sum + r * cols : nullptr; };
  auto src = [&](int64_t r) { return kAdd ? sum + r * cols : x + r * xs; };
  if (!exact) {
    over_rows(rows, kAdd ? 2 * cols : cols, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const double ss = square_row<T, kAdd, false>(x + r * xs, delta_row(r), sum_row(r), nullptr, cols);
        scale_row(src(r), w, out + r * cols, cols, static_cast<float>(ss) / static_cast<float>(cols), eps);
      }
    });
    return;
  }
  torch::Tensor sq = torch::empty({rows, cols}, torch::kFloat32);
  float* sqp = sq.data_ptr<float>();
  over_rows(rows, kAdd ? 2 * cols : cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      square_row<T, kAdd, true>(x + r * xs, delta_row(r), sum_row(r), sqp + r * cols, cols);
  });
  // The chain's mean(-1, keepdim) of the same fp32 squares in the same layout: the same kernel,
  // hence the same order of additions and the same bits.
  const torch::Tensor var = sq.mean(-1, true);
  const float* vp = var.data_ptr<float>();
  over_rows(rows, cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) scale_row(src(r), w, out + r * cols, cols, vp[r], eps);
  });
}

// One head of RoPE as Rope::apply's three ops round it: out = T(T(x cos) + T(rotate_half(x) sin)).
template <class T> void rope_head(const T* x, const T* cos, const T* sin, T* out, int64_t half) {
  for (int64_t j = 0; j < half; j += kLanes) {
    const int64_t n = std::min(kLanes, half - j);
    const F8 x1 = load_n(x + j, n), x2 = load_n(x + half + j, n);
    const F8 lo = round_as<T>(x1 * load_n(cos + j, n)) + round_as<T>(-x2 * load_n(sin + j, n));
    const F8 hi = round_as<T>(x2 * load_n(cos + half + j, n)) + round_as<T>(x1 * load_n(sin + half + j, n));
    store_n(out + j, lo, n);
    store_n(out + half + j, hi, n);
  }
}

// One row of silu(g) * u as the chain rounds it: T(T(g / (1 + e^-g)) u).
template <class T> void silu_mul_row(const T* g, const T* u, T* out, int64_t inter) {
  const F8 one = splat(1.0f);
  for (int64_t j = 0; j < inter; j += kLanes) {
    const int64_t n = std::min(kLanes, inter - j);
    const F8 gv = load_n(g + j, n);
    store_n(out + j, round_as<T>(gv / (one + exp8(-gv))) * load_n(u + j, n), n);
  }
}

}  // namespace

bool supports(const torch::Tensor& x) {
  const auto t = x.scalar_type();
  return x.device().is_cpu() && (t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kFloat16);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool exact) {
  const int64_t rows = x.size(0), cols = x.size(1);
  torch::Tensor out = torch::empty({rows, cols}, x.options());
  with_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T, false>(x.data_ptr<T>(), x.stride(0), nullptr, 0, nullptr, w.data_ptr<T>(), out.data_ptr<T>(), rows, cols,
                        static_cast<float>(eps), exact);
  });
  return out;
}

std::pair<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                     const torch::Tensor& w, double eps, bool exact) {
  const int64_t rows = x.size(0), cols = x.size(1);
  torch::Tensor sum = torch::empty({rows, cols}, x.options());
  torch::Tensor out = torch::empty({rows, cols}, x.options());
  with_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T, true>(x.data_ptr<T>(), x.stride(0), delta.data_ptr<T>(), delta.stride(0), sum.data_ptr<T>(),
                       w.data_ptr<T>(), out.data_ptr<T>(), rows, cols, static_cast<float>(eps), exact);
  });
  return {sum, out};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_qkv(const torch::Tensor& qkv, const torch::Tensor& cos,
                                                                 const torch::Tensor& sin, int64_t q_heads,
                                                                 int64_t kv_heads, int64_t head_dim) {
  const int64_t N = qkv.size(0), H = q_heads, KV = kv_heads, D = head_dim, qs = qkv.stride(0);
  torch::Tensor q = torch::empty({N, H, D}, qkv.options());
  torch::Tensor k = torch::empty({N, KV, D}, qkv.options());
  torch::Tensor v = torch::empty({N, KV, D}, qkv.options());
  with_dtype(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* src = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    T* vp = v.data_ptr<T>();
    over_rows(N, (H + 2 * KV) * D, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = src + r * qs;
        const T* c = cp + r * D;
        const T* s = sp + r * D;
        for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, c, s, qp + (r * H + h) * D, D / 2);
        for (int64_t h = 0; h < KV; ++h) rope_head(row + (H + h) * D, c, s, kp + (r * KV + h) * D, D / 2);
        std::memcpy(vp + r * KV * D, row + (H + KV) * D, static_cast<size_t>(KV * D) * sizeof(T));
      }
    });
  });
  return {q, k, v};
}

torch::Tensor silu_mul(const torch::Tensor& gu, int64_t inter) {
  const int64_t N = gu.size(0), gs = gu.stride(0);
  torch::Tensor out = torch::empty({N, inter}, gu.options());
  with_dtype(gu.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gu.data_ptr<T>();
    T* op = out.data_ptr<T>();
    over_rows(N, 2 * inter, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * gs, gp + r * gs + inter, op + r * inter, inter);
    });
  });
  return out;
}

}  // namespace kvserve::fused::cpu
