#pragma once
// The CPU paged-attention kernel's internals: what one work item computes, shared by the kernel's
// two builds (paged_attention_kernel.inc compiled for AVX2 and for AVX-512) and the dispatcher in
// paged_attention.cpp that splits a call into work items and merges their partial softmaxes.
// The AVX-512 build includes nothing but this header and intrinsics (no torch, no std algorithms):
// an inline function of a shared header compiled there could replace the baseline copy at link time.
#include <cstdint>

namespace kvserve {
// cache_manager/kv_quant.h's: rotates one row of head_dim floats in place.
void kv_quant_rotate_row(float* x, int64_t head_dim);
}  // namespace kvserve

namespace kvserve::paged_kernel {

// How a pool stores a (token, head) row: floats of a dtype, or one of kv_quant.h's formats.
enum class RowFormat { f32, f16, bf16, q8_0, q4_0, q4_1, fp8_e4m3 };
constexpr int64_t kQuantGroup = 32;  // kv_quant.h's kKvQuantGroup

struct Shapes {
  int64_t B, H, KV, G, D, bs, N, max_blocks;
  int64_t R;  // storage elements per (token, head) row: D, or a quantized row's bytes
  bool rotated = false;  // rows hold kv_quant_rotate()d K/V: q is rotated in, the output back out
  // > 0: each kernel row is a run of G / row_heads consecutive query rows of one sequence (a
  // speculative verify step), row_heads query heads each; query row j of r sees the row's length
  // minus (r - 1 - j) slots (causal), so every K/V block is read once for the whole run.
  int64_t row_heads = 0;
};

// A slice of one (sequence, KV head)'s blocks; long contexts are split so that all threads stay busy.
struct WorkItem {
  int32_t b, kvh, blk_begin, blk_end;
};

// Online-softmax partial over blocks [blk_begin, blk_end) of one work item for the G query heads of
// its KV head: (shapes, q, q scale in log2 units, pool, table row, first visible slot, length, item,
// acc [G, D], m [G], l [G], then scratch: q [G, D], scores [G, bs], K and V tiles [bs, D]).
using ChunkFn = void (*)(const Shapes&, const float*, float, const void*, const int32_t*, int64_t, int64_t,
                         const WorkItem&, float*, float*, float*, float*, float*, float*, float*);

// The kernel for a row format, head_dim D and group size G; null where a build has none: without
// AVX2 + FMA, fp16 and quantized rows without F16C, or, for AVX-512, D not a multiple of 16.
ChunkFn select_avx2(RowFormat format, int64_t D, int64_t G);
// Call only where cpu_has_avx512(): the whole file is compiled for AVX-512.
ChunkFn select_avx512(RowFormat format, int64_t D, int64_t G);
// Whether this CPU runs the AVX-512 build (F, BW and VL); checked by baseline code.
bool cpu_has_avx512();

}  // namespace kvserve::paged_kernel
