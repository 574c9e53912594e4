#include "cache_manager/kv_quant.h"

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cache_manager/kernel_dtype.h"
#include "cache_manager/kv_quant_cuda.h"
#include "cache_manager/paged_attention_cuda.h"
#include "common/check.h"

namespace kvserve {
namespace {

constexpr int64_t G = kKvQuantGroup;

uint16_t to_half_bits(float x) { return c10::Half(x).x; }
float from_half_bits(uint16_t b) { return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }

void put_half(uint8_t* p, float x) {
  const uint16_t b = to_half_bits(x);
  std::memcpy(p, &b, 2);
}
float get_half(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return from_half_bits(b);
}

// The reference quantizers of ggml (ggml-quants.c, quantize_row_*_ref), one group of 32 values:
// the scale is computed in fp32 and only stored as fp16, as ggml does.
void encode_q8_0(const float* x, uint8_t* qs, uint8_t* scale) {
  float amax = 0.0f;
  for (int64_t j = 0; j < G; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t j = 0; j < G; ++j) qs[j] = static_cast<uint8_t>(static_cast<int8_t>(std::roundf(x[j] * id)));
  put_half(scale, d);
}

void encode_q4_0(const float* x, uint8_t* qs, uint8_t* scale) {
  float amax = 0.0f, max = 0.0f;
  for (int64_t j = 0; j < G; ++j) {
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t j = 0; j < G / 2; ++j) {
    const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f)));
    const int hi = std::min(15, static_cast<int>(static_cast<int8_t>(x[j + G / 2] * id + 8.5f)));
    qs[j] = static_cast<uint8_t>(lo | (hi << 4));
  }
  put_half(scale, d);
}

void encode_q4_1(const float* x, uint8_t* qs, uint8_t* scale) {
  float lo = x[0], hi = x[0];
  for (int64_t j = 1; j < G; ++j) {
    lo = std::min(lo, x[j]);
    hi = std::max(hi, x[j]);
  }
  const float d = (hi - lo) / 15.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t j = 0; j < G / 2; ++j) {
    const int a = std::min(15, static_cast<int>(static_cast<int8_t>((x[j] - lo) * id + 0.5f)));
    const int b = std::min(15, static_cast<int>(static_cast<int8_t>((x[j + G / 2] - lo) * id + 0.5f)));
    qs[j] = static_cast<uint8_t>(a | (b << 4));
  }
  put_half(scale, d);
  put_half(scale + 2, lo);
}

// q8_0's recipe with e4m3 values: the group's largest magnitude maps to e4m3's largest finite value,
// and each x * (1 / d) is rounded to the nearest e4m3 (c10's conversion: round to nearest even).
void encode_fp8_e4m3(const float* x, uint8_t* qs, uint8_t* scale) {
  float amax = 0.0f;
  for (int64_t j = 0; j < G; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 448.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int64_t j = 0; j < G; ++j) qs[j] = c10::Float8_e4m3fn(x[j] * id).x;
  put_half(scale, d);
}

int64_t scale_bytes(KvQuant q) { return q == KvQuant::q4_1 ? 4 : 2; }
int64_t data_bytes(KvQuant q, int64_t head_dim) {
  return q == KvQuant::q8_0 || q == KvQuant::fp8_e4m3 ? head_dim : head_dim / 2;
}

}  // namespace

int64_t kv_quant_row_bytes(KvQuant q, int64_t head_dim) {
  KV_CHECK(q != KvQuant::none, "kv_quant_row_bytes: not a quantized format");
  return data_bytes(q, head_dim) + head_dim / G * scale_bytes(q);
}

std::string kv_cache_dtype_label(torch::ScalarType dtype, KvQuant quant) {
  switch (quant) {
    case KvQuant::q8_0: return "int8";
    case KvQuant::q4_0: return "int4";
    case KvQuant::q4_1: return "q4_1";
    case KvQuant::fp8_e4m3: return "fp8";
    case KvQuant::none: break;
  }
  switch (dtype) {
    case torch::kFloat32: return "float32";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: return c10::toString(dtype);
  }
}

const char* kv_quant_name(KvQuant q) {
  switch (q) {
    case KvQuant::none: return "none";
    case KvQuant::q8_0: return "q8_0";
    case KvQuant::q4_0: return "q4_0";
    case KvQuant::q4_1: return "q4_1";
    case KvQuant::fp8_e4m3: return "fp8_e4m3";
  }
  return "?";
}

void check_kv_quant_head_dim(KvQuant q, int64_t head_dim, const std::string& what) {
  if (q == KvQuant::none) return;
  KV_CHECK(head_dim > 0 && head_dim % G == 0, what << ": a " << kv_quant_name(q) << " KV cache quantizes head_dim in groups of "
                                                   << G << ", and this model's head_dim is " << head_dim);
}

void kv_quant_encode_row(KvQuant q, const float* x, int64_t head_dim, uint8_t* row, bool rotate) {
  thread_local std::vector<float> rotated;  // reused: this runs per row of every decode step
  if (rotate) {
    rotated.assign(x, x + head_dim);
    kv_quant_rotate_row(rotated.data(), head_dim);
    x = rotated.data();
  }
  const int64_t groups = head_dim / G, data = data_bytes(q, head_dim), sb = scale_bytes(q);
  for (int64_t g = 0; g < groups; ++g) {
    uint8_t* scale = row + data + g * sb;
    switch (q) {
      case KvQuant::q8_0: encode_q8_0(x + g * G, row + g * G, scale); break;
      case KvQuant::q4_0: encode_q4_0(x + g * G, row + g * G / 2, scale); break;
      case KvQuant::q4_1: encode_q4_1(x + g * G, row + g * G / 2, scale); break;
      case KvQuant::fp8_e4m3: encode_fp8_e4m3(x + g * G, row + g * G, scale); break;
      case KvQuant::none: KV_FAIL("kv_quant_encode_row: not a quantized format");
    }
  }
}

void kv_quant_decode_row(KvQuant q, const uint8_t* row, int64_t head_dim, float* x) {
  const int64_t groups = head_dim / G, data = data_bytes(q, head_dim), sb = scale_bytes(q);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* scale = row + data + g * sb;
    const float d = get_half(scale);
    float* out = x + g * G;
    switch (q) {
      case KvQuant::q8_0: {
        const auto* qs = reinterpret_cast<const int8_t*>(row + g * G);
        for (int64_t j = 0; j < G; ++j) out[j] = static_cast<float>(qs[j]) * d;
        break;
      }
      case KvQuant::fp8_e4m3: {
        const uint8_t* qs = row + g * G;
        const float* values = fp8_e4m3_values();
        for (int64_t j = 0; j < G; ++j) out[j] = values[qs[j]] * d;
        break;
      }
      case KvQuant::q4_0:
      case KvQuant::q4_1: {
        const uint8_t* qs = row + g * G / 2;
        const float m = q == KvQuant::q4_1 ? get_half(scale + 2) : -8.0f * d;
        for (int64_t j = 0; j < G / 2; ++j) {
          out[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
          out[j + G / 2] = static_cast<float>(qs[j] >> 4) * d + m;
        }
        break;
      }
      case KvQuant::none: KV_FAIL("kv_quant_decode_row: not a quantized format");
    }
  }
}

const float* fp8_e4m3_values() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) {
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table.data();
}

float kv_quant_rotation_scale() { return 1.0f / std::sqrt(static_cast<float>(G)); }

void kv_quant_rotate_row(float* x, int64_t head_dim) {
  // Butterflies in natural (Sylvester) order: the result is H32 x / sqrt(32), H32(i, j) = (-1)^popcount(i & j).
  const float s = kv_quant_rotation_scale();
  for (int64_t g = 0; g < head_dim; g += G) {
    float* v = x + g;
    for (int64_t len = 1; len < G; len <<= 1) {
      for (int64_t i = 0; i < G; i += 2 * len) {
        for (int64_t j = i; j < i + len; ++j) {
          const float a = v[j], b = v[j + len];
          v[j] = a + b;
          v[j + len] = a - b;
        }
      }
    }
    for (int64_t j = 0; j < G; ++j) v[j] *= s;
  }
}

torch::Tensor kv_quant_rotate(const torch::Tensor& x) {
  const int64_t D = x.size(-1);
  KV_CHECK(D % G == 0, "kv_quant_rotate: head_dim " << D << " is not a multiple of " << G);
  if (x.is_cuda() && cuda::compiled() && is_cuda_kernel_dtype(x.scalar_type())) return cuda::kv_quant_rotate(x);
  torch::Tensor y = x.to(torch::kCPU, torch::kFloat32).contiguous().clone();
  float* p = y.data_ptr<float>();
  const int64_t rows = D == 0 ? 0 : y.numel() / D;
  for (int64_t r = 0; r < rows; ++r) kv_quant_rotate_row(p + r * D, D);
  return y.to(x.device(), x.scalar_type());
}

bool kv_quant_rotation_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("KVSERVE_KV_ROTATE");
    return e == nullptr || std::string(e) != "0";
  }();
  return on;
}

torch::Tensor kv_quant_encode(const torch::Tensor& x, KvQuant q, bool rotate) {
  KV_CHECK(x.dim() >= 1 && x.is_floating_point(), "kv_quant_encode: x must be a float tensor [..., D], got " << x.sizes());
  const int64_t D = x.size(-1);
  check_kv_quant_head_dim(q, D, "kv_quant_encode");
  if (x.is_cuda() && cuda::compiled() && is_cuda_kernel_dtype(x.scalar_type())) return cuda::kv_quant_encode(x, q, rotate);
  const int64_t rb = kv_quant_row_bytes(q, D);
  // On the host with ggml's scalar rounding, so the bytes equal the reference's (CUDA tensors took
  // the device twin above, which gives the same bytes).
  const torch::Tensor xc = x.to(torch::kCPU, torch::kFloat32).contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = rb;
  torch::Tensor out = torch::empty(shape, torch::TensorOptions().dtype(torch::kUInt8));
  const int64_t rows = D == 0 ? 0 : xc.numel() / D;
  const float* xp = xc.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) kv_quant_encode_row(q, xp + r * D, D, op + r * rb, rotate);
  });
  return x.device().is_cpu() ? out : out.to(x.device());
}

torch::Tensor kv_quant_decode(const torch::Tensor& rows, KvQuant q, int64_t head_dim, torch::ScalarType out_dtype,
                              bool rotate) {
  check_kv_quant_head_dim(q, head_dim, "kv_quant_decode");
  const int64_t rb = kv_quant_row_bytes(q, head_dim);
  KV_CHECK(rows.dim() >= 1 && rows.size(-1) == rb && rows.scalar_type() == torch::kUInt8,
           "kv_quant_decode: rows must be uint8 [..., " << rb << "] for " << kv_quant_name(q) << " rows of head_dim "
                                                        << head_dim << ", got " << rows.scalar_type() << " " << rows.sizes());
  if (rows.is_cuda() && cuda::compiled() && is_cuda_kernel_dtype(out_dtype)) {
    return cuda::kv_quant_decode(rows, q, head_dim, out_dtype, rotate);
  }
  const torch::Tensor rc = rows.to(torch::kCPU).contiguous();
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = head_dim;
  torch::Tensor out = torch::empty(shape, torch::TensorOptions().dtype(torch::kFloat32));
  const int64_t n = rc.numel() / rb;
  const uint8_t* rp = rc.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      kv_quant_decode_row(q, rp + r * rb, head_dim, op + r * head_dim);
      if (rotate) kv_quant_rotate_row(op + r * head_dim, head_dim);
    }
  });
  return out.to(rows.device(), out_dtype);
}

}  // namespace kvserve
