#include "backend/quantization/gguf_cuda_forms.h"

#include <cstring>
#include <vector>

#include "backend/quantization/int4_weight.h"
#include "backend/quantization/int8_weight.h"
#include "common/check.h"
#include "ggml.h"

namespace kvserve {
namespace {

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return ggml_fp16_to_fp32(h);
}

// Where each type's fields sit in its block (ggml-common.h), checked against ggml's block sizes.
struct Layout {
  int64_t values = 0;  // per block
  int64_t bytes = 0;   // per block
  int64_t group = 0;   // values per scale
  int code_min = 0;
};
Layout layout_of(int type, const std::string& what) {
  switch (type) {
    case GGML_TYPE_Q4_0: return {32, 18, 32, -8};
    case GGML_TYPE_Q4_1: return {32, 20, 32, 0};
    case GGML_TYPE_Q5_0: return {32, 22, 32, -16};
    case GGML_TYPE_Q8_0: return {32, 34, 32, -128};
    case GGML_TYPE_Q4_K: return {256, 144, 32, 0};
    case GGML_TYPE_Q6_K: return {256, 210, 16, -32};
    default: break;
  }
  KV_FAIL(what << ": no CUDA form decodes " << ggml_type_name(static_cast<ggml_type>(type)) << " blocks");
}

// One block: codes [values], scale and offset [values / group].
void decode_block(int type, const uint8_t* b, int8_t* code, float* scale, float* offset) {
  switch (type) {
    case GGML_TYPE_Q4_0:  // fp16 d; 16 bytes: value j the low nibble of byte j, value j + 16 its high nibble
    case GGML_TYPE_Q4_1:  // fp16 d, fp16 m; the same nibbles; value = q d + m
    case GGML_TYPE_Q5_0: {  // fp16 d; 4 bytes of fifth bits; the nibbles; value = (q - 16) d
      const float d = half_at(b);
      const uint8_t* qs = b + (type == GGML_TYPE_Q4_0 ? 2 : type == GGML_TYPE_Q4_1 ? 4 : 6);
      uint32_t qh = 0;
      if (type == GGML_TYPE_Q5_0) std::memcpy(&qh, b + 2, sizeof qh);
      for (int j = 0; j < 16; ++j) {
        int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
        if (type == GGML_TYPE_Q5_0) {
          lo |= static_cast<int>(((qh >> j) << 4) & 0x10);
          hi |= static_cast<int>((qh >> (j + 12)) & 0x10);
          lo -= 16, hi -= 16;
        } else if (type == GGML_TYPE_Q4_0) {
          lo -= 8, hi -= 8;
        }
        code[j] = static_cast<int8_t>(lo);
        code[j + 16] = static_cast<int8_t>(hi);
      }
      scale[0] = d;
      offset[0] = type == GGML_TYPE_Q4_1 ? half_at(b + 2) : 0.0f;
      return;
    }
    case GGML_TYPE_Q8_0: {  // fp16 d; 32 int8 codes
      scale[0] = half_at(b);
      offset[0] = 0.0f;
      std::memcpy(code, b + 2, 32);
      return;
    }
    case GGML_TYPE_Q4_K: {  // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* sm = b + 4;
      const uint8_t* qs = b + 16;
      for (int sb = 0; sb < 8; ++sb) {
        // ggml's get_scale_min_k4: the first four pairs in 6 bits, the rest split over two bytes.
        int sc, mn;
        if (sb < 4) {
          sc = sm[sb] & 63, mn = sm[sb + 4] & 63;
        } else {
          sc = (sm[sb + 4] & 0xF) | ((sm[sb - 4] >> 6) << 4);
          mn = (sm[sb + 4] >> 4) | ((sm[sb] >> 6) << 4);
        }
        scale[sb] = d * static_cast<float>(sc);     // exact: 11 x 6 bits
        offset[sb] = -(dmin * static_cast<float>(mn));
        // Sub-blocks in pairs over 32 bytes: the even one the low nibbles, the odd one the high.
        const uint8_t* q = qs + (sb / 2) * 32;
        for (int l = 0; l < 32; ++l) code[sb * 32 + l] = static_cast<int8_t>(sb % 2 == 0 ? q[l] & 0xF : q[l] >> 4);
      }
      return;
    }
    case GGML_TYPE_Q6_K: {  // 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, fp16 d
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int half = 0; half < 2; ++half) {
        int8_t* y = code + half * 128;
        for (int l = 0; l < 32; ++l) {
          y[l + 0] = static_cast<int8_t>(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
          y[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
          y[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          y[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
        ql += 64, qh += 32;
      }
      // Value i of the block takes scale i / 16 (ggml multiplies d by it first: exact, 11 x 8 bits).
      for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(sc[g]), offset[g] = 0.0f;
      return;
    }
    default: break;
  }
  KV_FAIL("internal: decode_block of ggml type " << type);
}

}  // namespace

GgufCudaForm gguf_cuda_form(int ggml_type) {
  switch (ggml_type) {
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q4_K: return GgufCudaForm::kInt4;
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q6_K:
    case GGML_TYPE_Q8_0: return GgufCudaForm::kInt8;
    default: return GgufCudaForm::kNone;
  }
}

GgufGroups gguf_groups(const QuantizedWeight& q, const std::string& what) {
  const int type = q.single_type();
  KV_CHECK(type >= 0, what << ": blocks of several types (" << q.type_names() << ") have no one CUDA form");
  const Layout lay = layout_of(type, what);
  KV_CHECK(static_cast<int64_t>(ggml_type_size(static_cast<ggml_type>(type))) == lay.bytes &&
               ggml_blck_size(static_cast<ggml_type>(type)) == lay.values,
           "internal: ggml's " << ggml_type_name(static_cast<ggml_type>(type)) << " block is not " << lay.values
                               << " values in " << lay.bytes << " bytes");
  const int64_t N = q.rows(), K = q.cols(), blocks = K / lay.values, per = lay.values / lay.group;
  KV_CHECK(K % lay.values == 0, what << ": " << K << " columns are not whole " << lay.values << "-value blocks");
  const torch::Tensor raw = q.block_bytes().contiguous();
  GgufGroups g;
  g.group = lay.group;
  g.code_min = lay.code_min;
  g.codes = torch::empty({N, K}, torch::kInt8);
  g.scale = torch::empty({N, K / lay.group}, torch::kFloat32);
  g.offset = torch::empty({N, K / lay.group}, torch::kFloat32);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  int8_t* codes = g.codes.data_ptr<int8_t>();
  float* scale = g.scale.data_ptr<float>();
  float* offset = g.offset.data_ptr<float>();
  for (int64_t i = 0; i < N * blocks; ++i)
    decode_block(type, src + i * lay.bytes, codes + i * lay.values, scale + i * per, offset + i * per);
  return g;
}

std::optional<LinearWeight> gguf_cuda_weight(const QuantizedWeight& q, const torch::Device& device,
                                             const std::string& what) {
  const int type = q.single_type();
  const GgufCudaForm form = type < 0 ? GgufCudaForm::kNone : gguf_cuda_form(type);
  if (form == GgufCudaForm::kNone) return std::nullopt;
  if (form == GgufCudaForm::kInt8) {
    if (!Int8Weight::fits(q.rows(), q.cols())) return std::nullopt;
    if (type == GGML_TYPE_Q8_0) return LinearWeight(Int8Weight::from_q8_0(q).to(device));
    GgufGroups g = gguf_groups(q, what);
    return LinearWeight(Int8Weight::from_codes(g.codes.to(device), g.scale.to(device), g.group, what));
  }
  // tinygemm tiles 8 rows on CUDA; the CPU's reference kernel 16.
  if (!Int4Weight::fits(q.rows(), q.cols()) || (!device.is_cuda() && q.rows() % 16 != 0)) return std::nullopt;
  GgufGroups g = gguf_groups(q, what);
  const auto nibble = (g.codes.to(torch::kInt32) - g.code_min).to(device);
  const auto zero = g.offset + static_cast<float>(g.code_min + 8) * g.scale;
  return LinearWeight(Int4Weight::from_codes(nibble, g.scale, zero, g.group, what));
}

}  // namespace kvserve
