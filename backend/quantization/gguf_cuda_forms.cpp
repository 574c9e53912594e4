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
  bool affine = false;  // value = d q + m (an offset per group)
};
Layout layout_of(int type, const std::string& what) {
  switch (type) {
    case GGML_TYPE_Q4_0: return {32, 18, 32, -8, false};
    case GGML_TYPE_Q4_1: return {32, 20, 32, 0, true};
    case GGML_TYPE_Q5_0: return {32, 22, 32, -16, false};
    case GGML_TYPE_Q5_1: return {32, 24, 32, 0, true};
    case GGML_TYPE_Q8_0: return {32, 34, 32, -128, false};
    case GGML_TYPE_Q2_K: return {256, 84, 16, 0, true};
    case GGML_TYPE_Q3_K: return {256, 110, 16, -4, false};
    case GGML_TYPE_Q4_K: return {256, 144, 32, 0, true};
    case GGML_TYPE_Q5_K: return {256, 176, 32, 0, true};
    case GGML_TYPE_Q6_K: return {256, 210, 16, -32, false};
    default: break;
  }
  KV_FAIL(what << ": no CUDA form decodes " << ggml_type_name(static_cast<ggml_type>(type)) << " blocks");
}

// ggml's get_scale_min_k4 (Q4_K, Q5_K): sub-block j's 6-bit scale and min, the first four pairs in
// 6 bits, the rest split over two bytes.
void scale_min_k4(int j, const uint8_t* sm, int& sc, int& mn) {
  if (j < 4) {
    sc = sm[j] & 63, mn = sm[j + 4] & 63;
  } else {
    sc = (sm[j + 4] & 0xF) | ((sm[j - 4] >> 6) << 4);
    mn = (sm[j + 4] >> 4) | ((sm[j] >> 6) << 4);
  }
}

// One block: codes [values], scale and offset [values / group].
void decode_block(int type, const uint8_t* b, int8_t* code, float* scale, float* offset) {
  switch (type) {
    case GGML_TYPE_Q4_0:  // fp16 d; 16 bytes: value j the low nibble of byte j, value j + 16 its high nibble
    case GGML_TYPE_Q4_1:  // fp16 d, fp16 m; the same nibbles; value = q d + m
    case GGML_TYPE_Q5_0:  // fp16 d; 4 bytes of fifth bits; the nibbles; value = (q - 16) d
    case GGML_TYPE_Q5_1: {  // fp16 d, fp16 m; 4 bytes of fifth bits; the nibbles; value = q d + m
      const bool has_min = type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1;
      const bool five = type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q5_1;
      const int head = has_min ? 4 : 2;  // the fp16 fields
      const float d = half_at(b);
      const uint8_t* qs = b + head + (five ? 4 : 0);
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, b + head, sizeof qh);
      for (int j = 0; j < 16; ++j) {
        int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
        if (five) {
          lo |= static_cast<int>(((qh >> j) << 4) & 0x10);
          hi |= static_cast<int>((qh >> (j + 12)) & 0x10);
        }
        if (type == GGML_TYPE_Q5_0) lo -= 16, hi -= 16;
        if (type == GGML_TYPE_Q4_0) lo -= 8, hi -= 8;
        code[j] = static_cast<int8_t>(lo);
        code[j + 16] = static_cast<int8_t>(hi);
      }
      scale[0] = d;
      offset[0] = has_min ? half_at(b + 2) : 0.0f;
      return;
    }
    case GGML_TYPE_Q2_K: {  // 16 bytes of 4-bit scale and min pairs, 64 bytes of 2-bit values, fp16 d, dmin
      const uint8_t* sm = b;
      const uint8_t* q = b + 16;
      const float d = half_at(b + 80), dmin = half_at(b + 82);
      int is = 0;
      int8_t* y = code;
      for (int n = 0; n < 2; ++n, q += 32) {
        for (int shift = 0; shift < 8; shift += 2) {
          for (int h = 0; h < 2; ++h, ++is) {  // 16 values from bytes [0, 16), then from [16, 32)
            scale[is] = d * static_cast<float>(sm[is] & 0xF);
            offset[is] = -(dmin * static_cast<float>(sm[is] >> 4));
            for (int l = 0; l < 16; ++l) *y++ = static_cast<int8_t>((q[l + 16 * h] >> shift) & 3);
          }
        }
      }
      return;
    }
    case GGML_TYPE_Q3_K: {  // 32 bytes of high bits, 64 of 2-bit values, 12 of 6-bit scales, fp16 d
      const uint8_t* hm = b;
      const uint8_t* q = b + 32;
      const float d = half_at(b + 108);
      // ggml's unpacking of the sixteen 6-bit scales (low 4 bits from the first 8 bytes, high 2 from the last 4).
      uint32_t aux[4];
      std::memcpy(aux, b + 96, 12);
      const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
      aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
      aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
      aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
      aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
      int8_t sc[16];
      std::memcpy(sc, aux, 16);
      int is = 0, m = 1;
      int8_t* y = code;
      for (int n = 0; n < 2; ++n, q += 32) {
        for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
          for (int h = 0; h < 2; ++h, ++is) {
            scale[is] = d * static_cast<float>(sc[is] - 32);
            offset[is] = 0.0f;
            for (int l = 16 * h; l < 16 * h + 16; ++l)
              *y++ = static_cast<int8_t>(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
          }
        }
      }
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
        int sc, mn;
        scale_min_k4(sb, sm, sc, mn);
        scale[sb] = d * static_cast<float>(sc);     // exact: 11 x 6 bits
        offset[sb] = -(dmin * static_cast<float>(mn));
        // Sub-blocks in pairs over 32 bytes: the even one the low nibbles, the odd one the high.
        const uint8_t* q = qs + (sb / 2) * 32;
        for (int l = 0; l < 32; ++l) code[sb * 32 + l] = static_cast<int8_t>(sb % 2 == 0 ? q[l] & 0xF : q[l] >> 4);
      }
      return;
    }
    case GGML_TYPE_Q5_K: {  // fp16 d, dmin, 12 bytes of scales and mins, 32 bytes of fifth bits, 128 of nibbles
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* sm = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* ql = b + 48;
      for (int sb = 0; sb < 8; ++sb) {
        int sc, mn;
        scale_min_k4(sb, sm, sc, mn);
        scale[sb] = d * static_cast<float>(sc);
        offset[sb] = -(dmin * static_cast<float>(mn));
        // As Q4_K's nibbles; sub-block sb's fifth bits are bit sb of each of the 32 qh bytes.
        const uint8_t* q = ql + (sb / 2) * 32;
        for (int l = 0; l < 32; ++l) {
          const int lo = sb % 2 == 0 ? q[l] & 0xF : q[l] >> 4;
          code[sb * 32 + l] = static_cast<int8_t>(lo + ((qh[l] >> sb) & 1 ? 16 : 0));
        }
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
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q8_0:
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_Q6_K: return GgufCudaForm::kInt8;
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
  g.affine = lay.affine;
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
    GgufGroups g = gguf_groups(q, what);
    const torch::Tensor offsets = g.affine ? g.offset.to(device) : torch::Tensor();
    return LinearWeight(Int8Weight::from_codes(g.codes.to(device), g.scale.to(device), g.group, what, offsets));
  }
  // tinygemm tiles 8 rows on CUDA; the CPU's reference kernel 16.
  if (!Int4Weight::fits(q.rows(), q.cols()) || (!device.is_cuda() && q.rows() % 16 != 0)) return std::nullopt;
  GgufGroups g = gguf_groups(q, what);
  const auto nibble = (g.codes.to(torch::kInt32) - g.code_min).to(device);
  const auto zero = g.offset + static_cast<float>(g.code_min + 8) * g.scale;
  return LinearWeight(Int4Weight::from_codes(nibble, g.scale, zero, g.group, what));
}

}  // namespace kvserve
