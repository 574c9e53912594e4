#pragma once
// Raw-pointer launchers of the CUDA paged decode attention and the device K/V append.
// Plain CUDA on purpose: nvcc never parses ATen here, and the torch wrapper
// (cache_manager/paged_attention_cuda.h) is compiled by the host compiler.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace kvserve::cuda_kernels {

// Element type shared by q, the pool, k/v and out.
enum class DType { kFloat32, kBFloat16, kFloat16 };

// One layer's decode attention over the paged pool, read in place through the block tables.
//   q        [B, H, D] contiguous, H = KV * G (query head h reads KV head h / G)
//   pool     [N, 2, KV, bs, D] contiguous (block, K=0/V=1, KV head, slot, dim)
//   tables   int32 [S, *] row-major with row stride table_stride; row r lists its blocks in slot order
//   rows     int32 [B]: batch entry b uses table row rows[b] and length lengths[rows[b]]
//   lengths  int32 [S] on the device: tokens of the row, including this step's (0: zero output)
//   out      [B, H, D] contiguous
//   window   > 0: a sliding-window layer; entry b sees only its slots [max(0, len - window), len)
//            (its slots are its positions; the blocks before the window are never read)
// Split-K: batch entry b's blocks (from its window's first block on) are cut into num_splits ranges of blocks_per_split blocks (the
// last split also takes any blocks past num_splits * blocks_per_split, so a low hint stays correct,
// only slower). With num_splits > 1 the caller passes the fp32 workspace
//   partial_acc [B, H, num_splits, D] and partial_ml [B, H, num_splits, 2] (see workspace_floats).
// The splits are merged by a second kernel, or with fold_merge by the last CTA of each (b, KV head,
// head chunk) to finish, which then needs split_counters: split_counter_count(...) int32 on the
// device, all 0 on entry; the kernel leaves them 0 again (so one buffer serves every launch on a
// stream, and CUDA graph replays).
struct PagedDecodeArgs {
  const void* q = nullptr;
  const void* pool = nullptr;
  const int32_t* tables = nullptr;
  int64_t table_stride = 0;  // elements between consecutive table rows
  int64_t table_cols = 0;    // usable entries per row (max_blocks); longer lengths are clamped
  const int32_t* rows = nullptr;
  const int32_t* lengths = nullptr;
  int64_t num_rows = 0;  // S, rows of tables and lengths (row ids outside [0, S) read as length 0)
  void* out = nullptr;
  float* partial_acc = nullptr;
  float* partial_ml = nullptr;
  int64_t batch = 0;         // B
  int64_t num_heads = 0;     // H
  int64_t num_kv_heads = 0;  // KV
  int64_t head_dim = 0;      // D
  int64_t num_blocks = 0;    // N (block ids outside [0, N) are skipped, never read)
  int64_t block_size = 0;    // bs
  int num_splits = 1;
  int blocks_per_split = 1;
  float scale = 0.0f;  // softmax scale (already resolved, > 0)
  int64_t window = 0;  // 0: every slot; > 0: the last `window` slots of each entry
  DType dtype = DType::kFloat32;
  // The tuned variants (vector layouts with D >= 64 in 16-bit types or >= 32 in fp32; the other
  // layouts ignore them and run today's kernel and merge kernel).
  bool fold_merge = false;            // merge the splits in the decode kernel (num_splits <= kMaxFoldSplits)
  int32_t* split_counters = nullptr;  // fold_merge with num_splits > 1: split_counter_count(...) zeroed ints
  int loads = 1;                      // 1: today's token passes loaded before use; 2: twice as many
};

// The device scatter of this step's K/V: k, v [B, KV, D] contiguous go to slot lengths[rows[b]] - 1
// of table row rows[b] (block tables[rows[b], slot / bs], offset slot % bs), every KV head.
// Rows whose length is 0 or whose slot lies past table_cols are left untouched.
struct PagedAppendArgs {
  void* pool = nullptr;
  const int32_t* tables = nullptr;
  int64_t table_stride = 0;
  int64_t table_cols = 0;
  const int32_t* rows = nullptr;
  const int32_t* lengths = nullptr;
  int64_t num_rows = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t batch = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  DType dtype = DType::kFloat32;
  bool vectorized = false;  // 16-byte copies where head_dim and the pointers allow
};

// Split-K launch shape, chosen on the host so the grid never depends on device data.
struct SplitPlan {
  int num_splits = 1;
  int blocks_per_split = 1;
};

// CTAs per SM plan_splits aims at unless told otherwise (the tuning of 2026-11; see docs/gpu.md).
constexpr int kDefaultCtasPerSm = 2;

// Enough CTAs for the GPU (about ctas_per_sm per SM) without splits of fewer than a few blocks.
// max_blocks: the most blocks any batch entry needs; sm_count: the device's multiprocessors.
SplitPlan plan_splits(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t max_blocks, int sm_count,
                      int ctas_per_sm = kDefaultCtasPerSm);

// Most splits a folded merge takes (its per-CTA weight table is sized for it); plan_splits never
// plans more.
constexpr int kMaxFoldSplits = 64;

// int32 counters a folded launch needs: one per (batch entry, KV head, head chunk).
int64_t split_counter_count(int64_t batch, int64_t num_heads, int64_t num_kv_heads);

// fp32 elements of the split-K workspace (partial_acc then partial_ml); 0 when num_splits == 1.
size_t workspace_floats(int64_t batch, int64_t num_heads, int64_t head_dim, int num_splits);

// Largest head_dim the kernels take (the register tile per lane is sized for it).
constexpr int64_t kMaxHeadDim = 256;

// Launch on `stream`; returns the launch error (cudaSuccess when queued). The pointers must be
// device pointers to whole elements; 16-byte aligned q / pool / out with D * sizeof(T) % 16 == 0 take
// the vectorised path, anything else the scalar one.
cudaError_t launch_paged_decode(const PagedDecodeArgs& args, cudaStream_t stream);
cudaError_t launch_paged_append(const PagedAppendArgs& args, cudaStream_t stream);

}  // namespace kvserve::cuda_kernels
