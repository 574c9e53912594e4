#pragma once
// Torch-tensor entry points of the CUDA paged decode attention and the device K/V append.
// The kernels read per-layer block tables and lengths in place on the device (no host sync, no
// host-built indices), so a decode step that calls them can be captured in a CUDA graph.
#include <torch/torch.h>

#include <cstdint>

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
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& pool, const torch::Tensor& tables,
                                     const torch::Tensor& rows, const torch::Tensor& lengths, int64_t max_blocks_hint,
                                     double scale = -1.0, int64_t window = 0);

// Writes this step's k, v [B, KV, D] (pool's dtype) into slot lengths[rows[b]] - 1 of table row
// rows[b], for every KV head, on the current stream. Rows must be distinct.
void paged_append(const torch::Tensor& pool, const torch::Tensor& tables, const torch::Tensor& rows,
                  const torch::Tensor& lengths, const torch::Tensor& k, const torch::Tensor& v);

// Whether paged_append copies 16-byte vectors (every load before the first store) where D and the
// pointers allow. On by default, as the fused ops' vectorized level (backend/fused_ops.h) is;
// KVSERVE_FUSED_OPS=0 or 1 turns it off at start.
bool append_vectorized();
void set_append_vectorized(bool on);

}  // namespace kvserve::cuda
