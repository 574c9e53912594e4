#pragma once
// Decode attention over the paged KV pool: one query token per sequence, one layer, GQA-aware.
#include <torch/torch.h>

#include <string>

#include "cache_manager/kv_quant.h"

namespace kvserve {

// Shared argument shapes (one layer, one decode step):
//   q            [B, H, D] (H = KV * G query heads; query head h reads KV head h / G)
//   pool         [N, 2, KV, block_size, D] (KvBlockPool::storage()); its dtype (the KV cache dtype)
//                may differ from q's: a 16-bit pool is widened as it is read, never q narrowed;
//                with `quant`, uint8 rows [N, 2, KV, block_size, row bytes] of that format, decoded
//                as they are read; `rotated`: the rows are kv_quant_rotate()d K/V (the query is rotated
//                the same way and the output rotated back: attention over the unrotated values)
//   block_table  int32 [B, max_blocks]: sequence b's blocks in slot order; entries past
//                ceil(lengths[b] / block_size) are ignored (pad with any valid id, e.g. 0)
//   lengths      int32 [B]: filled slots per sequence (0 gives a zero output row)
//   scale        softmax scale; <= 0 means 1/sqrt(D)
//   window       > 0: a sliding-window layer, each row sees only its last `window` slots
//                [max(0, length - window), length) (its slots are its positions, uncompressed)
// Returns [B, H, D] in q's dtype. Tables may be on host or on the pool's device.

// Picks the fastest path: the hand-written AVX2 flash-decoding kernel for CPU pools of fp32, bf16,
// fp16 or quantized rows (every KV block read once for all G query heads of its group, 16-bit K/V widened in
// registers, fp32 accumulation, split-K over long contexts, parallel over (sequence, KV head,
// chunk)); libtorch gather + softmax otherwise (CUDA, head_dim or block_size not a multiple of 8).
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& block_table,
                              const torch::Tensor& lengths, double scale = -1.0, int64_t window = 0,
                              KvQuant quant = KvQuant::none, bool rotated = false);

// The libtorch-ops path on its own (batched block gather, masked fp32 softmax); device-agnostic. The
// products run in the wider of q's and the pool's dtype.
torch::Tensor paged_attention_gather(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& block_table,
                                     const torch::Tensor& lengths, double scale = -1.0, int64_t window = 0,
                              KvQuant quant = KvQuant::none, bool rotated = false);

// Slow and obvious: per sequence, rebuild contiguous K/V from its blocks and run plain softmax
// attention in fp64. For tests only.
torch::Tensor paged_attention_reference(const torch::Tensor& q, const torch::Tensor& pool,
                                        const torch::Tensor& block_table, const torch::Tensor& lengths,
                                        double scale = -1.0, int64_t window = 0, KvQuant quant = KvQuant::none,
                                        bool rotated = false);

// Which build of the CPU kernel reads a pool of this dtype and head_dim: "avx512" (AVX-512 F/BW/VL
// and head_dim a multiple of 16), "avx2", or "none" (the gather path). KVSERVE_PAGED_ISA=avx2 in the
// environment keeps the AVX2 build, for A/B runs.
std::string paged_attention_isa(torch::ScalarType pool_dtype = torch::kFloat32, KvQuant quant = KvQuant::none,
                                int64_t head_dim = 64);
// "avx2" keeps the AVX2 build from now on, "avx512" returns to the widest the CPU runs (tests).
void set_paged_attention_isa(const std::string& isa);

// Threads a parallel region of the AVX2 kernel really gets (1 if paged_attention.cpp lost its
// -fopenmp: at::parallel_for is an inline omp pragma). For the test that guards it.
int64_t paged_attention_parallel_width();

}  // namespace kvserve
