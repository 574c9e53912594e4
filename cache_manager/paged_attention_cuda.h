#pragma once
// Torch-tensor entry points of the CUDA paged decode attention and the device K/V append.
// The kernels read per-layer block tables and lengths in place on the device (no host sync, no
// host-built indices), so a decode step that calls them can be captured in a CUDA graph.
#include <torch/torch.h>

#include <cstdint>

#include "cache_manager/kv_quant.h"

namespace kvserve::cuda {

// True when this build has the CUDA kernels (KVSERVE_WITH_CUDA and nvcc found at configure time).
bool compiled();

// Decode attention of one layer, one query token per batch entry, reading K/V from the pool.
//   q        [B, H, D] bf16 / fp16 / fp32 on CUDA (H = KV * G)
//   pool     [N, 2, KV, bs, D] contiguous, q's dtype and device (KvBlockPool::storage())
//   tables   int32 [S, max_blocks] (rows may be strided, entries contiguous): row r's blocks in slot order
//   rows     int32 [B]: batch entry b reads table row rows[b]
//   lengths  int32 [S]: tokens of each row including the one appended this step (0: zero output)
//   max_blocks_hint: the most blocks any batch entry's length needs, known on the host; it only
//            sizes the split-K launch (a low hint is slower, never wrong; keep it fixed across a
//            captured graph)
//   scale    softmax scale; <= 0 means 1/sqrt(D)
//   window   > 0: a sliding-window layer, each entry sees only its last `window` slots
//            [max(0, length - window), length) (its slots are its positions); 0: every slot
// Returns [B, H, D] in q's dtype on q's device, queued on the current stream. D <= 256.
// With the folded merge (decode_tuning()), launches on one device share one counter buffer, so they
// must not run concurrently on two streams; the first launch that needs more counters than any
// before grows that buffer, which throws if the stream is capturing a CUDA graph (run the step
// once eagerly first, as DecodeGraphs does).
// With `quant`, the pool holds uint8 rows [N, 2, KV, bs, row bytes] of that format (kv_quant.h),
// read and dequantized in the kernel (q is converted to fp32 for it and the output back); `rotated`:
// the rows are kv_quant_rotate()d (q is rotated the same way and the output rotated back). The
// quantized kernel always merges splits with the second kernel (the tuning's fold and loads apply to
// 16/32-bit pools) and needs head_dim a multiple of 32.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& tables,
                                     const torch::Tensor& rows, const torch::Tensor& lengths, int64_t max_blocks_hint,
                                     double scale = -1.0, int64_t window = 0, KvQuant quant = KvQuant::none,
                                     bool rotated = false);

// Variant of paged_decode_attention's kernel for the GPU bandwidth sweep (issue 34,
// bench/bench_paged_decode_cuda.cpp); the defaults are the kernel as it was before the sweep.
struct DecodeTuning {
  int ctas_per_sm = 2;      // CTAs per SM the split-K plan aims at (KVSERVE_DECODE_CTAS_PER_SM, 1 to 32)
  int loads = 1;            // token passes loaded before use, x1 or x2 (KVSERVE_DECODE_LOADS=1|2)
  bool fold_merge = false;  // the decode kernel merges its own splits (KVSERVE_DECODE_MERGE=kernel|fold)
};

// The tuning paged_decode_attention uses: the environment's, read on first use (a bad value throws
// a KvError naming the variable and its allowed values), unless set_decode_tuning replaced it.
// loads = 2 and the folded merge apply to the vector kernels of D >= 64 (16-bit types) or D >= 32
// (fp32); other head dims and unaligned views keep today's kernel and merge.
DecodeTuning decode_tuning();
// Replaces the tuning for every later call (checked like the environment's); for tests and benchmarks.
void set_decode_tuning(const DecodeTuning& tuning);
// Parses the three variables' values (nullptr or "": unset, the default).
DecodeTuning parse_decode_tuning(const char* ctas_per_sm, const char* loads, const char* merge);

// The split-K launch shape paged_decode_attention picks for a batch whose longest entry needs
// max_blocks blocks on a device with sm_count multiprocessors (host arithmetic; throws in a build
// without the kernels).
struct DecodeSplitPlan {
  int num_splits = 1;
  int blocks_per_split = 1;
};
DecodeSplitPlan decode_split_plan(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t max_blocks,
                                  int sm_count, int ctas_per_sm = DecodeTuning{}.ctas_per_sm);

// The folded merge's split counters on `device` (int32, all zero between launches), or an undefined
// tensor before the first folded launch there; for tests that check that every launch resets them.
torch::Tensor decode_split_counters(const torch::Device& device);

// Writes this step's k, v [B, KV, D] (pool's dtype) into slot lengths[rows[b]] - 1 of table row
// rows[b], for every KV head, on the current stream. Rows must be distinct. With `quant`, k and v
// (float32 / bfloat16 / float16) are encoded into the pool's rows as kv_quant_encode would (rotated
// first with `rotate`), bit for bit.
void paged_append(const torch::Tensor& pool, const torch::Tensor& tables, const torch::Tensor& rows,
                  const torch::Tensor& lengths, const torch::Tensor& k, const torch::Tensor& v,
                  KvQuant quant = KvQuant::none, bool rotate = false);

// Whether paged_append copies 16-byte vectors (every load before the first store) where D and the
// pointers allow. On by default, as the fused ops' vectorized level (backend/kernels/fused_ops.h) is;
// KVSERVE_FUSED_OPS=0 or 1 turns it off at start.
bool append_vectorized();
void set_append_vectorized(bool on);

}  // namespace kvserve::cuda
