#include "backend/quantization/pair_tiles.h"

#include <cstring>
#include <vector>

#include "backend/quantization/pair_tiles_kernel.h"
#include "common/check.h"
#include "common/env_int.h"
#include "ggml.h"

namespace kvserve {
namespace {

// KVSERVE_PAIR_TILES=0 turns every pair kernel off (the A/B).
bool pairs_on() {
  static const bool on = env_int("KVSERVE_PAIR_TILES", 1) != 0;
  return on;
}

pair_tiles::PairsFn kernel_for(int type, int act) {
  if (!pairs_on()) return nullptr;
  static const pair_tiles::PairsFn q4_1 = pair_tiles::q4_1_kernel(), q8_0 = pair_tiles::q8_0_kernel(),
                                   q4_0 = pair_tiles::q4_0_kernel(), q5_0 = pair_tiles::q5_0_kernel();
  if (type == GGML_TYPE_Q4_1 && act == GGML_TYPE_Q8_1) return q4_1;
  if (act != GGML_TYPE_Q8_0) return nullptr;
  if (type == GGML_TYPE_Q8_0) return q8_0;
  if (type == GGML_TYPE_Q4_0) return q4_0;
  if (type == GGML_TYPE_Q5_0) return q5_0;
  return nullptr;
}

pair_tiles::KPairsFn k_kernel(int type) {
  static const pair_tiles::KPairsFn q4_k = pairs_on() ? pair_tiles::q4_k_kernel() : nullptr,
                                    q5_k = pairs_on() ? pair_tiles::q5_k_kernel() : nullptr,
                                    q6_k = pairs_on() ? pair_tiles::q6_k_kernel() : nullptr;
  return type == GGML_TYPE_Q4_K ? q4_k : type == GGML_TYPE_Q5_K ? q5_k : type == GGML_TYPE_Q6_K ? q6_k : nullptr;
}

// An fp16 scale as float (exact).
float half_at(const uint8_t* p) {
  ggml_fp16_t h;
  std::memcpy(&h, p, sizeof h);
  return ggml_fp16_to_fp32(h);
}

// x's rows in pairs as the kernels read them (pair_tiles_kernel.h), in one 64-byte-aligned buffer (a
// 64-byte load that straddles two cache lines costs two). Q8_1 blocks: fp16 d, fp16 s, 32 quants;
// Q8_0: fp16 d, 32 quants.
// offset_scale: c of the Q4_0 (8) / Q5_0 (16) kernels' offset lanes, 0 for none.
struct Packed {
  const uint8_t* quants;
  const float* d_lanes;
  const float* s_rows;
  const int32_t* offsets;
};
Packed pack(const uint8_t* x, int64_t x_row_bytes, int64_t pairs, int64_t blocks, bool q8_1, int offset_scale,
            std::vector<uint8_t>& buf) {
  using pair_tiles::kPassPairs;
  const int64_t block_bytes = q8_1 ? 36 : 34, quants_at = q8_1 ? 4 : 2;
  const int64_t passes = (pairs + kPassPairs - 1) / kPassPairs;
  const int64_t q_bytes = pairs * blocks * 64, d_bytes = pairs * blocks * 64, o_bytes = offset_scale ? d_bytes : 0,
                s_bytes = q8_1 ? passes * blocks * 32 : 0;
  buf.resize(static_cast<size_t>(q_bytes + d_bytes + o_bytes + s_bytes + 64));
  uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  uint8_t* quants = base;
  auto* d_lanes = reinterpret_cast<float*>(base + q_bytes);
  auto* offsets = offset_scale ? reinterpret_cast<int32_t*>(base + q_bytes + d_bytes) : nullptr;
  auto* s_rows = q8_1 ? reinterpret_cast<float*>(base + q_bytes + d_bytes + o_bytes) : nullptr;
  if (s_rows) std::fill(s_rows, s_rows + passes * blocks * 8, 0.0f);
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t l = 0; l < blocks; ++l) {
      const uint8_t* a = x + (2 * p) * x_row_bytes + l * block_bytes;
      const uint8_t* b = a + x_row_bytes;
      uint8_t* q = quants + (p * blocks + l) * 64;
      std::memcpy(q, a + quants_at, 32);
      std::memcpy(q + 32, b + quants_at, 32);
      float* d = d_lanes + (p * blocks + l) * 16;
      std::fill(d, d + 8, half_at(a));
      std::fill(d + 8, d + 16, half_at(b));
      if (s_rows) {
        float* s = s_rows + ((p / kPassPairs) * blocks + l) * 8 + 2 * (p % kPassPairs);
        s[0] = half_at(a + 2);
        s[1] = half_at(b + 2);
      }
      if (offsets) {
        int32_t* o = offsets + (p * blocks + l) * 16;
        const auto* qa = reinterpret_cast<const int8_t*>(a + quants_at);
        const auto* qb = reinterpret_cast<const int8_t*>(b + quants_at);
        for (int k = 0; k < 8; ++k) {
          o[k] = -offset_scale * (qa[4 * k] + qa[4 * k + 1] + qa[4 * k + 2] + qa[4 * k + 3]);
          o[8 + k] = -offset_scale * (qb[4 * k] + qb[4 * k + 1] + qb[4 * k + 2] + qb[4 * k + 3]);
        }
      }
    }
  return {quants, d_lanes, s_rows, offsets};
}

// Q8_K rows in pairs for the K-quant kernels (pair_tiles_kernel.h). Q8_K blocks: float d, 256
// quants, 16 int16 sums of 16 quants (Q4_K and Q5_K take them added two by two, Q6_K as they are).
struct PackedK {
  const uint8_t* quants;
  const float* d_lanes;
  const float* d4_lanes;
  const int16_t* bsums;
};
PackedK pack_k(const uint8_t* x, int64_t x_row_bytes, int64_t pairs, int64_t blocks, bool q6_k, std::vector<uint8_t>& buf) {
  constexpr int64_t kQ8_KBytes = 292, kSumsAt = 260;
  const int64_t n = pairs * blocks;
  const int64_t q_bytes = n * 512, d_bytes = n * 64, d4_bytes = n * 32, s_bytes = n * (q6_k ? 64 : 32);
  buf.resize(static_cast<size_t>(q_bytes + d_bytes + d4_bytes + s_bytes + 64));
  uint8_t* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  auto* d_lanes = reinterpret_cast<float*>(base + q_bytes);
  auto* d4_lanes = reinterpret_cast<float*>(base + q_bytes + d_bytes);
  auto* bsums = reinterpret_cast<int16_t*>(base + q_bytes + d_bytes + d4_bytes);
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t l = 0; l < blocks; ++l) {
      const int64_t pb = p * blocks + l;
      for (int i = 0; i < 2; ++i) {
        const uint8_t* xb = x + (2 * p + i) * x_row_bytes + l * kQ8_KBytes;
        float xd;
        std::memcpy(&xd, xb, sizeof xd);
        for (int k = 0; k < 8; ++k) std::memcpy(base + (pb * 8 + k) * 64 + 32 * i, xb + 4 + 32 * k, 32);
        std::fill(d_lanes + pb * 16 + 8 * i, d_lanes + pb * 16 + 8 * i + 8, xd);
        std::fill(d4_lanes + pb * 8 + 4 * i, d4_lanes + pb * 8 + 4 * i + 4, xd);
        int16_t sums[16];
        std::memcpy(sums, xb + kSumsAt, sizeof sums);
        if (q6_k)
          std::memcpy(bsums + pb * 32 + 16 * i, sums, sizeof sums);
        else
          for (int k = 0; k < 8; ++k) bsums[pb * 16 + 8 * i + k] = static_cast<int16_t>(sums[2 * k] + sums[2 * k + 1]);
      }
    }
  return {base, d_lanes, d4_lanes, bsums};
}

}  // namespace

bool pair_tiles_available(int type, int act) {
  if (act == GGML_TYPE_Q8_K) return k_kernel(type) != nullptr;
  return kernel_for(type, act) != nullptr;
}

int64_t pair_tiles_dot(int type, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t* x,
                       int64_t x_row_bytes, int64_t M, int64_t blocks, float* y, int64_t ldy) {
  const int64_t pairs = M / 2;
  if (pairs == 0) return 0;
  thread_local std::vector<uint8_t> buf;
  if (const pair_tiles::KPairsFn k_quant = k_kernel(type)) {
    const PackedK p = pack_k(x, x_row_bytes, pairs, blocks, type == GGML_TYPE_Q6_K, buf);
    k_quant(w, row_bytes, r0, r1, p.quants, p.d_lanes, p.d4_lanes, p.bsums, pairs, blocks, y, ldy);
  } else {
    const int act = type == GGML_TYPE_Q4_1 ? GGML_TYPE_Q8_1 : GGML_TYPE_Q8_0;
    const pair_tiles::PairsFn kernel = kernel_for(type, act);
    KV_CHECK(kernel != nullptr, "internal: no pair kernel for ggml type " << type << " here");
    const int offset_scale = type == GGML_TYPE_Q4_0 ? 8 : type == GGML_TYPE_Q5_0 ? 16 : 0;
    const Packed p = pack(x, x_row_bytes, pairs, blocks, act == GGML_TYPE_Q8_1, offset_scale, buf);
    kernel(w, row_bytes, r0, r1, p.quants, p.d_lanes, p.s_rows, p.offsets, pairs, blocks, y, ldy);
  }
  return 2 * pairs;
}

bool pair_tiles_take(int type, int act, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, const uint8_t*& x,
                     int64_t x_row_bytes, int64_t& M, int64_t blocks, float*& y, int64_t ldy) {
  if (M < 2 || !pair_tiles_available(type, act)) return false;
  const int64_t done = pair_tiles_dot(type, w, row_bytes, r0, r1, x, x_row_bytes, M, blocks, y, ldy);
  x += done * x_row_bytes;
  y += done * ldy;
  M -= done;
  return M == 0;
}

}  // namespace kvserve
