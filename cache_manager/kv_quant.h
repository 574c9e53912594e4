#pragma once
// KvQuant: the quantized row formats a KV pool may store (int8 / fp8 / 4-bit), and their encode / decode.
//
// A pool row is one (token, KV head)'s K or V: head_dim values. A quantized row keeps the values of
// each group of 32 along the head dimension as small integers followed by the group's fp16 scales,
// so a row is self-contained: append, compaction, copy-on-write and the host tier copy rows or
// blocks as bytes, and the block stays the unit of everything. The formats are ggml's (llama.cpp's
// -ctk/-ctv q8_0, q4_0, q4_1), bit for bit, so the `gguf` Python package is their reference:
//   q8_0: [D x int8 q][D/32 x fp16 d]             x = q * d,        d = amax / 127
//   q4_0: [D/2 nibbles][D/32 x fp16 d]            x = (q - 8) * d,  d = (signed max) / -8
//   q4_1: [D/2 nibbles][D/32 x (fp16 d, fp16 m)]  x = q * d + m,    d = (max - min) / 15, m = min
//   fp8_e4m3: [D x e4m3 q][D/32 x fp16 d]         x = q * d,        d = amax / 448
// (fp8_e4m3 is kvserve's: q8_0's layout with OCP e4m3 values, rounded to nearest even, in place of
// int8; its reference is torch's float8_e4m3fn conversion.)
// Nibbles as ggml packs them: byte j of a group holds element j (low) and j + 16 (high).
// Why these and not others is in docs/architecture.md ("Quantized KV").
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace kvserve {

enum class KvQuant : uint8_t { none, q8_0, q4_0, q4_1, fp8_e4m3 };

constexpr int64_t kKvQuantGroup = 32;  // values per scale group along head_dim

// Bytes of one quantized row of head_dim values (head_dim a multiple of 32).
int64_t kv_quant_row_bytes(KvQuant q, int64_t head_dim);
const char* kv_quant_name(KvQuant q);
// How a KV cache dtype reads back in messages and --json: "float16", "int8", "int4", "q4_1", "fp8", ...
std::string kv_cache_dtype_label(torch::ScalarType dtype, KvQuant quant);
// Throws naming `what` unless head_dim suits the format (a multiple of 32).
void check_kv_quant_head_dim(KvQuant q, int64_t head_dim, const std::string& what);

// x [..., D] (any float dtype, CPU or CUDA) -> uint8 [..., row_bytes] on x's device; with `rotate`
// each row is kv_quant_rotate()d before it is quantized.
torch::Tensor kv_quant_encode(const torch::Tensor& x, KvQuant q, bool rotate = false);
// rows uint8 [..., row_bytes] -> [..., D] in `out` dtype on rows' device; with `rotate` each decoded
// row is rotated back.
torch::Tensor kv_quant_decode(const torch::Tensor& rows, KvQuant q, int64_t head_dim,
                              torch::ScalarType out = torch::kFloat32, bool rotate = false);

// The orthonormal Walsh-Hadamard transform of every group of 32 along the last dimension (its own
// inverse). A pool that quantizes stores rotated rows: an outlier channel's magnitude is spread over
// its group, so the group's one scale no longer crushes the other 31 values. Dot products are
// unchanged (q.k = Rq.Rk), so attention reads rotated K/V with a rotated query and rotates its
// output back. x: [..., D] float, D a multiple of 32; returns x's dtype and device.
torch::Tensor kv_quant_rotate(const torch::Tensor& x);
// The same on one row of D floats, in place (a fast Walsh-Hadamard transform per group).
void kv_quant_rotate_row(float* x, int64_t head_dim);
// The transform's scale, 1 / sqrt(32) in fp32 (the device kernels take the host's value).
float kv_quant_rotation_scale();
// Whether quantized pools rotate (KVSERVE_KV_ROTATE=0 turns it off, for A/B runs; default on).
bool kv_quant_rotation_enabled();

// One row, on the host (the kernels and the encoder share these).
// rotate: the row is kv_quant_rotate_row()d (on a copy; x is left alone) before it is encoded.
void kv_quant_encode_row(KvQuant q, const float* x, int64_t head_dim, uint8_t* row, bool rotate = false);
void kv_quant_decode_row(KvQuant q, const uint8_t* row, int64_t head_dim, float* x);
// The values of the 256 e4m3 bytes (OCP fp8, "fn": no infinities, 0x7F / 0xFF are NaN), indexed by byte.
const float* fp8_e4m3_values();

}  // namespace kvserve
